"""Reaching the Hugging Face Hub. Offline, transformers and datasets retry for ~30 s per file before
giving up; one short probe lets shardlm go straight to the local HF cache, or fail with its message."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

_TRUE = {"1", "true", "yes", "on"}
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@functools.cache
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """False when HF_HUB_OFFLINE is set or the Hub's host cannot be connected to directly."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        return False
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return True  # a direct probe says nothing about a proxied route: let the libraries try
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def hub_kwargs(source: str) -> dict:
    """Extra `from_pretrained` arguments for `source` (a local folder or a hub name): for a hub name while
    the Hub is unreachable, the local HF cache only."""
    return {} if Path(source).exists() or hub_reachable() else {"local_files_only": True}

"""`shardlm env`: what a bug report needs — versions, devices, launcher, caches — as text or one JSON object.

Nothing here initializes a process group or touches the network; package versions come from the installed
metadata, so libraries that are slow to import (transformers, datasets) are not imported.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

PACKAGES = ("shardlm", "torch", "torch_xla", "transformers", "peft", "datasets", "torchao", "bitsandbytes",
            "accelerate", "safetensors", "tokenizers", "huggingface_hub", "numpy")
ENV_VARS = ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "HF_HOME", "SHARDLM_CACHE", "CUDA_VISIBLE_DEVICES",
            "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PJRT_DEVICE",
            "CPU_NUM_DEVICES", "XLA_FLAGS")
NOT_INSTALLED = "not installed"


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _torch_build(torch) -> dict:
    build = {"cuda": torch.version.cuda, "cudnn": None, "nccl": None, "hip": getattr(torch.version, "hip", None)}
    if torch.version.cuda or build["hip"]:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        build["cudnn"] = str(cudnn) if cudnn else None
        try:
            nccl = torch.cuda.nccl.version()
            build["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception:  # noqa: BLE001 - a build without NCCL: report it as absent
            build["nccl"] = None
    return build


def _devices(torch) -> dict:
    cuda = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cuda.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 2**30, 1),
                         "capability": f"{p.major}.{p.minor}"})
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cuda": cuda, "cpu_count": os.cpu_count(), "cpus_usable": usable,
            "torch_threads": torch.get_num_threads()}


def _hf_cache() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:
        return os.path.join(os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")


def collect() -> dict:
    """Everything `shardlm env` reports, as a JSON-ready dict."""
    import torch

    import shardlm
    from shardlm.data.cache import cache_root
    from shardlm.distributed.process_group import detect_launch

    try:
        launch = detect_launch()
        launcher = {"launcher": launch.launcher, "rank": launch.rank, "world_size": launch.world_size,
                    "local_rank": launch.local_rank, "local_world_size": launch.local_world_size,
                    "nodes": launch.num_nodes, "master": f"{launch.master_addr}:{launch.master_port}"}
    except Exception as e:  # noqa: BLE001 - a half-set launcher environment is exactly what a report should show
        launcher = {"launcher": "unknown", "error": str(e)}
    return {
        # torch's own version string keeps the build tag (+cu128, +cpu) that PyPI wheels leave out of their metadata
        "versions": {"python": sys.version.split()[0], **{name: package_version(name) for name in PACKAGES},
                     "torch": torch.__version__},
        "shardlm_path": os.path.dirname(os.path.abspath(shardlm.__file__)),
        "platform": platform.platform(),
        "torch_build": _torch_build(torch),
        "devices": _devices(torch),
        "launch": launcher,
        "caches": {"token_cache": str(cache_root(None)), "hf_cache": _hf_cache()},
        "env": {name: os.environ.get(name) for name in ENV_VARS},
    }


def _row(key: str, value) -> str:
    return f"{(key + ':').ljust(17)} {value}"


def render(info: dict, as_json: bool = False) -> str:
    """Plain `key: value` lines (paste them into a bug report as they are), or one JSON object."""
    if as_json:
        return json.dumps(info)
    lines = [_row(name, version) for name, version in info["versions"].items()]
    build = info["torch_build"]
    if build["cuda"] or build["hip"]:
        parts = [f"{k} {v or 'none'}" for k, v in build.items() if k != "hip" or v]
        lines.append(_row("torch build", ", ".join(parts)))
    else:
        lines.append(_row("torch build", "CPU only (no CUDA)"))
    lines.append(_row("shardlm path", info["shardlm_path"]))
    lines.append(_row("platform", info["platform"]))
    dev = info["devices"]
    if dev["cuda"]:
        lines += [_row(f"cuda:{d['index']}", f"{d['name']}, {d['memory_gb']} GiB, sm {d['capability']}")
                  for d in dev["cuda"]]
    else:
        lines.append(_row("cuda devices", "no CUDA"))
    lines.append(_row("cpus", f"{dev['cpu_count']} ({dev['cpus_usable']} usable by this process; torch threads: "
                              f"{dev['torch_threads']})"))
    launch = info["launch"]
    if "error" in launch:
        lines.append(_row("launcher", f"unknown ({launch['error']})"))
    else:
        lines.append(_row("launcher", f"{launch['launcher']}, rank {launch['rank']} of {launch['world_size']} "
                                      f"(local rank {launch['local_rank']} of {launch['local_world_size']}, "
                                      f"{launch['nodes']} node(s), master {launch['master']})"))
    lines.append(_row("token cache", info["caches"]["token_cache"]))
    lines.append(_row("hf cache", info["caches"]["hf_cache"]))
    lines += [_row(name, "(unset)" if value is None else value) for name, value in info["env"].items()]
    return "\n".join(lines)

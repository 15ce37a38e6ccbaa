"""Reaching the Hugging Face Hub. Offline, transformers and datasets retry for ~30 s per file before
giving up; one short probe lets shardlm go straight to the local HF cache, or fail with its message.
`push_folder` uploads an exported model (`shardlm export RUN OUT --push-to-hub REPO`)."""

from __future__ import annotations

import difflib
import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from shardlm import ShardlmError

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


def push_folder(folder: Path, repo_id: str, private: bool = False) -> str:
    """Uploads an export folder to the Hub model repo `repo_id` (created if missing, `private` then); returns
    its URL. The token is HF_TOKEN or the `hf auth login` one; HF_ENDPOINT picks another Hub. Any failure is
    one line that says the local export is complete, since the folder is written before this is called."""
    from huggingface_hub import HfApi, constants, get_token

    where = f"the export in '{folder}' is complete; push it later with `hf upload {repo_id} {folder}`"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        raise ShardlmError(f"--push-to-hub: HF_HUB_OFFLINE is set, so nothing was uploaded; {where}.")
    token = get_token()
    if not token:
        raise ShardlmError(f"--push-to-hub needs a Hugging Face token with write access: set HF_TOKEN or run "
                           f"`hf auth login`; {where}.")
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    api = HfApi(endpoint=endpoint, token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                          commit_message="Upload model exported by shardlm")
    except Exception as e:  # noqa: BLE001 - httpx, requests and the Hub's HTTP errors alike: one line, not a trace
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ShardlmError(f"--push-to-hub {repo_id} failed ({endpoint}: {reason}); {where}.") from None
    return str(url)


PATH_PREFIXES = ("./", "../", "/", "~", ".\\", "..\\")


def looks_like_path(name: str) -> bool:
    """Written as a path (./, ../, /, ~), inside a folder that exists, or a path a bundled recipe's flow makes
    (FLOW_STEPS): never meant as a hub name."""
    if name.startswith(PATH_PREFIXES) or name in (".", "..") or flow_step(name):
        return True
    return any(p.is_dir() for p in Path(name).expanduser().parents if p != Path("."))


def check_model_path(name: str) -> None:
    """A path-looking model.name must be a folder with a config.json. The tokenizer is loaded first and would
    otherwise fail on a mistyped path and blame itself (advising model.tokenizer=gpt2)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            out = f"{name.rstrip('/')}-hf"
            raise ShardlmError(f"cannot load model '{name}': it is a folder without a config.json. Point model.name "
                               "at a folder saved with save_pretrained or `shardlm export` (config.json and weights); "
                               f"a shardlm run or checkpoint is exported first: shardlm export {name} {out}, then "
                               f"model.name={out}.")
        return
    if not looks_like_path(name):
        return
    fix = ("Point model.name at a folder holding config.json and the weights (saved with save_pretrained or "
           "`shardlm export`), or give a hub name such as gpt2.")
    if path.exists():
        raise ShardlmError(f"model.name '{name}' is a file, not a folder. {fix}")
    raise ShardlmError(f"model.name '{name}' is a path that does not exist.{nearest_path(name)} {fix}")


# What the bundled recipes read that an earlier step of their flow makes (a recipe's header names its flow), and
# the commands that make it, from a checkout (benchmarks/ is not installed): a user who runs `shardlm train
# grpo_tiny` first is told the step, not only that a path is missing.
FLOW_STEPS = {
    "runs/chat_tiny-hf": "shardlm train chat_tiny && shardlm export runs/chat_tiny runs/chat_tiny-hf",
    "runs/chat_tiny-pairs": "python benchmarks/dpo_pairs.py runs/chat_tiny-hf runs/chat_tiny-pairs --train 3000 "
                            "(after making runs/chat_tiny-hf)",
    "runs/sort": "python benchmarks/grpo_demo.py --data-only",
    "runs/sort_tiny-hf": "python benchmarks/grpo_demo.py --data-only && shardlm train sort_tiny && shardlm export "
                         "runs/sort_tiny runs/sort_tiny-hf",
    "runs/sort/grpo-hf": "make demo-rl",
    "runs/sort/distill": "make demo-rl && python benchmarks/distill_demo.py --data-only",
}


def flow_step(name: str | Path) -> str:
    """` An earlier step of the bundled recipes' flow makes it: CMD.` for a path FLOW_STEPS names (the longest
    product that holds it: runs/sort/distill's step is not runs/sort's), else ""."""
    path = Path(name).as_posix().removeprefix("./")
    made = [product for product in FLOW_STEPS if path == product or path.startswith(product + "/")]
    return f" An earlier step of the bundled recipes' flow makes it: {FLOW_STEPS[max(made, key=len)]}." if made else ""


def nearest_path(name: str | Path, folder: bool = True) -> str:
    """` Did you mean 'X'?` for the existing path one component away from `name` (the closest sibling of its first
    missing part: a folder, or with `folder=False` any file), or "" when none is close; for a path a bundled
    recipe's flow makes, the command that makes it (flow_step)."""
    if step := flow_step(name):
        return step
    name = str(name)
    parts = Path(name).parts
    for i, part in enumerate(parts):
        base = Path(*parts[:i]).expanduser() if i else Path(".")
        if not (base / part).expanduser().exists():
            break
    else:
        return ""
    siblings = [p.name for p in base.iterdir() if p.is_dir() or not folder] if base.is_dir() else []
    match = difflib.get_close_matches(part, siblings, n=1, cutoff=0.6)
    if not match:
        return ""
    guess = str(Path(*parts[:i], match[0], *parts[i + 1:]))
    guess = "./" + guess if name.startswith("./") else guess
    found = Path(guess).expanduser()
    return f" Did you mean '{guess}'?" if (found.is_dir() if folder else found.exists()) else ""

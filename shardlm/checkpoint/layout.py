"""The run folder's layout: the one owner of its file names, and the readers that find checkpoints in it.

    OUT_DIR/config.yaml  metrics.jsonl  metrics.superseded.jsonl  tensorboard/  plots/  hf/
    OUT_DIR/checkpoints/latest  step_000000123/{manifest.json, trainer_state.json, config.yaml, hf_config.json,
                                                tokenizer/, rng_rank00000.json, .metadata, DCP shards}

A checkpoint folder appears whole: it is written as `step_N.tmp/` and renamed once its manifest is written
(shardlm.checkpoint.checkpointer). "Complete" means: manifest present, DCP metadata readable, every shard file
it names present.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
import yaml

from shardlm import ShardlmError
from shardlm.config import Config, config_from_dict
from shardlm.hub import nearest_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CONFIG = "config.yaml"  # the run's resolved config (run folder and each checkpoint)
METRICS = "metrics.jsonl"
SUPERSEDED = "metrics.superseded.jsonl"  # records of steps a resumed run trained again (shardlm.observe.metrics)
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"  # written last: its presence makes a checkpoint complete
TRAINER_STATE = "trainer_state.json"
HF_CONFIG = "hf_config.json"
TOKENIZER = "tokenizer"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def run_dir_of(ckpt: Path) -> Path | None:
    """The run folder a checkpoint belongs to (None for a checkpoint folder copied elsewhere)."""
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else None


def read_manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MANIFEST).read_text())


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def is_complete(path: Path) -> str | None:
    """None if `path` is a complete checkpoint, else why not (one line)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (the write did not finish)"
    try:
        json.loads(manifest.read_text())
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read means torn
        return f"unreadable metadata ({type(e).__name__})"
    for item in metadata.storage_data.values():
        shard = path / item.relative_path
        if not shard.is_file() or shard.stat().st_size < item.offset + item.length:
            return f"shard file {item.relative_path} is missing or truncated"
    return None


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under `root` (a run dir or its checkpoints/ folder), newest first."""
    root = root / CHECKPOINTS if (root / CHECKPOINTS).is_dir() else root
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)


def newest_complete(root: Path, log=print) -> Path | None:
    for path in list_checkpoints(root):
        problem = is_complete(path)
        if problem is None:
            return path
        log(f"warning: skipping checkpoint {path.name}: {problem}")
    return None


def resolve_checkpoint(path: str | Path, log=print) -> Path:
    """A checkpoint folder, or a run dir's newest complete one."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ShardlmError(f"checkpoint path '{path}' does not exist.{nearby(path)} Give a run dir (its newest "
                           "checkpoint is used) "
                           "or a checkpoint folder RUN/checkpoints/step_N; to train, checkpoint.resume=auto resumes "
                           "out_dir's own and checkpoint.resume=none starts fresh.")
    if (path / MANIFEST).is_file() or path.name.startswith("step_"):
        problem = is_complete(path)
        if problem:
            raise ShardlmError(f"checkpoint '{path}' is incomplete: {problem}. Use an earlier one or the run dir.")
        return path
    found = newest_complete(path, log)
    if found is None:
        what = "every checkpoint in it is incomplete" if list_checkpoints(path) else "it has none"
        raise ShardlmError(f"no complete checkpoint in '{path}' ({what}): give a run dir that has saved one (a run "
                           "saves at its end and every checkpoint.every steps) or a checkpoint folder "
                           "RUN/checkpoints/step_N; to train from the start, use checkpoint.resume=none.")
    return found




def resume_target(spec: str, root: Path, log=print) -> Path | None:
    """The checkpoint `checkpoint.resume` names: none, the newest complete one under `root` (auto), or a path."""
    if spec == "none":
        return None
    return newest_complete(root, log) if spec == "auto" else resolve_checkpoint(spec, log)


def nearby(path: Path) -> str:
    """The checkpoints beside a missing one (`step_9` for `step_000000009`), else the closest existing folder."""
    if path.parent.name == CHECKPOINTS and path.parent.is_dir():
        names = [p.name for p in list_checkpoints(path.parent)][:3]
        return f" That folder holds {', '.join(names)}." if names else " That folder holds no checkpoint."
    return nearest_path(path)


def read_config(folder: Path) -> Config:
    """The config a run folder or checkpoint recorded (keys removed since are ignored)."""
    return config_from_dict(yaml.safe_load((folder / CONFIG).read_text()) or {})


def read_hf_config(ckpt: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    return AutoConfig.for_model(**json.loads((ckpt / HF_CONFIG).read_text()))


def tokenizer_dir(ckpt: Path) -> Path:
    return ckpt / TOKENIZER


def metrics_file(run_dir: Path) -> Path:
    return run_dir / METRICS


def superseded_file(run_dir: Path) -> Path:
    return run_dir / SUPERSEDED

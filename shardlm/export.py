"""`shardlm export`: a checkpoint (or run dir) -> a Hugging Face folder that `from_pretrained` and
`pipeline("text-generation")` load offline: config.json, model.safetensors (sharded with an index when
large), generation_config.json and the tokenizer files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shardlm import ShardlmError
from shardlm.load import is_hf_folder, load_for_inference
from shardlm.model import context_length


def _check_target(out: Path) -> None:
    """Export replaces only an empty folder or an earlier export, never a folder of something else."""
    if out.exists() and not out.is_dir():
        raise ShardlmError(f"export target '{out}' is a file; give a folder.")
    if out.is_dir() and any(out.iterdir()) and not is_hf_folder(out):
        raise ShardlmError(f"export target '{out}' is a folder that holds other files (not an earlier export); "
                           "give a new or empty folder.")


def export(path: str | Path, out_dir: str | Path, max_shard_size: str = "2GB") -> Path:
    from transformers import GenerationConfig

    out = Path(out_dir).expanduser()
    _check_target(out)
    model, tokenizer, _cfg, _ckpt = load_for_inference(path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        eos = tokenizer.eos_token_id
        model.config.bos_token_id = model.config.eos_token_id = eos
        model.config.use_cache = True
        positions = context_length(model.config) or 200  # a pipeline() call must not run past the positions
        model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                                                   do_sample=True, max_new_tokens=min(100, positions // 2))
        model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(str(tmp))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShardlmError(f"export to '{out}' failed: {e.strerror or e}.") from None
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out

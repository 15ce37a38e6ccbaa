"""`shardlm export`: a checkpoint (or run dir) -> a Hugging Face folder that `from_pretrained` and
`pipeline("text-generation")` load offline: config.json, model.safetensors (sharded with an index when
large), generation_config.json and the tokenizer files. A LoRA run exports merged (base + adapter folded
into one model) by default, or with `adapter=True` (`--adapter`) as a PEFT adapter folder
(adapter_config.json, adapter_model.safetensors, tokenizer) that `peft.PeftModel.from_pretrained(base, OUT)`
loads onto its base."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shardlm import ShardlmError
from shardlm.load import is_adapter_folder, is_hf_folder, load_for_inference
from shardlm.model import context_length


def _check_target(out: Path) -> None:
    """Export replaces only an empty folder or an earlier export, never a folder of something else."""
    if out.exists() and not out.is_dir():
        raise ShardlmError(f"export target '{out}' is a file; give a folder.")
    if out.is_dir() and any(out.iterdir()) and not (is_hf_folder(out) or is_adapter_folder(out)):
        raise ShardlmError(f"export target '{out}' is a folder that holds other files (not an earlier export); "
                           "give a new or empty folder.")


def _replace(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def export_adapter(path: str | Path, out: Path) -> Path:
    """A LoRA checkpoint (or run dir) -> a PEFT adapter folder; the base it names is the run's model.name."""
    import sys

    import yaml

    from shardlm.checkpoint import resolve_checkpoint
    from shardlm.config import config_from_dict
    from shardlm.load import load_lora_checkpoint, manifest_of

    source = Path(path).expanduser()
    if not source.exists():
        raise ShardlmError(f"'{source}' does not exist: give a LoRA run dir or checkpoint.")
    if is_hf_folder(source) or is_adapter_folder(source):
        raise ShardlmError(f"export --adapter reads a LoRA run dir or checkpoint; '{source}' is an exported folder. "
                           "Give the run dir it came from.")
    ckpt = resolve_checkpoint(source, log=lambda m: print(m, file=sys.stderr))
    if not manifest_of(ckpt).get("lora"):
        raise ShardlmError(f"export --adapter writes a LoRA adapter, but {ckpt} is a full fine-tuning checkpoint "
                           "(lora.r=0): it has no adapter. Export it without --adapter (a full model folder).")
    cfg = config_from_dict(yaml.safe_load((ckpt / "config.yaml").read_text()))
    model = load_lora_checkpoint(ckpt, cfg)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(ckpt / "tokenizer")).save_pretrained(str(tmp))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShardlmError(f"export to '{out}' failed: {e.strerror or e}.") from None
    _replace(tmp, out)
    return out


def export(path: str | Path, out_dir: str | Path, max_shard_size: str = "2GB", adapter: bool = False) -> Path:
    from transformers import GenerationConfig

    out = Path(out_dir).expanduser()
    _check_target(out)
    if adapter:
        return export_adapter(path, out)
    model, tokenizer, _cfg, _ckpt = load_for_inference(path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        eos = tokenizer.eos_token_id
        model.config.bos_token_id = model.config.eos_token_id = eos
        model.config.use_cache = True
        positions = context_length(model.config)
        if model.config.model_type == "gpt2" and positions:
            model.config.n_ctx = positions  # llama.cpp's convert_hf_to_gguf.py still reads GPT-2's n_ctx
        if positions:
            tokenizer.model_max_length = positions  # not GPT-2's 1024: other tools cut prompts by it
        # samples like `shardlm generate` (temperature 0.8, no top-k); never runs past the positions
        model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                                                   do_sample=True, temperature=0.8, top_k=0,
                                                   max_new_tokens=min(100, (positions or 200) // 2))
        model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(str(tmp))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShardlmError(f"export to '{out}' failed: {e.strerror or e}.") from None
    _replace(tmp, out)
    return out

"""`shardlm train CONFIG --dry-run`: every check a run makes before its first step, without the work.

The config is validated, the data specs resolved (files found and the first records of each read, so a missing
CSV column or a malformed first line shows; Hugging Face datasets named, not downloaded), the tokenizer and the
model's config read, the parameters counted on the `meta` device (LoRA's adapters injected there, so target
errors show), the checkpoint a run would resume checked against the config (model, LoRA rank, alpha, targets
and base), and the parallel plan checked for the world size the run would have. Nothing is written: no out_dir,
no cache.
A hub name that cannot be reached offline is reported as such rather than failed, so a config written for
a networked machine still validates here.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import torch

from shardlm import ShardlmError, lora
from shardlm.config import Config

PEEK_FILES, PEEK_RECORDS = 100, 2  # what of the data a dry run reads


def _data_line(name: str, spec: str | None, default_split: str, data_files=None, field: str = "text") -> str:
    from shardlm.data.sources import iter_documents, resolve

    if spec is None:
        return f"{name}: none (the tail of the training data is held out)"
    source = resolve(spec, default_split, data_files)
    if source.hf:
        repo, config, split = source.hf
        return f"{name}: Hugging Face dataset {repo}" + (f"/{config}" if config else "") + f", split {split}" \
            " (not downloaded by a dry run)"
    for path in source.files[:PEEK_FILES]:
        list(itertools.islice(iter_documents(dataclasses.replace(source, files=(path,)), field), PEEK_RECORDS))
    size = sum(p.stat().st_size for p in source.files)
    return f"{name}: {len(source.files)} file(s), {size / 1e6:.1f} MB"


def _model_lines(cfg: Config) -> list[str]:
    from shardlm.hub import hub_reachable
    from shardlm.model import empty_model, model_config, num_params
    from shardlm.tokenizer import model_tokenizer, tokenizer_spec

    try:
        tokenizer = model_tokenizer(cfg.model)
        hf_cfg = model_config(cfg, tokenizer)
    except ShardlmError as e:
        names = [n for n in dict.fromkeys((cfg.model.name, tokenizer_spec(cfg.model)))
                 if n and n != "bytes" and re.fullmatch(r"[\w][\w.-]*(/[\w][\w.-]*)?", n)
                 and not Path(n).expanduser().exists()]
        if names and not hub_reachable() and "cannot be reached" in str(e):
            return [f"model: {cfg.model.name or 'from scratch'}; not checked: {', '.join(names)} is a hub name, "
                    "the Hub cannot be reached and it is not in the local HF cache (it downloads when online)"]
        raise
    model = empty_model(hf_cfg, "meta")
    if lora.enabled(cfg):
        lora.apply(model, cfg.lora)
    n, trainable = num_params(model), num_params(model, trainable_only=True)
    what = cfg.model.name or f"from scratch ({hf_cfg.model_type})"
    adapters = f" ({trainable / 1e6:.2f}M trainable: LoRA r={cfg.lora.r})" if lora.enabled(cfg) else ""
    return [f"model: {what}, {n / 1e6:.2f}M parameters{adapters}; tokenizer {tokenizer_spec(cfg.model)}, "
            f"{len(tokenizer)} tokens", *_resume_lines(cfg, hf_cfg)]


def _resume_lines(cfg: Config, hf_cfg) -> list[str]:
    """The checks a run makes on the checkpoint it would resume (Checkpointer.load), before loading it."""
    from shardlm.checkpoint import check_resumable, resume_target

    path = resume_target(cfg.checkpoint.resume, Path(cfg.out_dir), log=lambda *_: None)
    if path is None:
        return []
    manifest = check_resumable(path, cfg, hf_cfg, lambda known: lora.base_identity(cfg.model.name, known)
                               if lora.enabled(cfg) and cfg.model.name else None)
    return [f"resume: {path} (step {manifest['step']})"]


def dry_run(cfg: Config, world_size: int) -> str:
    from shardlm import xla
    from shardlm.dist import pick_device
    from shardlm.parallel import plan

    explicit = cfg.parallel.device != "auto" or xla.wanted("auto")
    device = pick_device(cfg.parallel.device, 0) if explicit else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pl = plan(cfg, world_size, world_size, device)
    train = cfg.data.train
    d = cfg.data
    specs = [(f"data.train[{i}]", spec) for i, spec in enumerate(train)] if isinstance(train, list) else \
        [("data.train", train)]
    lines = [*(_data_line(name, spec, "train", d.data_files, d.text_field) for name, spec in specs),
             _data_line("data.val", d.val, "validation", d.data_files, d.text_field),
             *_model_lines(cfg),
             f"plan: {world_size} rank(s) on {device.type}, "
             + (f"FSDP2 {cfg.parallel.sharding} mesh {pl.mesh_shape}" if pl.use_fsdp else "no FSDP")
             + f", {cfg.parallel.precision}, compile {pl.compile}",
             f"global batch: {world_size} x {cfg.train.batch_size} x {cfg.train.grad_accum} blocks of "
             f"{cfg.data.seq_len} tokens; out_dir {cfg.out_dir}",
             "dry run: the config is valid; nothing was trained or written"]
    return "\n".join(lines)

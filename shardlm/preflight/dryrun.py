"""`shardlm train CONFIG --dry-run`: every check a run makes before its first step, without the work.

The checks are the run's own list (shardlm.training.checks), run in the run's order on what a dry run has instead
of the work: the device and parallel plan for the world size the run would have; the trackers, QLoRA's needs, the
optimizer, out_dir and the optimizer of the checkpoint it would resume; the tokenizer and the model's config, the
parameters counted on the `meta` device (LoRA's adapters injected there, so target errors show); the data (files
found and the first records of each read, so a missing CSV column or a malformed first line shows); the blocks
against the model, the objective, the global batch and the schedule; train.gen_every's needs; and the checkpoint
a run would resume checked against the config (model, LoRA rank, alpha, targets and base) and, for a preference
run, against its reference.
The blocks come from each source's token count: its cache's if built, else the source tokenized in memory until
it has more than the checks need. The run's own code then cuts them (`prepare_data`, `check_data`), so data
too short for a validation block or a global batch fails here with the run's message. Hugging Face datasets are
named, not downloaded (nor counted). Nothing is written: no out_dir, no cache.
A hub name that cannot be reached offline is reported as such rather than failed, so a config written for
a networked machine still validates here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path

from shardlm import ShardlmError
from shardlm.config import Config, DataConfig, objectives
from shardlm.data import Split
from shardlm.distributed.parallelize import Plan, check_model
from shardlm.models import lora
from shardlm.objectives import objective_family
from shardlm.training import checks

PEEK_FILES, PEEK_RECORDS = 100, 2  # what of the data a dry run reads


def _data_line(name: str, spec: str | None, default_split: str, d: DataConfig, prompts: bool = False) -> str:
    from shardlm.data.examples import source_format
    from shardlm.data.sources import iter_documents, resolve

    if spec is None:
        return f"{name}: none (the tail of the training data is held out)"
    source = resolve(spec, default_split, d.data_files)
    if source.hf:
        repo, config, split = source.hf
        return f"{name}: Hugging Face dataset {repo}" + (f"/{config}" if config else "") + f", split {split}" \
            " (not downloaded by a dry run)"
    if prompts:  # any records with a prompt (or chat messages): read by prepare_prompts, which says what it lacks
        return f"{name}: {len(source.files)} file(s), {sum(p.stat().st_size for p in source.files) / 1e6:.1f} MB; " \
            "prompts for online RL"
    fmt, variant, _ = source_format(source, d)
    if fmt == "text":
        for path in source.files[:PEEK_FILES]:
            list(itertools.islice(iter_documents(dataclasses.replace(source, files=(path,)), d.text_field),
                                  PEEK_RECORDS))
    size = sum(p.stat().st_size for p in source.files)
    line = f"{name}: {len(source.files)} file(s), {size / 1e6:.1f} MB"
    if fmt == "text":
        return line
    how = "data.format" if d.format != "auto" else "detected from its fields"
    return f"{line}; {fmt} ({variant}, {how})"


def _model(cfg: Config, pl: Plan) -> tuple[object | None, object | None, list[str]]:
    """(tokenizer, HF config, lines); the tokenizer or config is None where a hub name cannot be reached."""
    from shardlm.hub import hub_reachable
    from shardlm.models.causal_lm import num_params
    from shardlm.models.hf_config import model_config
    from shardlm.models.instantiate import empty_model
    from shardlm.tokenizer import model_tokenizer, tokenizer_spec

    tokenizer = None
    try:
        tokenizer = model_tokenizer(cfg.model)
        hf_cfg = model_config(cfg, tokenizer)
    except ShardlmError as e:
        failed = (cfg.model.name,) if tokenizer is not None else (cfg.model.name, tokenizer_spec(cfg.model))
        names = [n for n in dict.fromkeys(failed) if n and n != "bytes"
                 and re.fullmatch(r"[\w][\w.-]*(/[\w][\w.-]*)?", n) and not Path(n).expanduser().exists()]
        if names and not hub_reachable() and "cannot be reached" in str(e):
            return tokenizer, None, [f"model: {cfg.model.name or 'from scratch'}; not checked: {', '.join(names)} "
                                     "is a hub name, the Hub cannot be reached and it is not in the local HF cache "
                                     "(it downloads when online)"]
        raise
    model = empty_model(hf_cfg, "meta")
    if lora.enabled(cfg.lora):
        lora.apply(model, cfg.lora)
    memory = check_model(model, cfg, pl)  # activation checkpointing's every:N and parallel.wrap's size:N
    n, trainable = num_params(model), num_params(model, trainable_only=True)
    what = cfg.model.name or f"from scratch ({hf_cfg.model_type})"
    adapters = f" ({trainable / 1e6:.2f}M trainable: LoRA r={cfg.lora.r})" if lora.enabled(cfg.lora) else ""
    return tokenizer, hf_cfg, [f"model: {what}, {n / 1e6:.2f}M parameters{adapters}; tokenizer "
                               f"{tokenizer_spec(cfg.model)}, {len(tokenizer)} tokens", *filter(None, [memory])]


def _resume_lines(cfg: Config, hf_cfg, path: Path | None) -> tuple[list[str], int | None]:
    """The checks a run makes on the checkpoint it resumes (Checkpointer.load), before loading it; the
    checkpoint's step (None: nothing to resume)."""
    from shardlm.checkpoint.provenance import base_identity, check_resumable

    if path is None or hf_cfg is None:
        return [], None
    manifest = check_resumable(path, cfg, hf_cfg, lambda known: base_identity(cfg.model.name, known)
                               if lora.enabled(cfg.lora) and cfg.model.name else None)
    return [f"resume: {path} (step {manifest['step']})"], manifest["step"]


def enough_tokens(cfg: Config, world: int) -> int:
    """Tokens past which a source passes every block check whatever its real size: one global batch to
    train on (its held-out tail aside) and the validation blocks needed (train.gen_samples with gen_every)."""
    d, t = cfg.data, cfg.train
    val_blocks = t.gen_samples if t.gen_every else 1
    train_tokens = world * t.batch_size * t.grad_accum * d.seq_len + 2
    return math.ceil(train_tokens / (1 - d.val_fraction)) + math.ceil((val_blocks * d.seq_len + 2) / d.val_fraction)


@dataclasses.dataclass
class Counted:
    """What a dry run knows of the run's data: its header line, the steps (None: not counted), the example
    lines, the cut blocks (None: not counted) and the warnings of the run's checks."""

    line: str
    steps: int | None
    examples: list[str]
    blocks: tuple[Split, Split] | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)


def _count(cfg: Config, tokenizer, hf_cfg, world: int) -> Counted:
    """The run's blocks cut from counted tokens (`counting_loader`), then the run's checks of them: the same
    messages."""
    from shardlm.data import counting_loader
    from shardlm.data.sources import resolve
    from shardlm.inference.genquality import check_generation

    d = cfg.data
    specs = [*(d.train if isinstance(d.train, list) else [d.train]), *([d.val] if d.val else [])]
    if tokenizer is None:
        return Counted("blocks: not counted (the tokenizer is a hub name that cannot be reached)",
                       cfg.train.max_steps, [])
    if any(resolve(spec, "train", d.data_files).hf for spec in specs):
        return Counted("blocks: not counted (a Hugging Face dataset is not downloaded by a dry run)",
                       cfg.train.max_steps, [])
    family = objective_family(cfg.train.objective)
    exact: list[bool] = []  # a block source's tokens counted to the end, or only until enough for every check
    train, val = family.load_data(cfg, tokenizer, None, counting_loader(enough_tokens(cfg, world), exact))
    warnings: list[str] = []
    steps = checks.check_data(cfg, hf_cfg, train, val, world, warnings.append)
    check_generation(cfg.train, val)
    lines = family.preflight_lines(cfg, tokenizer, train)
    t = cfg.train
    if all(exact):
        return Counted(family.count_line(cfg, train, val, steps, world * t.batch_size * t.grad_accum), steps, lines,
                       (train, val), warnings)
    blocks = f"{getattr(train, 'sampled_blocks', len(train)):,} train / {len(val):,} val blocks of {d.seq_len} tokens"
    steps_known = f"; {steps:,} steps" if t.max_steps is not None else ""
    return Counted(f"blocks: at least {blocks} (tokens counted until enough for every check){steps_known}",
                   t.max_steps, lines, (train, val), warnings)


def dry_run(cfg: Config, world_size: int) -> str:
    from shardlm.config import task_defaults_note
    from shardlm.distributed import xla

    device, pl = checks.planned(cfg, world_size)
    _, resumed = checks.check_setup(cfg, pl, device)
    tokenizer, hf_cfg, model_lines = _model(cfg, pl)
    model_lines += objective_family(cfg.train.objective).model_lines(cfg, tokenizer)
    d = cfg.data
    specs = [(f"data.train[{i}]", spec) for i, spec in enumerate(d.train)] if isinstance(d.train, list) else \
        [("data.train", d.train)]
    rl = objectives.spec(cfg).reads == "prompts"
    data_lines = [*(_data_line(name, spec, "train", d, rl) for name, spec in specs),
                  _data_line("data.val", d.val, "validation", d, rl)]
    world = world_size * (xla.device_count() if device.type == "xla" else 1) // (cfg.parallel.context
                                                                              * cfg.parallel.tensor)  # rows shared
    counted = _count(cfg, tokenizer, hf_cfg, world)
    if counted.blocks is not None:
        checks.check_resume(cfg, hf_cfg, *counted.blocks, resumed)
    resume, resumed_step = _resume_lines(cfg, hf_cfg, resumed)
    steps = counted.steps
    done = resumed_step is not None and steps is not None and resumed_step >= steps > 0
    finished = [f"nothing to train: the checkpoint is step {resumed_step} and this config ends at step {steps}. "
                "To train further raise train.max_steps (or train.epochs); to start over use a new out_dir or "
                "checkpoint.resume=none."] if done else []
    note = task_defaults_note(cfg)
    lines = [*data_lines, counted.line, *counted.examples, *model_lines, *resume,
             f"plan: {world_size} rank(s) on {device.type}, "
             + (f"FSDP2 {cfg.parallel.sharding} mesh {pl.mesh_shape}" if pl.use_fsdp else "no FSDP")
             + (f" x tensor {pl.tensor} (each block split over {pl.tensor} ranks)" if pl.tensor > 1 else "")
             + (f", rows split by context: mesh data {world} x context {cfg.parallel.context}"
                if cfg.parallel.context > 1 else "")
             + f", {cfg.parallel.precision}, compile {pl.compile}",
             f"global batch: {world} x {cfg.train.batch_size} x {cfg.train.grad_accum} "
             + ("completions (prompt + completion) of up to " if rl else "blocks of ")
             + f"{cfg.data.seq_len} tokens; out_dir {cfg.out_dir}",
             *([note] if note else []), *counted.warnings, *finished,
             "dry run: the config is valid; nothing was trained or written"]
    return "\n".join(lines)

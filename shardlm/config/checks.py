"""Checks of a config that need no hardware or world size (those that do live in
shardlm.distributed.parallelize.plan): choices with the nearest valid one, ranges, mixtures, LoRA."""

from __future__ import annotations

import math

from shardlm import ShardlmError
from shardlm.config import objectives
from shardlm.config.schema import (
    AC_MODES,
    ANSWER_ENDS,
    ATTENTION_CHOICES,
    CHOICE_HINTS,
    COMPILES,
    DATA_FORMATS,
    LAUNCHERS,
    ON_BAD_EXAMPLE,
    PRECISIONS,
    SHARDING_ALIASES,
    SHARDINGS,
    TRUNCATIONS,
    Config,
)
from shardlm.config.suggest import nearest


def choice_key(name: str) -> str:
    """A choice as typed in any case, with or without `-` and `_`: how the alias tables spell their keys."""
    return name.lower().replace("-", "").replace("_", "")


def canonical_choice(name: str, choices: tuple[str, ...], aliases: dict[str, str]) -> str | None:
    """shardlm's name for a choice given in any case or under another trainer's name (`aliases`); None if none."""
    key = choice_key(name)
    return {choice_key(c): c for c in choices}.get(key) or aliases.get(key)


def canonical_sharding(name: str) -> str:
    """shardlm's name for a sharding strategy given in any case, or as a ZeRO / FSDP1 name; else unchanged."""
    return canonical_choice(name, SHARDINGS, SHARDING_ALIASES) or name


def _positive(name: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ShardlmError(f"{name} must be {bound}, got {value}.")


def validate(cfg: Config) -> None:
    """Checks that need no hardware or world size; those that do live in shardlm.distributed.parallelize.plan."""
    for name, value, choices in (
        ("parallel.sharding", cfg.parallel.sharding, SHARDINGS),
        ("parallel.precision", cfg.parallel.precision, PRECISIONS),
        ("parallel.launcher", cfg.parallel.launcher, LAUNCHERS),
        ("parallel.compile", cfg.parallel.compile, COMPILES),
        ("parallel.device", cfg.parallel.device, ("auto", "cpu", "cuda", "xla")),
        ("log.progress", cfg.log.progress, ("auto", "bar", "lines", "none")),
        ("data.format", cfg.data.format, DATA_FORMATS),
        ("data.truncation", cfg.data.truncation, TRUNCATIONS),
        ("data.on_bad_example", cfg.data.on_bad_example, ON_BAD_EXAMPLE),
        ("data.answer_end", cfg.data.answer_end, ANSWER_ENDS),
        ("train.objective", cfg.train.objective, objectives.OBJECTIVES),
        ("preference.reference", cfg.preference.reference, ("precomputed", "live")),
    ):
        if value not in choices:
            raise ShardlmError(f"{name}={value!r} is not one of {', '.join(choices)}.{nearest(value, choices)}"
                               + CHOICE_HINTS.get(name, ""))
    t = cfg.train
    _positive("preference.rpo_alpha", cfg.preference.rpo_alpha, allow_zero=True)
    _positive("train.batch_size", t.batch_size)
    _positive("train.grad_accum", t.grad_accum)
    _positive("data.seq_len", cfg.data.seq_len)
    _positive("train.epochs", t.epochs, allow_zero=True)
    if t.max_steps is not None:
        _positive("train.max_steps", t.max_steps, allow_zero=True)
    _positive("train.lr", t.lr)
    _positive("train.log_every", t.log_every)
    _positive("train.gen_samples", t.gen_samples)
    for name in ("eval_every", "eval_batches", "warmup_steps", "max_bad_steps", "gen_every"):
        _positive(f"train.{name}", getattr(t, name), allow_zero=True)
    if t.loss_chunk_size is not None:
        _positive("train.loss_chunk_size", t.loss_chunk_size, allow_zero=True)
    _positive("train.grad_clip", t.grad_clip, allow_zero=True)
    _positive("checkpoint.every", cfg.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("parallel.shard_size", cfg.parallel.shard_size, allow_zero=True)
    _positive("parallel.context", cfg.parallel.context)
    _positive("model.vocab_multiple", cfg.model.vocab_multiple)
    if cfg.checkpoint.export_final and not cfg.checkpoint.save_final:
        raise ShardlmError("checkpoint.export_final=true exports the final checkpoint: it needs "
                           "checkpoint.save_final=true (or run `shardlm export` on a checkpoint later).")
    _check_mixture(cfg)
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ShardlmError(f"data.val_fraction must be between 0 and 1, got {cfg.data.val_fraction}.")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ShardlmError(f"model.dropout must be in [0, 1), got {cfg.model.dropout}.")
    _check_lora(cfg)
    ac_mode(cfg.parallel.activation_checkpointing)
    wrap_size(cfg.parallel.wrap)
    objectives.check(cfg)  # its section's (grpo, distill, preference.rpo_alpha)
    m = cfg.model
    if m.attention not in ATTENTION_CHOICES:
        raise ShardlmError(f"model.attention={m.attention!r} is not one of {', '.join(ATTENTION_CHOICES)}."
                           f"{nearest(m.attention, ATTENTION_CHOICES)}")
    if m.name is None:
        _positive("model.n_layer", m.n_layer)
        _positive("model.n_embd", m.n_embd)
        _positive("model.n_head", m.n_head)
        if m.n_embd % m.n_head:
            raise ShardlmError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}.")
        if m.n_kv_head is not None and (m.n_kv_head <= 0 or m.n_head % m.n_kv_head):
            raise ShardlmError(f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head} (each key/value "
                               "head serves a group of query heads): choose a divisor, or null for n_head.")
        if m.n_positions is not None and cfg.data.seq_len > m.n_positions:
            raise ShardlmError(
                f"data.seq_len={cfg.data.seq_len} exceeds model.n_positions={m.n_positions}: "
                f"lower data.seq_len or raise model.n_positions."
            )


def _check_mixture(cfg: Config) -> None:
    """A list data.train is a mixture; data.weights, if given, has one weight >= 0 per source, not all 0."""
    train, weights = cfg.data.train, cfg.data.weights
    if isinstance(train, list) and not train:
        raise ShardlmError("data.train is an empty list: give one source, or a list of sources to mix.")
    if weights is None:
        return
    if not isinstance(train, list):
        raise ShardlmError(f"data.weights applies to a mixture, but data.train is one source ({train!r}): give "
                           "data.train a list of sources ('data.train=[a.txt,b.parquet]') or set data.weights=null.")
    if len(weights) != len(train):
        n = len(weights)
        raise ShardlmError(f"data.weights has {n} weight{'s' * (n != 1)} but data.train lists {len(train)} sources: "
                           "give one weight per source, or data.weights=null to weight them by their sizes.")
    for i, w in enumerate(weights):
        if not (math.isfinite(w) and w >= 0):
            raise ShardlmError(f"data.weights[{i}] is {w}: weights must be finite and >= 0 (0 = leave a source out).")
    if not any(weights):
        raise ShardlmError("data.weights are all 0: give at least one source a positive weight.")


def _check_lora(cfg: Config) -> None:
    """LoRA settings; QLoRA's need for CUDA is checked with the device (shardlm.models.lora.check)."""
    lora = cfg.lora
    _positive("lora.r", lora.r, allow_zero=True)
    if lora.quantize not in (None, "nf4"):
        raise ShardlmError(f"lora.quantize={lora.quantize!r} is not one of nf4, null.")
    if lora.quant_backend not in ("auto", "torchao", "bitsandbytes"):
        raise ShardlmError(f"lora.quant_backend={lora.quant_backend!r} is not one of auto, torchao, bitsandbytes.")
    if lora.r == 0:
        if lora.quantize:
            raise ShardlmError(f"lora.quantize={lora.quantize} quantizes the frozen base of a LoRA run: set lora.r "
                               "(e.g. lora.r=16) or lora.quantize=null.")
        return
    _positive("lora.alpha", lora.alpha)
    if not 0.0 <= lora.dropout < 1.0:
        raise ShardlmError(f"lora.dropout must be in [0, 1), got {lora.dropout}.")
    if cfg.model.name is None:
        raise ShardlmError("lora.r > 0 adapts a pretrained model, but model.name is null (from scratch): set "
                           "model.name to a hub name or folder, or lora.r=0 to train every weight.")
    if cfg.parallel.precision == "fp8":
        raise ShardlmError("lora.r > 0 with parallel.precision=fp8 is not supported (float8 linears do not wrap "
                           "PEFT's adapter layers). Use parallel.precision=bf16 (or fp32) for LoRA.")
    if lora.target_modules is not None and not lora.target_modules:
        raise ShardlmError("lora.target_modules is an empty list: give module names (e.g. [q_proj, v_proj]) or "
                           "null for every attention and MLP projection.")


def ac_mode(value: str) -> tuple[str, int]:
    """`parallel.activation_checkpointing` as (mode, N): N is the step between checkpointed blocks for full (1) and
    every:N, 0 for the others. YAML's true and false arrive as full and none (shardlm.config.loading)."""
    mode = str(value).strip().lower()
    if mode in ("none", "selective", "offload"):
        return mode, 0
    if mode == "full":
        return mode, 1
    name, _, every = mode.partition(":")
    if name != "every":
        named = [m for m in AC_MODES if m != "every:N"] + ["every:2"]
        raise ShardlmError(f"parallel.activation_checkpointing={value!r} is not one of {', '.join(AC_MODES)} "
                           f"(true = full, false = none).{nearest(mode, named)}")
    every = every.strip()
    if not every.isdigit() or int(every) < 1:
        raise ShardlmError(f"parallel.activation_checkpointing={value}: N of every:N is a whole number >= 1, the "
                           "step between checkpointed blocks (every:2 checkpoints every second block; every:1 = full).")
    return ("full", 1) if int(every) == 1 else ("every", int(every))


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def wrap_size(value: str) -> int:
    """`parallel.wrap` as the parameter count past which a module subtree is its own FSDP2 unit; 0 = by blocks."""
    spec = str(value).strip().lower()
    if spec in ("auto", "block") or spec.startswith("blocks:"):
        wrap_blocks(value)
        return 0
    name, _, size = spec.partition(":")
    if name != "size":
        raise ShardlmError(f"parallel.wrap={value!r} is not one of auto, block, blocks:K (K blocks a unit), size:N "
                           f"(N parameters, e.g. size:50M).{nearest(spec, ['auto', 'block', 'blocks:K', 'size:N'])}")
    number, unit = size.rstrip("kmbg"), size[len(size.rstrip("kmbg")):]
    try:
        count = float(number) * _SIZE_UNITS[unit] if unit in _SIZE_UNITS else 0.0
    except ValueError:
        count = 0.0
    if not (math.isfinite(count) and count >= 1):
        raise ShardlmError(f"parallel.wrap={value}: N of size:N is a number of parameters >= 1, such as size:50M, "
                           "size:5e7 or size:50000000 (each module subtree past N parameters becomes an FSDP2 unit).")
    return int(count)


def wrap_blocks(value: str) -> int | None:
    """`parallel.wrap` as the consecutive transformer blocks in one FSDP2 unit: 1 for block, K for blocks:K, 0 for
    size:N (units by parameter count), None for auto (chosen from the model: wrapping.blocks_per_unit)."""
    spec = str(value).strip().lower()
    if spec == "auto":
        return None
    if spec == "block":
        return 1
    if not spec.startswith("blocks:"):
        return 0
    k = spec.removeprefix("blocks:")
    if not k.isdigit() or int(k) < 1:
        raise ShardlmError(f"parallel.wrap={value}: K of blocks:K is a whole number >= 1, the consecutive blocks "
                           "one FSDP2 unit gathers together (blocks:1 = block; blocks:4 on 12 blocks = 3 units).")
    return int(k)

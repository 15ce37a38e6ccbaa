"""The reference of dpo and ipo: the initial model's log-probabilities of every pair, scored once before the
first step and stored beside the example cache (`reference-KEY.npy`, KEY the initial model's identity), or a live
reference (the policy with its LoRA adapters off, or a frozen copy of the initial model built as the policy was).
shardlm.objectives.preference.pairs says why; the preference rows of a split are read here too."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shardlm import ShardlmError
from shardlm.checkpoint.provenance import arch_of, base_identity
from shardlm.data import ExampleRows, MixtureBlocks
from shardlm.data.examples import reference_problem, save_reference
from shardlm.models import lora
from shardlm.objectives.validate import Validator

if TYPE_CHECKING:
    from shardlm.config import Config
    from shardlm.distributed.parallelize import Plan
    from shardlm.distributed.process_group import Dist
    from shardlm.models.causal_lm import CausalLM


def pair_rows(blocks, what: str) -> ExampleRows:
    """The preference rows of a split, or a clear error: preference objectives train on pairs only."""
    if isinstance(blocks, ExampleRows) and blocks.group == 2:
        return blocks
    kind = "a mixture" if isinstance(blocks, MixtureBlocks) else "examples" if isinstance(blocks, ExampleRows) \
        else "text"
    raise ShardlmError(f"train.objective=dpo/ipo/simpo/orpo trains on preference pairs ({{'prompt', 'chosen', "
                       f"'rejected'}} records); the {what} data is {kind}. Give pairs, or train.objective=sft.")


@dataclass
class ReferenceSource:
    """What the reference is made of, and nothing else of the run: the initial model's settings (`cfg`,
    `hf_config`, `plan` for a live frozen copy), the model that scores it (the policy, which before the first step is
    the initial model), the pairs to score by split, how to batch them, and the step the run stands at (past 0 the
    stored values must exist: a trained policy is never scored as the reference)."""

    cfg: Config
    hf_config: Any
    plan: Plan
    dist: Dist
    model: torch.nn.Module
    splits: dict[str, ExampleRows]  # "train", "val"
    step: int = 0
    batch: int = 1
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext


def frozen_reference(run, build_model) -> CausalLM:
    """The initial model again, built as the policy was (build_model: the same weights, precision and
    parallelize, so sharded alike), frozen in eval mode. The global RNG is left as it was."""
    import dataclasses

    from shardlm.models.causal_lm import num_params

    cfg, dist = run.cfg, run.dist
    # no activation checkpointing: it saves nothing without a backward
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, activation_checkpointing="none"))
    devices = [dist.device.index or 0] if dist.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        model = build_model(cfg, run.hf_config, run.plan, dist)
    model.requires_grad_(False)
    model.eval()
    dist.print(f"reference: live, a frozen copy of the initial model ({num_params(model):,} parameters"
               f"{', sharded as the policy' if run.plan.use_fsdp else ''})")
    return model


def _initial_identity(run) -> Any:
    m = run.cfg.model
    return base_identity(m.name).get("weights_sha256") if m.name else \
        {"scratch": arch_of(run.hf_config), "seed": run.cfg.train.seed}


def initial_key(run) -> str:
    """The initial model's identity (a pretrained base's files, or a scratch model's config and seed)."""
    blob = json.dumps([_initial_identity(run), run.cfg.model.name], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference_key(run) -> str:
    """The initial model's identity, what computes its scores (the precision; QLoRA's 4-bit base scores other
    values than the full-precision one) and what cuts the answers it scored (each side gets seq_len / 2 tokens:
    a shorter seq_len scores other sequences). Keys written before the quantization counted stay the same."""
    m, d = run.cfg.model, run.cfg.data
    parts = [_initial_identity(run), m.name, run.cfg.parallel.precision, d.seq_len, d.truncation]
    if lora.quantized(run.cfg.lora):  # torchao's NF4 scores other values than bitsandbytes' (keys of the latter kept)
        dist, plan = getattr(run, "dist", None), getattr(run, "plan", None)  # a Run, or a test's stand-in
        backend = lora.backend(run.cfg.lora, getattr(dist, "device", None), getattr(plan, "use_fsdp", False))
        parts.append({"quantize": run.cfg.lora.quantize, **({"backend": backend} if backend == "torchao" else {})})
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@torch.no_grad()
def score_all(model, rows: ExampleRows, dist, batch: int, autocast) -> np.ndarray:
    """Every answer's log-probability under `model`: (units of the example set, 2), each rank a share of rows."""
    out = torch.zeros((len(rows.examples), 2), dtype=torch.float64, device=dist.device)
    model.eval()
    for b, share in Validator(dist, batch).batches(rows):
        assert b.units is not None and b.segments is not None
        with autocast():
            logps, _ = model.sequence_logps(b.inputs, b.targets, b.positions, b.segments, 2 * len(b.units))
        keep = torch.from_numpy(np.repeat(share.valid, [len(rows.rows[r]) for r in share.indices]))
        units = b.units[keep.to(b.units.device)]
        out[units] = logps.view(-1, 2)[keep.to(logps.device)].double()
    dist.all_reduce_sum(out)
    return out.cpu().numpy()


def prepare_reference(source: ReferenceSource, store: bool = True) -> dict[str, torch.Tensor]:
    """The reference's log-probabilities of the training and validation pairs: read from beside the cache, or
    (before the first step) computed with the initial model and stored there (`store=False`: only computed).

    One file per example set: validation held out as the tail of the training pairs shares the training pairs'
    file, which then holds the scores of both splits' pairs. A pair never scored is NaN there; a file whose
    split is missing (or, as written before the tail was scored, all zero) is completed before the first step."""
    dist, splits = source.dist, source.splits
    key = reference_key(source)
    arrays: dict[str, torch.Tensor] = {}
    for split, rows in splits.items():
        first = next(s for s, r in splits.items() if r.examples is rows.examples)
        if first != split:  # scored with the split before it, in one file
            arrays[split] = arrays[first]
            continue
        sharing = [rows, *(r for s, r in splits.items()
                           if s != split and r.examples is rows.examples and r is not rows)]
        values = _reference_values(source, key, sharing, store)
        arrays[split] = torch.from_numpy(values).float().to(dist.device)
    return arrays


def missing_reference(name: str, found: bool) -> ShardlmError:
    """A resumed run's stored reference that is gone, or lacks pairs (shardlm.training.checks refuses it first)."""
    why = ("lack some of its pairs (written by an earlier shardlm, which did not score a validation tail held "
           "out of the training pairs)" if found else "are missing: the base model changed since the run "
           "started, or the token cache was cleared")
    return ShardlmError(f"the reference log-probabilities of this run ({name}) {why}. The reference is the model "
                        "this run started from; start over with checkpoint.resume=none (or a new out_dir).")


def live_reference_changed(cfg) -> ShardlmError:
    return ShardlmError("preference.reference=live rebuilds the model this run started from, but "
                        f"model.name={cfg.model.name} with train.seed={cfg.train.seed} is not it "
                        "(the base's files or the seed changed since). Resume with the original base "
                        "and seed, or start over with checkpoint.resume=none.")


def unscored(values: np.ndarray, splits: list[ExampleRows], found: bool) -> list[ExampleRows]:
    """The splits with pairs the values lack: NaN (never scored), or, in a file, a split left all zero (written
    before a validation tail held out of the training pairs was scored)."""
    return [rows for rows in splits if np.isnan(values[rows.ids]).any()
            or (found and len(rows.ids) > 0 and not values[rows.ids].any())]


def damaged_reference(why: str) -> ShardlmError:
    """A stored reference that cannot be read back after the first step (`reference_problem`'s words)."""
    return ShardlmError(f"{why}: the reference log-probabilities of this run cannot be read back. The reference is "
                        "the model this run started from; start over with checkpoint.resume=none (or a new out_dir).")


def _reference_values(source: ReferenceSource, key: str, splits: list[ExampleRows],
                      store: bool = True) -> np.ndarray:
    """(pairs of the example set, 2): the file's values, with the splits' pairs it lacks scored first."""
    dist, examples = source.dist, splits[0].examples
    folder = examples.meta.get("folder")
    path = Path(folder) / f"reference-{key}.npy" if folder and store else None
    found = path is not None and path.is_file()
    if path is not None and found and (damaged := reference_problem(path)) is not None:
        if source.step > 0:
            raise damaged_reference(damaged)
        dist.print(f"warning: {damaged}: the reference is scored again")
        found = False
    values = np.load(path) if path is not None and found else np.full((len(examples), 2), np.nan)
    missing = unscored(values, splits, found)
    if not missing:
        return values
    if source.step > 0:  # a resume (shardlm.training.checks refused it before, unless the file went since)
        raise missing_reference(path.name if path else "in memory", found)
    n = sum(len(rows.ids) for rows in missing)
    dist.print(f"reference: scoring the {n:,} pair{'s' * (n != 1)} of {examples.meta['source']} with the initial "
               "model (once; stored beside the example cache)")
    for rows in missing:
        values[rows.ids] = score_all(source.model, rows, dist, source.batch, source.autocast)[rows.ids]
    if path is not None and dist.is_main:
        save_reference(path, values)
    dist.barrier()
    return values

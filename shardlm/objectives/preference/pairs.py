"""Preference objectives in the loop (`train.objective`: dpo, ipo, simpo, orpo) and their reference model.

A micro-batch holds whole pairs: both sequences of a pair in one row (shardlm.data.packing), one forward for
both. The model gives each sequence's summed answer log-probability; preference.losses turns them into
per-pair losses. The step's loss is the sum over its pairs divided once by the global pair count (ORPO adds the
chosen answers' token-mean cross-entropy, divided by the global chosen-token count), so 2 ranks x 4 pairs train
what 1 x 8 trains.

The reference (dpo, ipo) costs no second model: before the first step, the initial model (with LoRA, its
adapters are zero there: the base itself) scores every answer of the training and validation pairs once, each
rank a share, and the log-probabilities are stored beside the example cache as `reference-KEY.npy`, KEY the
initial model's identity (the base's file hashes, or a scratch model's config and seed). A resumed run reads
them back; if the base changed they are not found, and the run says so instead of training against another
reference.

`preference.reference: live` scores each micro-batch's pairs in the step instead (no_grad, before the policy's
forward), for data too large to score ahead; nothing is stored. With LoRA the reference is the policy itself with
its adapters off (shardlm.models.lora.adapters_off): no second copy. Otherwise it is a frozen copy of the initial
model, built once by build_model as the policy was (the same parallelize, so sharded alike under FSDP). A resumed
run rebuilds it from the initial weights; the run's state records their identity, and a resume onto other
initial weights is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from shardlm import ShardlmError
from shardlm.checkpoint.provenance import arch_of, base_identity
from shardlm.data import Batch, ExampleRows, MixtureBlocks
from shardlm.data.examples import reference_problem, save_reference
from shardlm.distributed import context
from shardlm.distributed.parallelize import set_gradient_sync
from shardlm.models import lora
from shardlm.objectives.base import Defaults, Loop, StepOut
from shardlm.objectives.preference.losses import PAIR_OBJECTIVES, REFERENCE_FREE, pair_losses
from shardlm.objectives.validate import Share, Validator

if TYPE_CHECKING:
    from shardlm.config import Config
    from shardlm.distributed.parallelize import Plan
    from shardlm.distributed.process_group import Dist
    from shardlm.models.causal_lm import CausalLM

STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen", "logps/rejected")


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


class Preference(Defaults):
    """The objective of a run on pairs: per-micro-batch losses and statistics, and the reference's values."""

    names: ClassVar[tuple[str, ...]] = PAIR_OBJECTIVES
    stats: ClassVar[tuple[str, ...]] = STATS

    @classmethod
    def build(cls, loop: Loop) -> Preference:
        return cls(loop.run.cfg, loop.device, loop.build_model)

    def __init__(self, cfg, device: torch.device, build_model=None):
        self.build_model = build_model  # live without LoRA: how the policy was built (shardlm.training.build's)
        self.objective, self.p, self.device = cfg.train.objective, cfg.preference, device
        self.needs_reference = self.objective not in REFERENCE_FREE
        self.live = self.needs_reference and cfg.preference.reference == "live"
        self.reference: dict[str, torch.Tensor] = {}  # split -> (units, 2) log-probabilities (precomputed)
        self.frozen: CausalLM | None = None  # live without LoRA: the frozen initial model
        self.key: str | None = None  # live: the initial model's identity, kept in the run's state
        self.resumed_key: str | None = None  # ... as the resumed checkpoint recorded it
        self.ready = not self.needs_reference

    def prepare(self, src: ReferenceSource) -> None:
        """Once, before the first step or validation: the precomputed values, or the live reference."""
        if self.ready or self.reference:  # (shardlm eval sets the values itself)
            self.ready = True
            return
        if not self.live:
            self.reference = prepare_reference(src)
        else:
            cfg = src.cfg
            self.key = initial_key(src)
            if self.resumed_key is not None and self.resumed_key != self.key:  # checked before the run, too
                raise live_reference_changed(cfg)
            if lora.enabled(cfg.lora):
                src.dist.print("reference: live, the policy with its LoRA adapters off (no second copy)")
            else:
                self.frozen = frozen_reference(src, self.build_model)
        self.ready = True

    def state_dict(self) -> dict[str, Any]:
        """What the run's state keeps of the reference: the initial model's identity, in live mode."""
        key = self.key or self.resumed_key
        return {"reference_key": key} if self.live and key else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Live: the identity of the initial model it rebuilds, checked when it does (and before the run)."""
        self.resumed_key = state.get("reference_key")

    @torch.no_grad()
    def live_logps(self, model, batch: Batch, sequences: int) -> torch.Tensor:
        """(pairs, 2): the reference's log-probabilities of this micro-batch, in eval mode as precomputed ones."""
        assert batch.segments is not None
        ref = self.frozen if self.frozen is not None else model
        training = ref.training
        if training:
            ref.eval()
        with contextlib.nullcontext() if self.frozen is not None else lora.adapters_off(ref):
            logps, _ = ref.sequence_logps(batch.inputs, batch.targets, batch.positions, batch.segments, sequences)
        logps = context.summed(logps)  # a row split over context ranks: each holds part of every sequence
        if training:
            ref.train()
        if self.frozen is not None:
            reshard(self.frozen)
        return logps.detach().float().view(-1, 2)

    def loss(self, model, batch: Batch, split: str, weights: torch.Tensor | None = None):
        """(sum of pair losses, sum of chosen answers' token NLL (ORPO; else 0), statistics sums [6], pairs)."""
        assert batch.segments is not None and batch.units is not None
        n = len(batch.units)
        ref = None
        if self.reference:
            ref = self.reference[split][batch.units]
        elif self.live:  # before the policy's forward: FSDP2 then sees one forward, and its backward
            ref = self.live_logps(model, batch, 2 * n)
        logps, counts = model.sequence_logps(batch.inputs, batch.targets, batch.positions, batch.segments, 2 * n)
        logps, counts = context.summed(logps), context.summed(counts)
        chosen, rejected = logps[0::2], logps[1::2]
        out = pair_losses(self.objective, chosen, rejected, counts[0::2], counts[1::2],
                          None if ref is None else ref[:, 0], None if ref is None else ref[:, 1],
                          self.p.beta, self.p.label_smoothing, self.p.gamma)
        w = torch.ones(n, device=chosen.device) if weights is None else weights
        cr, rr = out.chosen_rewards, out.rejected_rewards
        stats = torch.stack([(cr * w).sum(), (rr * w).sum(), ((cr > rr).float() * w).sum(), ((cr - rr) * w).sum(),
                             (chosen.detach() * w).sum(), (rejected.detach() * w).sum()])
        alpha = 1.0 if self.objective == "orpo" else self.p.rpo_alpha  # ORPO's own term; DPO + NLL is TRL's RPO
        nll = -alpha * (chosen * w).sum() if alpha else torch.zeros((), device=chosen.device)
        return (out.losses * w).sum(), nll, stats, w.sum()

    def micro_steps(self, trainer: Loop) -> StepOut:
        """A step's micro-batches on pairs: (the step's global pairs, this rank's loss sum as pairs x loss, the
        STATS' sums)."""
        rows = pair_rows(trainer.run.train, "training")
        if not self.ready:
            self.prepare(reference_source(trainer))
            trainer.model.train()
        step_rows = trainer.sampler.indices(trainer.position, trainer.global_batch)
        pairs, chosen = max(1, rows.units(step_rows)), max(1, chosen_targets(rows, step_rows))
        share = trainer.batch * trainer.accum / trainer.global_batch  # gradients are averaged over ranks
        loss_sum = torch.zeros((), device=trainer.device)
        stats = torch.zeros(len(STATS), device=trainer.device)
        for m in range(trainer.accum):
            batch = trainer.train_batch(m)
            set_gradient_sync(trainer.model, m == trainer.accum - 1)
            with context.split_step(trainer.dist, trainer.run.model.hf.config, batch) as mine, trainer.autocast():
                pair_sum, nll, batch_stats, _ = self.loss(trainer.model, mine, "train")
                loss = pair_sum / (pairs * share) + nll / (chosen * share)
                (trainer.scaler.scale(loss) if trainer.scaler else loss).backward()
            loss_sum += (pair_sum + nll * pairs / chosen).detach()
            stats += batch_stats.detach()
        # the context ranks of a data index hold the same pair sums (context.summed): each reports its share
        return pairs, loss_sum / trainer.dist.context_size, stats / trainer.dist.context_size

    def validate(self, loop: Loop) -> dict[str, Any]:
        """The pair loss, rewards and log-probabilities on the validation pairs."""
        rows = pair_rows(loop.run.val, "validation")
        self.prepare(reference_source(loop))
        return loop.validator.validate(loop.model, rows, PairScores(self))


def reference_source(loop: Loop) -> ReferenceSource:
    """What a preference objective's reference is made of: the run's initial settings, the policy (the initial
    model before the first step), both splits' pairs, and the step the run is at."""
    run = loop.run
    splits = {"train": pair_rows(run.train, "training"), "val": pair_rows(run.val, "validation")}
    return ReferenceSource(run.cfg, run.hf_config, run.plan, loop.dist, loop.model, splits, loop.step, loop.batch,
                           loop.autocast)


class PairScores:
    """Validation of a preference objective (shardlm.objectives.validate's Scorer): the pair loss (with ORPO's or
    RPO's NLL term, per chosen target) and the rewards and log-probabilities per pair; padding rows weigh nothing."""

    fields = ("pair_loss", "nll", "pairs", *STATS, "tokens", "chosen_tokens")

    def __init__(self, preference: Preference, split: str = "val"):
        self.preference, self.split = preference, split

    def sums(self, model, batch: Batch, share: Share) -> Mapping[str, torch.Tensor | float]:
        rows, real = share.rows, share.indices[share.valid]
        weights = np.repeat(share.valid, [len(rows.rows[r]) for r in share.indices]).astype(np.float32)
        pair_sum, nll, stats, n = self.preference.loss(model, batch, self.split,
                                                       torch.from_numpy(weights).to(batch.inputs.device))
        return {"pair_loss": pair_sum, "nll": nll, "pairs": n, **dict(zip(STATS, stats, strict=True)),
                "tokens": rows.targets(real), "chosen_tokens": chosen_targets(rows, real)}

    def result(self, totals: dict[str, float]) -> dict[str, Any]:
        pairs, chosen = max(totals["pairs"], 1.0), max(totals["chosen_tokens"], 1.0)
        out = {k: totals[k] / pairs for k in STATS}
        chosen_ppl = math.exp(min(-totals["logps/chosen"] / chosen, 50.0))  # the chosen answers', per token
        return {"loss": totals["pair_loss"] / pairs + totals["nll"] / chosen, "ppl": chosen_ppl,
                "accuracy": out["rewards/accuracy"], "pairs": int(pairs), "tokens": int(totals["tokens"]), **out}


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


def reshard(model: torch.nn.Module) -> None:
    """FSDP2 keeps some units gathered after a forward (for the backward that follows): a frozen model has none."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def check_objective(cfg, train, val) -> None:
    """Pairs need a preference objective and a preference objective needs pairs, in both splits."""
    if cfg.train.objective not in ("sft", "distill"):
        pair_rows(train, "training")
        pair_rows(val, "validation")
        return
    if any(isinstance(b, ExampleRows) and b.group == 2 for b in (train, val)):
        raise ShardlmError(f"the data holds preference pairs (chosen/rejected), which train.objective="
                           f"{cfg.train.objective} does not train on: set train.objective to dpo, ipo, simpo or orpo.")


def chosen_targets(rows: ExampleRows, indices: np.ndarray) -> int:
    """Target tokens of the chosen answers in these rows (ORPO's cross-entropy is their mean)."""
    return int(sum(rows.unit_targets[rows.rows[r], 0].sum() for r in np.asarray(indices, dtype=np.int64)))


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

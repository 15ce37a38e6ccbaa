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
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from shardlm.config import objectives as specs
from shardlm.data import Batch, ExampleRows
from shardlm.distributed import context
from shardlm.distributed.parallelize import reshard, set_gradient_sync
from shardlm.models import lora
from shardlm.objectives.base import Footprint, Loop, MemoryTerms, StepOut
from shardlm.objectives.defaults import Defaults, check_packs
from shardlm.objectives.preference.losses import REFERENCE_FREE, pair_losses
from shardlm.objectives.preference.reference import (
    ReferenceSource,
    frozen_reference,
    initial_key,
    live_reference_changed,
    pair_rows,
    prepare_reference,
)
from shardlm.objectives.validate import Share

if TYPE_CHECKING:
    from shardlm.config import Config
    from shardlm.models.causal_lm import CausalLM

STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen", "logps/rejected")


class Preference(Defaults):
    """The objective of a run on pairs: per-micro-batch losses and statistics, and the reference's values."""

    names: ClassVar[tuple[str, ...]] = specs.names("preference")
    stats: ClassVar[tuple[str, ...]] = STATS
    perplexity: ClassVar[bool] = False

    @classmethod
    def build(cls, loop: Loop) -> Preference:
        return cls(loop.run.cfg, loop.device, loop.build_model)

    @classmethod
    def check_data(cls, cfg: Config, hf_cfg: Any, train: Any, val: Any) -> None:
        """Pairs in both splits, packed where the model's family allows it."""
        check_packs(cfg, hf_cfg, train)
        pair_rows(train, "training")
        pair_rows(val, "validation")

    @classmethod
    def card_line(cls, cfg: Config) -> str | None:
        t, p, s = cfg.train, cfg.preference, specs.spec(cfg)
        settings = [f"preference.beta {p.beta:g}", *([f"gamma {p.gamma:g}"] if t.objective == "simpo" else []),
                    *([f"reference {p.reference}"] if s.reference else []),
                    *([f"rpo_alpha {p.rpo_alpha:g}"] if p.rpo_alpha and s.rpo else [])]
        return f"{t.objective} on preference pairs ({', '.join(settings)})"

    @classmethod
    def memory(cls, cfg: Config, f: Footprint) -> MemoryTerms:
        """A live reference without LoRA is a frozen copy of the initial model, sharded as the policy (with LoRA the
        base serves, adapters off); a precomputed one is a file beside the cache."""
        out = MemoryTerms()
        if specs.spec(cfg).reference and cfg.preference.reference == "live" and not lora.enabled(cfg.lora):
            out.resident["live reference (frozen copy of the initial model)"] = f.initial_model
        return out

    @classmethod
    def check_resume(cls, cfg: Config, hf_cfg: Any, train: Any, val: Any, resumed: Any, on_main: Callable) -> None:
        """dpo and ipo: the reference the run started with must be found again (preference.resume)."""
        if resumed is not None and hf_cfg is not None and specs.spec(cfg).reference:
            from shardlm.objectives.preference.resume import check_reference

            check_reference(cfg, hf_cfg, train, val, resumed, on_main)

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


def chosen_targets(rows: ExampleRows, indices: np.ndarray) -> int:
    """Target tokens of the chosen answers in these rows (ORPO's cross-entropy is their mean)."""
    return int(sum(rows.unit_targets[rows.rows[r], 0].sum() for r in np.asarray(indices, dtype=np.int64)))



"""The learning-rate schedule: linear warmup, then cosine decay to `min_ratio` of the peak at the run's end.

A run can be extended (or shortened) on resume by changing train.max_steps or train.epochs. Stretching the
cosine over the new length would make the learning rate jump back up (100 -> 150 steps: 0.000301 at step 100,
0.000558 at step 125). Instead the schedule continues from the factor it had reached and decays from there to
`min_ratio` over the new remainder. The decay's start lives in the schedule's attributes, which LambdaLR saves
with its own state (it keeps a callable object's `__dict__`), so a later resume keeps the same curve.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch


class WarmupCosine:
    """`factor(step)` multiplies the peak learning rate; LambdaLR calls it with the optimizer step."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        self.decay_from: int | None = None  # set by `configure`: the step a moved end's decay starts at
        self.decay_top = 1.0  # the factor at `decay_from`

    def __call__(self, step: int) -> float:
        if self.decay_from is None and step < self.warmup:
            return (step + 1) / self.warmup
        begin = self.warmup if self.decay_from is None else self.decay_from
        progress = min(1.0, max(0.0, (step - begin) / max(1, self.total - begin)))
        return self.min_ratio + (self.decay_top - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def configure(self, planned: WarmupCosine, step: int) -> str | None:
        """After a resume restored the saved schedule: take this run's warmup and floor, and if the end moved,
        decay from `step`'s factor to the new end. Returns what changed, for the console (None: nothing)."""
        self.warmup, self.min_ratio = planned.warmup, planned.min_ratio
        if planned.total == self.total or step >= planned.total:
            return None
        old = self.total
        if self.decay_from is not None or step >= self.warmup:  # in warmup nothing has decayed yet
            self.decay_top, self.decay_from = self(step), step
        self.total = planned.total
        now = self(step)
        then = (f"stays at train.min_lr_ratio={self.min_ratio:g} x train.lr" if now == self.min_ratio else
                f"decays to train.min_lr_ratio={self.min_ratio:g} x train.lr at step {planned.total}")
        return (f"the run's end moved from step {old} to {planned.total}: the learning rate continues from its "
                f"value at step {step} ({now:.3g} x train.lr) and {then}, without a jump")


class ScheduleState:
    """The LR schedule as a checkpoint part. Loading restores the step and the decay's start, then applies this
    run's config: its warmup and floor, its peak learning rates (the optimizer's `initial_lr`, which
    OptimizerState keeps), and a moved end (`WarmupCosine.configure`), which is reported through `log`."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR, log: Callable[[str], None] = print):
        self.scheduler, self.log = scheduler, log

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.scheduler
        planned = {id(f): copy.copy(f) for f in s.lr_lambdas if isinstance(f, WarmupCosine)}
        s.load_state_dict(state)
        for schedule in {id(f): f for f in s.lr_lambdas}.values():
            if isinstance(schedule, WarmupCosine) and (moved := schedule.configure(planned[id(schedule)],
                                                                                   s.last_epoch)):
                self.log(f"note: {moved}")
        groups = s.optimizer.param_groups
        s.base_lrs = [g["initial_lr"] for g in groups]
        for group, base, factor in zip(groups, s.base_lrs, s.lr_lambdas, strict=True):
            group["lr"] = base * factor(s.last_epoch)
        s._last_lr = [g["lr"] for g in groups]

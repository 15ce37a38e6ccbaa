"""Learning-rate schedules (`train.schedule`): linear warmup over `train.warmup_steps`, then

    cosine        cosine decay to `min_ratio` of the peak at the run's end (the default)
    linear        linear decay to `min_ratio` at the end (HF Trainer's `linear` when min_lr_ratio=0)
    constant      the peak until the end (schedule-free AdamW's: it needs no decay)
    inverse_sqrt  sqrt(warmup / (step + 1)) after the warmup (HF's, timescale = the warmup), never below `min_ratio`
    wsd           warmup-stable-decay: the peak until the last `decay_fraction` of the steps, then a decay to
                  `min_ratio` shaped 1-sqrt (Hägele et al. 2024), linear or cosine

Each is a callable object: `factor(step)` multiplies the peak learning rate and LambdaLR calls it with the
optimizer step. LambdaLR saves a callable object's `__dict__` with its own state, so what a schedule has
reached (`decay_from`, `decay_top`) comes back on resume.

A run can be extended (or shortened) on resume by changing train.max_steps or train.epochs. Stretching the
cosine over the new length would make the learning rate jump back up (100 -> 150 steps: 0.000301 at step 100,
0.000558 at step 125). Instead a decay that has begun continues from the factor it had reached and decays from
there to `min_ratio` over the new remainder. A WSD run resumed before its decay began keeps its stable phase and
decays over the last `decay_fraction` of the new length: the reason to choose WSD. One resumed after its decay
began continues the decay from where it is, stretched to the new end (it does not climb back to the peak); a
full-length stable phase needs a checkpoint from before the decay, which the note names.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from shardlm import ShardlmError
from shardlm.config.checks import canonical_choice

SCHEDULES = ("cosine", "linear", "constant", "wsd", "inverse_sqrt")
DECAY_SHAPES = ("1-sqrt", "linear", "cosine")
# HF Trainer's lr_scheduler_type names, keyed as config.checks.choice_key spells them
SCHEDULE_ALIASES = {"cosinewithminlr": "cosine", "constantwithwarmup": "constant", "warmupstabledecay": "wsd",
                    "inversesqrt": "inverse_sqrt", "rsqrt": "inverse_sqrt"}


def schedule_name(name: str, optimizer: str = "adamw") -> str:
    """`train.schedule` as one of SCHEDULES (any case, HF's names); `auto` is cosine, constant for schedule-free."""
    if name == "auto":
        return "constant" if optimizer == "schedule_free_adamw" else "cosine"
    found = canonical_choice(name, SCHEDULES, SCHEDULE_ALIASES)
    if found is None:
        from shardlm.config.suggest import nearest

        raise ShardlmError(f"train.schedule={name!r} is not one of auto, {', '.join(SCHEDULES)}."
                           f"{nearest(name, list(SCHEDULES))} HF Trainer's names work too: constant_with_warmup, "
                           "cosine_with_min_lr, warmup_stable_decay.")
    return found


def decay(shape: str, progress: float) -> float:
    """How much of the decay is left (1 -> 0) at `progress` (0 -> 1) through it."""
    if shape == "linear":
        return 1.0 - progress
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    return 0.5 * (1 + math.cos(math.pi * progress))


class Schedule:
    """Warmup to the peak, then `main(step)`. `decay_from`/`decay_top` are set by `configure` when a resumed run's
    end moved: from that step on the schedule continues from `decay_top`, the factor it had reached."""

    kind = ""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        self.decay_from: int | None = None  # set by `configure`: the step a moved end's decay starts at
        self.decay_top = 1.0  # the factor at `decay_from`

    def __call__(self, step: int) -> float:
        if self.decay_from is None and step < self.warmup:
            return (step + 1) / self.warmup
        return self.main(step)

    def main(self, step: int) -> float:
        raise NotImplementedError

    def describe(self) -> str:
        """For the run header: `cosine to 0.1 x lr at step 1000 after 20 warmup steps`; after a resume moved the
        end, where it continues from (the floor it stays at, or the value it decays from)."""
        if self.decay_from is not None and self.decay_top == self.min_ratio:
            return (f"{self.kind}, the end moved: at its floor {self.min_ratio:g} x lr from step {self.decay_from} to "
                    f"step {self.total}")
        if self.decay_from is not None:
            return (f"{self.kind}{self._shape()}, the end moved: continued from {self.decay_top:.3g} x lr at step "
                    f"{self.decay_from}")
        return f"{self.kind}{self._shape()}, {self.warmup} warmup steps"

    def _shape(self) -> str:
        return f" to {self.min_ratio:g} x lr at step {self.total}"

    def _decayed(self, begin: int, step: int, shape: str) -> float:
        """The decay from `decay_top` at `begin` to `min_ratio` at `total`."""
        progress = min(1.0, max(0.0, (step - begin) / max(1, self.total - begin)))
        return self.min_ratio + (self.decay_top - self.min_ratio) * decay(shape, progress)

    def decaying(self, step: int) -> bool:
        """Whether the factor at `step` is already on its way down (so a moved end continues from it)."""
        return self.decay_from is not None or step >= self.warmup

    def configure(self, planned: Schedule, step: int) -> str | None:
        """After a resume restored the saved schedule: take this run's warmup and floor (and shape), and if the
        end moved, continue from `step`'s factor to the new end. Returns what changed, for the console."""
        self.warmup, self.min_ratio = planned.warmup, planned.min_ratio
        if planned.total == self.total or step >= planned.total:
            return None
        old = self.total
        if self.decaying(step):
            self.decay_top, self.decay_from = self(step), step
        self.total = planned.total
        now = self(step)
        then = (f"stays at train.min_lr_ratio={self.min_ratio:g} x train.lr" if now == self.min_ratio else
                f"decays to train.min_lr_ratio={self.min_ratio:g} x train.lr at step {planned.total}")
        return (f"the run's end moved from step {old} to {planned.total}: the learning rate continues from its "
                f"value at step {step} ({now:.3g} x train.lr) and {then}, without a jump")


class WarmupCosine(Schedule):
    """`train.schedule=cosine`: linear warmup, then cosine decay to `min_ratio` of the peak at `total`."""

    kind = "cosine"

    def main(self, step: int) -> float:
        begin = self.warmup if self.decay_from is None else self.decay_from
        return self._decayed(begin, step, "cosine")


class WarmupLinear(Schedule):
    kind = "linear"

    def main(self, step: int) -> float:
        begin = self.warmup if self.decay_from is None else self.decay_from
        return self._decayed(begin, step, "linear")


class WarmupConstant(Schedule):
    kind = "constant"

    def _shape(self) -> str:
        return ""

    def main(self, step: int) -> float:  # noqa: ARG002 (the interface's)
        return self.decay_top

    def configure(self, planned: Schedule, step: int) -> str | None:  # noqa: ARG002 (no end to move)
        self.warmup, self.min_ratio, self.total = planned.warmup, planned.min_ratio, planned.total
        return None


class InverseSqrt(WarmupConstant):
    """HF Trainer's `inverse_sqrt` with the warmup as its timescale (1 without warmup), floored at `min_ratio`."""

    kind = "inverse_sqrt"

    def _shape(self) -> str:
        return f" (timescale {max(1, self.warmup)}, floor {self.min_ratio:g} x lr)"

    def main(self, step: int) -> float:
        return max(self.min_ratio, self.decay_top * math.sqrt(max(1, self.warmup) / (step + 1)))


class WarmupStableDecay(Schedule):
    """`train.schedule=wsd`: warmup, the peak, then the last `fraction` of the steps decaying to `min_ratio`."""

    kind = "wsd"

    def __init__(self, warmup: int, total: int, min_ratio: float, fraction: float, shape: str):
        super().__init__(warmup, total, min_ratio)
        self.fraction, self.shape = fraction, shape

    def _shape(self) -> str:
        return (f": stable to step {self.decay_start()}, then {self.shape} to {self.min_ratio:g} x lr at step "
                f"{self.total}")

    def decay_start(self) -> int:
        """The first step of the decay: the last `fraction` of the run (rounded), never inside the warmup."""
        start = self.total - round(self.fraction * self.total)
        return max(start, self.warmup) if self.decay_from is None else self.decay_from

    def main(self, step: int) -> float:
        start = self.decay_start()
        if step < start:
            return self.decay_top
        return self._decayed(start, step, self.shape)

    def decaying(self, step: int) -> bool:
        return step >= self.decay_start()

    def configure(self, planned: Schedule, step: int) -> str | None:
        assert isinstance(planned, WarmupStableDecay)
        self.fraction, self.shape = planned.fraction, planned.shape
        if planned.total == self.total or step >= planned.total:
            return super().configure(planned, step)
        if self.decaying(step):  # the decay had begun: it continues from here, stretched to the new end
            began = self.decay_start()
            moved = super().configure(planned, step)
            return (f"{moved}. Its decay had begun at step {began}: to train at the peak for longer instead, resume "
                    f"from a checkpoint saved before step {began} (checkpoint.resume=PATH)")
        old = self.total
        self.warmup, self.min_ratio, self.total = planned.warmup, planned.min_ratio, planned.total
        if self.decay_start() <= step:  # shortened into its decay: it decays from here
            self.decay_top, self.decay_from = self(step), step
        return (f"the run's end moved from step {old} to {planned.total} before its decay began: the learning rate "
                f"stays at its peak until step {self.decay_start()}, then decays to train.min_lr_ratio="
                f"{self.min_ratio:g} x train.lr at step {planned.total}")


def make_schedule(t: Any, total: int, optimizer: str = "adamw") -> Schedule:
    """The schedule of `train` (a TrainConfig) over `total` steps."""
    name = schedule_name(t.schedule, optimizer)
    if name == "wsd":
        return WarmupStableDecay(t.warmup_steps, total, t.min_lr_ratio, t.decay_fraction, t.decay_shape)
    kinds: dict[str, type[Schedule]] = {"cosine": WarmupCosine, "linear": WarmupLinear, "constant": WarmupConstant,
                                        "inverse_sqrt": InverseSqrt}
    return kinds[name](t.warmup_steps, total, t.min_lr_ratio)


def check_schedule(t: Any, total: int, optimizer: str = "adamw") -> None:
    """Settings that cannot give the schedule asked for. Under `auto` a warmup longer than the run stays allowed
    (a smoke run of a few steps with the default warmup); a schedule named on purpose must fit its steps."""
    name = schedule_name(t.schedule, optimizer)
    if t.decay_shape not in DECAY_SHAPES:
        from shardlm.config.suggest import nearest

        raise ShardlmError(f"train.decay_shape={t.decay_shape!r} is not one of {', '.join(DECAY_SHAPES)}."
                           f"{nearest(t.decay_shape, list(DECAY_SHAPES))}")
    if not 0.0 <= t.decay_fraction <= 1.0:
        raise ShardlmError(f"train.decay_fraction must be between 0 and 1 (the share of the steps that decays), "
                           f"got {t.decay_fraction}.")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ShardlmError(f"train.min_lr_ratio must be between 0 and 1 (the end of the decay as a share of "
                           f"train.lr), got {t.min_lr_ratio}.")
    if t.schedule == "auto" or total <= 0:
        return
    if t.warmup_steps > total:
        raise ShardlmError(f"train.warmup_steps={t.warmup_steps} exceeds the run's {total} steps: train.schedule="
                           f"{t.schedule} would never reach train.lr. Lower train.warmup_steps (or raise "
                           "train.max_steps / train.epochs).")
    if name == "wsd":
        decay_steps = round(t.decay_fraction * total)
        if t.warmup_steps + decay_steps > total:
            raise ShardlmError(f"train.warmup_steps={t.warmup_steps} and the wsd decay ({decay_steps} steps = "
                               f"train.decay_fraction={t.decay_fraction:g} x {total}) exceed the run's {total} "
                               "steps: lower train.warmup_steps or train.decay_fraction.")


class ScheduleState:
    """The LR schedule as a checkpoint part. Loading restores the step and the decay's start, then applies this
    run's config: its warmup and floor, its peak learning rates (the optimizer's `initial_lr`, which
    OptimizerState keeps), and a moved end (`Schedule.configure`), which is reported through `log`. A checkpoint of
    another schedule (train.schedule changed) continues this one from the factor the saved one had reached."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR, log: Callable[[str], None] = print):
        self.scheduler, self.log = scheduler, log

    def state_dict(self) -> dict[str, Any]:
        state = self.scheduler.state_dict()  # JSON (trainer_state.json): a tensor learning rate as its number
        for key in ("base_lrs", "_last_lr"):
            state[key] = [float(v) for v in state.get(key, [])]
        for fn, saved in zip(self.scheduler.lr_lambdas, state["lr_lambdas"], strict=True):
            if isinstance(fn, Schedule) and saved is not None:
                saved["kind"] = fn.kind
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.scheduler
        planned = {id(f): copy.copy(f) for f in s.lr_lambdas if isinstance(f, Schedule)}
        changed = self._changed_kind(state)
        s.load_state_dict(state)
        for schedule in {id(f): f for f in s.lr_lambdas}.values():
            if not isinstance(schedule, Schedule):
                continue
            schedule.__dict__.pop("kind", None)  # the class says which it is
            if changed:
                self._restart(schedule, planned[id(schedule)], s.last_epoch, *changed)
            elif moved := schedule.configure(planned[id(schedule)], s.last_epoch):
                self.log(f"note: {moved}")
        groups = s.optimizer.param_groups
        s.base_lrs = [float(g["initial_lr"]) for g in groups]
        for group, base, factor in zip(groups, s.base_lrs, s.lr_lambdas, strict=True):
            lr = base * factor(s.last_epoch)
            if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep the rate in a tensor
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        s._last_lr = [float(g["lr"]) for g in groups]

    def _changed_kind(self, state: dict[str, Any]) -> tuple[str, float] | None:
        """(saved kind, its factor at the saved step) when the checkpoint's schedule is not this run's."""
        saved = next((d for d in state.get("lr_lambdas", []) if d), None)
        ours = next((f for f in self.scheduler.lr_lambdas if isinstance(f, Schedule)), None)
        if saved is None or ours is None:
            return None
        kind = saved.get("kind", "cosine")  # checkpoints from before train.schedule hold a WarmupCosine
        if kind == ours.kind:
            return None
        kinds = {c.kind: c for c in (WarmupCosine, WarmupLinear, WarmupConstant, InverseSqrt, WarmupStableDecay)}
        old = object.__new__(kinds.get(kind, WarmupCosine))
        old.__dict__.update({k: v for k, v in saved.items() if k != "kind"})
        return kind, old(state["last_epoch"])

    def _restart(self, schedule: Schedule, planned: Schedule, step: int, kind: str, factor: float) -> None:
        schedule.__dict__.clear()
        schedule.__dict__.update(planned.__dict__)
        if step >= planned.warmup:  # in the warmup the new one's warmup goes on
            schedule.decay_from, schedule.decay_top = step, factor
        self.log(f"note: train.schedule changed from {kind} to {schedule.kind} at step {step}: the new schedule "
                 f"continues from the learning rate reached ({factor:.3g} x train.lr), without a jump")

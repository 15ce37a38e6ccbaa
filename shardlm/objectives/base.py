"""The seam between the loop and what it optimizes: `Objective`, what each objective family implements, and
`Loop`, what an objective may ask of the running trainer.

Why a protocol and not a base class: the families share no code through it (a preference step, a generation
round and a teacher's scores have nothing in common below the signature), and the loop needs to know only this
much of them. torchtune's recipes and torchtitan's `TrainSpec` draw the same line: one loop, one home per
objective, the loop free of their names.

The life of an objective in a run:

    family = objective_family(cfg)           # shardlm.objectives: the registry, by train.objective
    family.check(cfg)                        # its config section (build and --dry-run alike)
    train, val = family.load_data(cfg, ...)  # what it reads (prompts for online RL, else blocks)
    family.check_data(cfg, train, val)       # the record kinds it trains on
    objective = family(loop)                 # in the Trainer: its reference, teacher or sampler
    objective.micro_steps(loop)              # each step: forward and backward of the micro-batches
    objective.validate(loop)                 # each evaluation
    objective.state_dict() / load_state_dict(state)   # inside the trainer's state, in every checkpoint
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

StepOut = tuple[int, torch.Tensor, "torch.Tensor | dict[str, float] | None"]
"""(the step's global count the loss is a mean over, this rank's loss sum, the step's statistics)."""


class Loop(Protocol):
    """What an objective reads of the running trainer (shardlm.training.trainer.Trainer satisfies it)."""

    run: Any  # shardlm.training.build.Run: cfg, dist, plan, model, tokenizer, hf_config, train, val
    model: Any
    dist: Any
    device: torch.device
    batch: int  # this rank's micro-batch, in rows
    accum: int
    global_batch: int  # rows of an optimizer step over every data rank
    step: int
    position: int  # the data order's position of this step's first row
    sampler: Any  # the data order (shardlm.data's sampler)
    scaler: torch.amp.GradScaler | None  # fp16: the loss is scaled before backward
    validator: Any  # shardlm.objectives.validate.Validator over this run's ranks
    build_model: Callable[..., Any]  # how the policy was built (a frozen reference or teacher is built alike)

    def autocast(self) -> AbstractContextManager[Any]: ...

    def train_batch(self, m: int) -> Any: ...  # micro-batch m of this step, on the device

    def indices(self, position: int, m: int) -> np.ndarray: ...  # its rows in the training split

    def step_targets(self) -> int: ...  # the step's target tokens over every rank

    def forward_backward_step(self, batch: Any, per_rank_targets: float | None = None) -> torch.Tensor: ...


class Objective(Protocol):
    """One objective family: the class holds what is known before the run (checks, data, header lines, memory
    terms, what `eval` and `export` say of it), an instance what lives in it (reference, teacher, sampler)."""

    names: ClassVar[tuple[str, ...]]  # the values of train.objective it trains
    stats: ClassVar[tuple[str, ...]]  # the names of its per-step statistics sums (reported per `count`)

    @classmethod
    def build(cls, loop: Loop) -> Objective: ...  # in the Trainer, once: its reference, teacher or sampler

    # ---- the run: each step, each evaluation, each checkpoint ------------------------------------------------
    def micro_steps(self, loop: Loop) -> StepOut: ...

    def validate(self, loop: Loop) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def resumed(self, loop: Loop) -> None: ...  # after a checkpoint is loaded, before the run writes anything

    def tokens_seen(self, loop: Loop) -> int: ...

    def advance(self, loop: Loop) -> int: ...  # data positions the last step consumed

    def may_save(self, step: int, total: int) -> bool: ...  # a checkpoint here loses nothing

    def sample_lines(self) -> Iterable[str]: ...  # lines the log prints beside a step's record


class Defaults:
    """What most objectives do where the protocol asks: no state of their own, a step takes `global_batch`
    rows of the data order, tokens are rows x seq_len, any step may be saved, nothing printed per step."""

    stats: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def resumed(self, loop: Loop) -> None:
        pass

    def tokens_seen(self, loop: Loop) -> int:
        return loop.position * loop.run.cfg.data.seq_len

    def advance(self, loop: Loop) -> int:
        return loop.global_batch

    def may_save(self, step: int, total: int) -> bool:  # noqa: ARG002 (the protocol's signature)
        return True

    def sample_lines(self) -> Iterable[str]:
        return ()

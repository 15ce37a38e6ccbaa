"""The seam between the loop and what it optimizes: `Objective`, what each objective family implements, and
`Loop`, what an objective may ask of the running trainer.

Why a protocol and not a base class: the families share no code through it (a preference step, a generation
round and a teacher's scores have nothing in common below the signature), and the loop needs to know only this
much of them. torchtune's recipes and torchtitan's `TrainSpec` draw the same line: one loop, one home per
objective, the loop free of their names.

The life of an objective in a run:

    config.objectives.check(cfg)               # its section's checks, at load (the config layer's Spec)
    family = objective_family(cfg.train.objective)   # shardlm.objectives: the registry
    train, val = family.load_data(cfg, ...)    # what it reads (build and --dry-run alike)
    family.check_data(cfg, hf_cfg, train, val) # the record kinds it trains on; count_steps, check_resume
    objective = family.build(loop)             # in the Trainer: its reference, teacher or sampler
    objective.micro_steps(loop)                # each step: forward and backward of the micro-batches
    objective.validate(loop)                   # each evaluation
    objective.state_dict() / load_state_dict(state)   # inside the trainer's state, in every checkpoint
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

StepOut = tuple[int, torch.Tensor, "torch.Tensor | dict[str, float] | None"]
"""(the step's global count the loss is a mean over, this rank's loss sum, the step's statistics)."""


@dataclass
class Footprint:
    """What `shardlm estimate` has computed of a rank's step when it asks the objective for its own terms."""

    hf_config: Any
    tokenizer: Any
    tokens: int  # a micro-batch's tokens on this rank
    shard: int  # ranks a parameter is sharded over
    csize: int  # bytes of the compute dtype
    on_device: float  # 0 with CPU offload
    use_fsdp: bool
    chunk: int  # the loss's rows at a time (0: the whole logits)
    head: tuple[int, int, bool]  # the policy's head: vocab rows, hidden size, whether it trains
    full_logits: bool  # the family computes its logits in its own forward
    layers: int
    initial_model: float  # bytes of a frozen copy of the initial model (fp32, sharded as the policy)
    gathered: float  # bytes of parameters a training step holds gathered
    whole: float  # bytes of the whole model in the compute dtype


@dataclass
class MemoryTerms:
    """The objective's terms in the estimate: held through the step (a reference, a teacher), its loss's buffers
    in place of the next-token loss's, a phase of its own that may set the peak (online RL's generation), notes."""

    resident: dict[str, float] = field(default_factory=dict)
    loss: dict[str, float] | None = None
    phase: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)


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
    stats: ClassVar[tuple[str, ...]]  # names of its statistics' sums, reported divided by the step's count
    sampled: ClassVar[bool]  # its records are rates of sampled completions (online RL), not of blocks
    perplexity: ClassVar[bool]  # exp of its loss is a perplexity (a next-token loss)

    # ---- before the run: build and --dry-run alike (shardlm.training.checks) -------------------------------
    @classmethod
    def load_data(cls, cfg: Any, tokenizer: Any, dist: Any, load: Callable | None = None) -> tuple[Any, Any]:
        """The training and validation splits it reads (`dist` None and a counting `load`: the dry run's)."""
        ...

    @classmethod
    def check_data(cls, cfg: Any, hf_cfg: Any, train: Any, val: Any) -> None: ...  # the record kinds it takes

    @classmethod
    def count_steps(cls, cfg: Any, train: Any, world: int) -> int: ...  # the run's steps on this data

    @classmethod
    def check_resume(cls, cfg: Any, hf_cfg: Any, train: Any, val: Any, resumed: Any, on_main: Callable) -> None:
        """What a resumed run must find again that the checkpoint does not hold (a stored reference)."""
        ...

    @classmethod
    def data_line(cls, cfg: Any, train: Any, val: Any, steps: int, rows: int) -> str:
        """The run header's data line: the splits, the steps, what a step takes (`rows` per step)."""
        ...

    @classmethod
    def describe_val(cls, cfg: Any, result: dict[str, Any], held_out: int) -> str: ...  # a validation in words

    @classmethod
    def card_line(cls, cfg: Any) -> str | None: ...  # the model card's objective row (`shardlm export`)

    @classmethod
    def answer_tokens(cls, cfg: Any) -> int: ...  # new tokens of the answers a run shows at its end

    @classmethod
    def count_line(cls, cfg: Any, train: Any, val: Any, steps: int, rows: int) -> str: ...  # the dry run's

    @classmethod
    def preflight_lines(cls, cfg: Any, tokenizer: Any, train: Any) -> list[str]: ...  # the dry run's data lines

    @classmethod
    def model_lines(cls, cfg: Any, tokenizer: Any) -> list[str]: ...  # ... and models beside the policy

    @classmethod
    def memory_rows(cls, cfg: Any, hf_cfg: Any) -> tuple[int, int, bool]:
        """(rows, tokens per row, shared prefix under a 4D mask) of a micro-batch, at its longest."""
        ...

    @classmethod
    def memory(cls, cfg: Any, f: Footprint) -> MemoryTerms: ...  # its terms in `shardlm estimate`

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


"""Callbacks: code of your own that runs at fixed points of `Trainer.fit` (early stopping, custom logging, alerts).

A callback is any object with some of the methods of `Callback` below; the Trainer calls each event on every
callback, in the order given, on every rank. Why this shape: the loop stays the same for everyone, and what
used to be special cases inside it (the test suite's injected faults, for one) is a callback like any other
(tests/faults.py). Events (`trainer` is a TrainerView; read `trainer.step`, `trainer.run`, ...):

    on_train_begin(trainer)                       before the first step of this invocation
    on_step_end(trainer, result)                  after each optimizer step; result: StepResult
    on_evaluate(trainer, metrics)                 after each validation: loss, ppl, accuracy, tokens (global)
    on_checkpoint_saved(trainer, step, path)      once a checkpoint is complete on disk (every rank)
    on_train_end(trainer, summary)                after the loop: {"val", "steps", "wall_s"}

`trainer.request_stop()` ends the run after the current step with a checkpoint, as SIGTERM does;
`trainer.request_stop(reason)` ends it for good (the run reports the reason instead of "rerun to resume"). It
must be called on every rank at the same step, so base the decision on global values (`metrics`,
`result["grad_norm"]`), not on a rank's own loss. A callback with `state_dict()` / `load_state_dict(state)`
(JSON values) has its state saved in every checkpoint and restored on resume.

Loading one from the command line: `shardlm train --callback SPEC` (repeatable), SPEC = `MODULE:NAME` or
`path/to/file.py:NAME`, optionally called with literal arguments: `my_callbacks:EarlyStop(patience=3)`. NAME is
a callback object, or a class / function that returns one (called with the arguments, or with none).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, TypedDict

import torch

from shardlm import ShardlmError

EVENTS = ("on_train_begin", "on_step_end", "on_evaluate", "on_checkpoint_saved", "on_train_end")


class StepResult(TypedDict):
    """What `train_step` returns: this rank's summed token loss (a 0-d tensor, not synced), the global gradient
    norm before clipping, whether the update was applied (False: non-finite, skipped) and the learning rate it
    used (read before the schedule moves on)."""

    loss_sum: torch.Tensor
    grad_norm: float
    finite: bool
    lr: float
    targets: int  # target tokens of the whole step (every rank): the loss is their mean; pairs for preference
    stats: torch.Tensor | dict[str, float] | None  # preference: this rank's sums of rewards/chosen, ...
    # (the objective's `stats`); online RL and KTO: the step's statistics over every rank (reward, kl, ...)


class TrainerView(Protocol):
    """What a callback sees of the trainer: the contract between the loop and its extensions (torchtune's
    shape). The Trainer satisfies it; this module imports nothing of the loop, so a callback never pulls
    training (or inference) into the code that defines the events."""

    step: int  # optimizer steps done
    run: Any  # the built run (shardlm.training.build.Run): cfg, model, optimizer, tokenizer, train and val data
    dist: Any  # the process group (shardlm.distributed.process_group.Dist): rank, is_main, print, barrier
    report: Any  # the running fit's reporter: `report.log.write(record)` adds a metrics record

    def request_stop(self, reason: str | None = None) -> None: ...


Trainer = TrainerView  # the name the events' signatures read best with


class Callback:
    """Base class with every event doing nothing: override the ones you need."""

    def on_train_begin(self, trainer: Trainer) -> None:
        pass

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        pass

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        pass

    def on_checkpoint_saved(self, trainer: Trainer, step: int, path: Path) -> None:
        pass

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        pass


class EarlyStopping(Callback):
    """Stop when the validation loss has not improved by more than `min_delta` for `patience` evaluations
    (`--callback 'shardlm.callbacks:EarlyStopping(patience=3)'`). The run ends with a checkpoint, as after
    SIGTERM; validation metrics are global, so every rank stops at the same step."""

    def __init__(self, patience: int = 3, min_delta: float = 0.0, metric: str | None = None):
        """`metric`: the validation record watched; by default `loss`, or an online-RL run's `reward` (which
        has no loss). Rewards and exact match improve upward, everything else downward."""
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience, self.min_delta, self.metric = patience, min_delta, metric
        self.best, self.waited = float("inf"), 0  # `best` is kept negated for a metric that improves upward

    def state_dict(self) -> dict[str, float]:
        return {"best": self.best, "waited": self.waited}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.best, self.waited = state["best"], int(state["waited"])

    def _reason(self) -> str:
        name = self.metric or "loss"
        best = -self.best if _upward(name) else self.best
        return f"early stopping: val {name} {best:.4f} not improved in {self.waited} evaluations"

    def on_train_begin(self, trainer: Trainer) -> None:
        if self.waited >= self.patience:  # a rerun of a run this callback stopped: it stays stopped
            trainer.request_stop(self._reason())

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self.metric is None:
            self.metric = "loss" if "loss" in metrics else "reward"
        if self.metric not in metrics:
            raise ValueError(f"EarlyStopping watches '{self.metric}', which this run's validation does not record "
                             f"(it records {', '.join(sorted(metrics))}); pass metric=one of them")
        value = -metrics[self.metric] if _upward(self.metric) else metrics[self.metric]
        if value < self.best - self.min_delta:
            self.best, self.waited = value, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.dist.print(self._reason())
            trainer.request_stop(self._reason())


def _upward(metric: str) -> bool:
    return "reward" in metric or "exact_match" in metric or "accuracy" in metric


class Callbacks(Callback):
    """Several callbacks as one: each event goes to each callback that defines it, in order."""

    def __init__(self, callbacks: Iterable[object] = ()):
        self.callbacks = list(callbacks)

    def _emit(self, event: str, *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is not None:
                method(*args)

    def on_train_begin(self, trainer: Trainer) -> None:
        self._emit("on_train_begin", trainer)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self._emit("on_step_end", trainer, result)

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self._emit("on_evaluate", trainer, metrics)

    def on_checkpoint_saved(self, trainer: Trainer, step: int, path: Path) -> None:
        self._emit("on_checkpoint_saved", trainer, step, path)

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._emit("on_train_end", trainer, summary)

    def _stateful(self) -> dict[str, Any]:
        return {f"{i}:{type(cb).__name__}": cb for i, cb in enumerate(self.callbacks) if hasattr(cb, "state_dict")}

    def state_dict(self) -> dict[str, Any]:
        return {key: cb.state_dict() for key, cb in self._stateful().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, cb in self._stateful().items():
            if key in state:
                cb.load_state_dict(state[key])


def _bad(spec: str, why: str) -> ShardlmError:
    return ShardlmError(f"--callback {spec!r}: {why}. Write MODULE:NAME or path/to/file.py:NAME, optionally with "
                        "literal arguments: my_callbacks:EarlyStop(patience=3).")


def _module(spec: str, where: str):
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise _bad(spec, f"file '{path}' does not exist")
        found = importlib.util.spec_from_file_location(f"shardlm_callback_{path.stem}", path)
        assert found is not None and found.loader is not None
        module = importlib.util.module_from_spec(found)
        sys.modules[found.name] = module  # dataclasses and pickling look their module up here
        found.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path:  # the `shardlm` script: modules in the working directory import too, as
        sys.path.append(os.getcwd())  # under `python -m` (appended: it never hides an installed package)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise _bad(spec, f"no module named '{e.name}'") from None


def _arguments(spec: str, call: str) -> tuple[list[Any], dict[str, Any]]:
    """`Name(1, x='a')` -> ([1], {"x": "a"}); literals only (numbers, strings, lists, ...), nothing is run."""
    try:
        node = ast.parse(call, mode="eval").body
        if not isinstance(node, ast.Call):
            raise ValueError
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    except (SyntaxError, ValueError):
        raise _bad(spec, "its arguments are not Python literals") from None
    return args, kwargs


def load(spec: str) -> object:
    """The callback named by `spec` (see the module docstring)."""
    head, paren, rest = spec.partition("(")
    where, _, name = head.rpartition(":")
    if not where or not name.isidentifier():
        raise _bad(spec, "not MODULE:NAME")
    target = getattr(_module(spec, where), name, None)
    if target is None:
        raise _bad(spec, f"'{where}' has no '{name}'")
    if paren:
        args, kwargs = _arguments(spec, name + paren + rest)
        callback = target(*args, **kwargs)
    else:
        callback = target() if inspect.isclass(target) or inspect.isfunction(target) else target
    if not any(callable(getattr(callback, event, None)) for event in EVENTS):
        raise _bad(spec, f"{type(callback).__name__} has none of the methods {', '.join(EVENTS)}")
    return callback

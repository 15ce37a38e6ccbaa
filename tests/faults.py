"""Faults the tests inject into real training runs, through shardlm's public callback interface.

Loaded like any user callback: `shardlm train --callback tests/faults.py:KillAfterSave(8) ...` (`fault()` below
builds that option with this file's absolute path), or `train(cfg, callbacks=[SigtermAt(4)])` in process.
Nothing in shardlm/ knows about them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from shardlm.callbacks import Callback

FAULTS = Path(__file__).resolve()


def fault(spec: str) -> str:
    """The command-line option that installs a fault of this module: `fault("KillAfterSave(8)")`."""
    return f"--callback={FAULTS}:{spec}"


class KillAfterSave(Callback):
    """kill -9 of every rank right after the checkpoint of `step` is complete."""

    def __init__(self, step: int):
        self.step = step

    def on_checkpoint_saved(self, trainer, step, path) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class PauseInSave(Callback):
    """Rank 0 stalls in the save of `step` after every shard is written and before the manifest (the commit
    point), and says so in OUT_DIR/paused_in_save: a test kills the run there to leave a torn checkpoint."""

    def __init__(self, step: int):
        self.step = step

    def on_train_begin(self, trainer) -> None:
        checkpointer = trainer.checkpointer
        write = checkpointer.write_manifest

        def paused(tmp, step, began):
            if step == self.step:
                (trainer.run.out_dir / "paused_in_save").write_text(str(step))
                time.sleep(3600)
            write(tmp, step, began)

        checkpointer.write_manifest = paused


class SigtermAt(Callback):
    """SIGTERM to rank 0 alone after `step`: every rank must still stop after the same step."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, result) -> None:
        if trainer.step == self.step and trainer.dist.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)


class DieAt(Callback):
    """SIGKILL of `rank` after `step`, on a torchrun job's first attempt only (the restart then resumes)."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_step_end(self, trainer, result) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.step == self.step and trainer.dist.rank == self.rank and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)


class _NanGradient(torch.autograd.Function):
    """Identity forward (the loss stays finite and is logged), NaN backward (every gradient becomes NaN)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class NanSteps(Callback):
    """The optimizer steps numbered `steps` (1-based) get non-finite gradients, as an overflow would give."""

    def __init__(self, *steps: int):
        self.steps = set(steps)

    def on_train_begin(self, trainer) -> None:
        def poison(module, args, output):
            if torch.is_grad_enabled() and trainer.step + 1 in self.steps:
                return (_NanGradient.apply(output[0]), *output[1:])
            return output

        trainer.model.register_forward_hook(poison)

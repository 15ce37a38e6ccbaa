"""The training loop: `train_step` (micro-steps, clip, optimizer step), `evaluate`, `fit`.

The Trainer holds training state and nothing else. Its own state (step, data position, counters) goes in and
out through `state_dict` / `load_state_dict`, like every other part of a checkpoint (torchtitan's
`Trainer(Stateful)`): the Checkpointer saves a dict of such parts and never looks inside the Trainer. What a
run reports lives in shardlm.training.reporting, and code of the user's own runs through shardlm.callbacks, so `fit`
reads like nanoGPT's loop: step -> maybe log -> maybe evaluate -> maybe save. What the run optimizes is one
`Objective` (shardlm.objectives, chosen by train.objective): its micro-steps, validation and state, so the loop
names no objective.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from shardlm import ShardlmError
from shardlm.callbacks import Callbacks, StepResult
from shardlm.checkpoint.checkpointer import Checkpointer
from shardlm.checkpoint.layout import checkpoints_dir
from shardlm.checkpoint.state import RngState, model_parts
from shardlm.config import Config
from shardlm.data import Batch, Blocks, MixtureSampler, TokenBlocks, micro_batch_position, train_sampler
from shardlm.data.prefetch import Key, Prefetcher
from shardlm.distributed import context, xla
from shardlm.models import lora
from shardlm.models.causal_lm import num_params
from shardlm.models.fp8 import after_optimizer_step
from shardlm.objectives import Objective, objective_family
from shardlm.objectives.lm import blocks
from shardlm.objectives.validate import Validator
from shardlm.observe.hardware import peak_flops
from shardlm.training import reporting
from shardlm.training.build import Run, build, build_model
from shardlm.training.optim.optimizers import update_plan
from shardlm.training.optim.update import LateRead, clip_grad_norm, fused_clip_step, grad_norm
from shardlm.training.schedule import ScheduleState


class Trainer:
    """`checkpoint=True` gives the trainer a Checkpointer over its stateful parts (`train()` does this);
    `callbacks` are shardlm.callbacks objects; `prefetch` loads batches in the background (default: on CUDA)."""

    report: reporting.Reporter  # the running `fit`'s reporter (callbacks write their own records through it)

    def __init__(self, run: Run, *, checkpoint: bool = False, callbacks: Iterable[object] = (),
                 prefetch: bool | None = None):
        self.run, self.cfg, self.dist, self.model = run, run.cfg, run.dist, run.model
        self.device = self.dist.device
        t = self.cfg.train
        # An XLA process drives every device of its host: its micro-batch is theirs, in device order
        self.batch, self.seq_len, self.accum = t.batch_size * self.dist.devices, self.cfg.data.seq_len, t.grad_accum
        self.global_batch = reporting.global_batch(run)  # blocks per optimizer step
        self.sampler = train_sampler(run.train, t.seed)
        self.step, self.position, self.bad_steps, self.skipped_steps = 0, 0, 0, 0
        self.stop_requested = False
        self.stop_reason: str | None = None  # set by a callback's final stop (early stopping), not by signals
        self.callbacks = Callbacks(callbacks)
        self.fp8 = self.cfg.parallel.precision == "fp8"
        self.params = list(self.model.parameters())
        self.xla = self.device.type == "xla"
        self.prefetch = self.device.type == "cuda" if prefetch is None else prefetch
        self._prefetcher: Prefetcher | None = None
        self.scaler = torch.amp.GradScaler(self.device.type) if run.plan.dtype == torch.float16 else None
        self._plain_amp = not run.plan.use_fsdp and run.plan.dtype != torch.float32
        self.validator = Validator(self.dist, self.batch, t.eval_batches, self.autocast, self._batch)
        self.build_model = build_model  # a frozen reference or teacher is built as the policy was
        # What the run optimizes (shardlm.objectives): its reference, teacher or sampler is built here
        self.objective: Objective = objective_family(t.objective).build(self)
        # The step's gradient norm is read on the host one step late where the optimizer takes the clip factor
        # (training.optim.update decides, and the run header says which)
        self.sync_free = update_plan(run.optimizer).sync_free
        self._pending: tuple[LateRead, StepResult, int] | None = None  # a step whose norm the host has not read
        self.checkpointer = Checkpointer(
            run.cfg, run.dist, checkpoints_dir(run.out_dir), stateful_parts(run, self), hf_config=run.hf_config,
            tokenizer=run.tokenizer, on_saved=self._saved, before_save=self.settle) if checkpoint else None

    @classmethod
    def from_config(cls, cfg: Config, **options: Any) -> Trainer:
        """`Trainer(build(cfg), **options)`: the run built in the design's order (training.build), then its loop."""
        return cls(build(cfg), **options)

    # ---- state: what a checkpoint keeps of the trainer ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "position": self.position, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps,
                "callbacks": self.callbacks.state_dict(), "data_blocks": [len(self.run.train), len(self.run.val)],
                **self.objective.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The data stream continues at the saved position even when the global batch changed."""
        self.step, self.position = state["step"], state["position"]
        self.bad_steps, self.skipped_steps = state["bad_steps"], state["skipped_steps"]
        self.callbacks.load_state_dict(state.get("callbacks", {}))
        self.objective.load_state_dict(state)  # e.g. another teacher than the run's is refused here
        blocks = [len(self.run.train), len(self.run.val)]
        if state.get("data_blocks", blocks) != blocks:
            (tr, va), (tr2, va2) = state["data_blocks"], blocks
            self.dist.print(f"note: the data changed since this checkpoint ({tr:,} train / {va:,} val blocks, now "
                            f"{tr2:,} / {va2:,}): the block order and the validation set differ from the run's so "
                            "far, and its losses are not comparable across this point")
        if state["global_batch"] != self.global_batch:
            self.dist.print(f"note: global batch changed {state['global_batch']} -> {self.global_batch} blocks; "
                            f"the data stream continues at block {self.position}")

    def tokens_seen(self) -> int:
        """Tokens trained on (online RL: prompt and completion tokens sampled)."""
        return self.objective.tokens_seen(self)

    def tokens_by_source(self) -> list[int] | None:
        """Training tokens seen from each source of a mixture (in data.train's order); None for one source."""
        if not isinstance(self.sampler, MixtureSampler):
            return None
        return [int(n) * self.seq_len for n in self.sampler.counts(self.position)]

    def request_stop(self, reason: str | None = None) -> None:
        """End `fit` after this step, with a checkpoint (as SIGTERM does); call it on every rank at one step.
        With a `reason` the stop is final (early stopping): the run does not say "rerun to resume"."""
        self.stop_requested = True
        self.stop_reason = reason or self.stop_reason

    # ---- numbers benchmarks/mfu.py reads (they live in shardlm.training.reporting) ----------------------------------
    @property
    def n_params(self) -> int:
        return num_params(self.model)

    @property
    def flops_per_token(self) -> float:
        return reporting.model_flops_per_token(self.run)

    @property
    def flops_per_token_causal(self) -> float:
        """llm.c's convention: attention counted for its causal half."""
        return reporting.model_flops_per_token(self.run, causal=True)

    @property
    def peak_flops(self) -> float | None:
        return peak_flops(self.device)

    def autocast(self) -> AbstractContextManager[Any]:
        """Without FSDP there is no mixed-precision policy to cast compute: plain autocast does it."""
        if self._plain_amp:
            return torch.autocast(self.device.type, dtype=self.run.plan.dtype)
        return contextlib.nullcontext()

    # ---- batches -------------------------------------------------------------------------------------------
    def _batch(self, blocks: Blocks, indices: np.ndarray) -> Batch:
        batch = blocks.batch(indices)
        if self.device.type == "cuda":
            return batch.pin_memory().to(self.device, non_blocking=True)
        if self.xla:
            return batch.map(lambda t: xla.to_device(t, self.device))
        return batch

    def indices(self, position: int, m: int) -> np.ndarray:
        """Block indices of this rank's micro-batch `m` of the optimizer step starting at `position`."""
        start = micro_batch_position(position, m, self.dist.data_rank, self.dist.data_world, self.batch)
        return self.sampler.indices(start, self.batch)

    def _micro_batches(self, position: int, first: int) -> Iterator[tuple[Key, np.ndarray]]:
        """(key, block indices) of every micro-batch from (position, first) on, in training order."""
        while True:
            for m in range(first, self.accum):
                yield (position, m), self.indices(position, m)
            position, first = position + self.global_batch, 0

    def train_batch(self, m: int) -> Batch:
        """Micro-batch `m` of this step on the device (prefetched in the background where that is on)."""
        key: Key = (self.position, m)
        if not self.prefetch:
            return self._batch(blocks(self.run.train), self.indices(*key))
        batch = self._prefetcher.next(key) if self._prefetcher else None
        if batch is None:  # first step, or the position moved (a checkpoint was loaded)
            self.close()
            self._prefetcher = Prefetcher(blocks(self.run.train).batch, self._micro_batches(*key), self.device)
            batch = self._prefetcher.next(key)
            assert batch is not None  # a new prefetcher starts at `key`
        return batch

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    # ---- one optimizer step --------------------------------------------------------------------------------
    def forward_backward_step(self, batch: Batch, per_rank_targets: float | None = None) -> torch.Tensor:
        """Sum of token losses of this micro-batch (detached); gradients accumulate in the parameters.
        The loss is divided by the step's global target count over the ranks that average gradients: the mean
        over every target of the optimizer step (`step_targets`); by default a text step's count."""
        with context.split_step(self.dist, self.run.model.hf.config, batch) as mine:
            with self.autocast():
                loss_sum, _ = self.model(mine.inputs, mine.targets, mine.positions)
            denominator = per_rank_targets or batch.inputs.shape[0] * self.seq_len * self.accum
            loss = loss_sum / denominator
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss_sum.detach()

    def step_targets(self) -> int:
        """Targets of the whole optimizer step (every rank and micro-batch): examples differ in target count, so
        the loss sum is divided once by the global count, never by a micro-batch's own. Read from the sampler on
        the host: no collective, the same on any world size."""
        train = blocks(self.run.train)
        if isinstance(train, TokenBlocks):
            return self.global_batch * self.seq_len
        return max(1, train.targets(self.sampler.indices(self.position, self.global_batch)))

    def _grad_norm(self) -> float:
        max_norm = self.cfg.train.grad_clip or float("inf")
        norm = clip_grad_norm(self.params, max_norm, self.device)
        if self.xla:  # forward + backward + clip as one graph, before the host reads the norm
            xla.sync()
        return float(norm)  # one host sync per optimizer step, needed to skip bad steps

    def train_step(self) -> StepResult:
        if not self.model.training:  # train() walks every module: not per step
            self.model.train()
        opt = self.run.optimizer
        targets, loss_sum, stats = self.objective.micro_steps(self)  # forward and backward of every micro-batch
        self.settle()  # the previous step, read now that this one's forward and backward are queued
        lr = float(opt.param_groups[0]["lr"])
        result: StepResult = {"loss_sum": loss_sum, "grad_norm": math.nan, "finite": True, "lr": lr,
                              "targets": targets, "stats": stats}
        if self.sync_free:
            norm = grad_norm(self.params, self.device)
            fused_clip_step(opt, norm, self.cfg.train.grad_clip)
            if self.fp8:  # after a skipped update the weights, and so their scales, are unchanged
                after_optimizer_step(self.model)
            self._pending = (LateRead(norm), result, self.step + 1)
        else:
            self._sync_update(opt, result)
        opt.zero_grad(set_to_none=True)
        if self.xla:  # the optimizer step as a second graph
            xla.sync()
        self.step += 1
        self.position += self.objective.advance(self)  # online RL: prompts, none while it reuses its round
        if not self.sync_free:
            self._account(result, self.step)
        return result

    def _sync_update(self, opt: torch.optim.Optimizer, result: StepResult) -> None:
        """Clip and step with the norm read on the host now (fp16's GradScaler, XLA, offload, non-fused)."""
        if self.scaler:
            self.scaler.unscale_(opt)
        result["grad_norm"] = self._grad_norm()
        result["finite"] = math.isfinite(result["grad_norm"])
        if self.scaler:  # the scaler skips non-finite steps itself and lowers its scale
            self.scaler.step(opt)
            self.scaler.update()
        elif result["finite"]:
            opt.step()
            if self.fp8:
                after_optimizer_step(self.model)

    def settle(self) -> None:
        """Read the last step's gradient norm (it waits for that step alone) and do its host bookkeeping; a
        no-op once read. The record, callbacks and checkpoints call it; train_step before the next update."""
        if self._pending is None:
            return
        late, result, step = self._pending
        self._pending = None
        result["grad_norm"] = late.value()
        result["finite"] = math.isfinite(result["grad_norm"])
        self._account(result, step)

    def _account(self, result: StepResult, step: int) -> None:
        """A step's host bookkeeping once its norm is known: skip count, schedule, stop after too many bad steps."""
        applied = result["finite"] or self.scaler is not None  # the scaler skips non-finite steps itself
        self.bad_steps = 0 if applied else self.bad_steps + 1
        self.skipped_steps += 0 if applied else 1
        if applied:
            self.run.scheduler.step()
        self._check_finite(result, step)

    def _check_finite(self, result: StepResult, step: int) -> None:
        if result["finite"]:
            return
        self.dist.print(f"step {step}: non-finite loss/gradient, update skipped "
                        f"({self.bad_steps} in a row, {self.skipped_steps} in all)")
        if self.bad_steps >= self.cfg.train.max_bad_steps:
            raise ShardlmError(
                f"{self.bad_steps} consecutive steps had a non-finite loss (last at step {step}); "
                "stopping. Lower train.lr, use parallel.precision=bf16/fp32, or raise "
                "train.max_bad_steps. The last good checkpoint is kept.")

    # ---- evaluation ----------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """The validation split scored by the run's objective (as `shardlm eval` does): next-token loss, the
        preference loss and rewards, the rewards of sampled completions, the divergence to a teacher."""
        return self.objective.validate(self)

    # ---- the run -------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """step -> maybe log -> maybe evaluate -> maybe save; the final evaluation unless stopped by a signal."""
        t, total, ck = self.cfg.train, self.run.total_steps, self.checkpointer
        report = self.report = reporting.Reporter(self.run, self.step, ck.cfg.every if ck else 0)
        self.callbacks.on_train_begin(self)
        with ck.catch_signals() if ck else contextlib.nullcontext():
            while self.step < total and not self.stop_requested:
                result = self.train_step()
                report.step_done(result["loss_sum"], result["targets"], result.get("stats"))
                log_due = self.step % t.log_every == 0 or self.step == total
                if log_due or self.callbacks.callbacks:  # they read the step's norm: the host waits for it
                    self.settle()
                self.callbacks.on_step_end(self, result)
                if log_due:
                    report.log_train(self.step, lr=result["lr"], grad_norm=result["grad_norm"],
                                     tokens=self.tokens_seen(),
                                     skipped_steps=self.skipped_steps, tokens_by_source=self.tokens_by_source(),
                                     samples=self.objective.sample_lines())
                if t.eval_every and self.step % t.eval_every == 0 and self.step < total:
                    self._evaluate(report)
                self._maybe_save(report)
                report.resume_clock()
            self.settle()
            if not self.stop_requested:
                self._evaluate(report)
            self.close()
            if ck:
                ck.finish_pending()
        summary = report.close(self.step, self.stop_requested)
        self.callbacks.on_train_end(self, summary)
        return summary

    def _evaluate(self, report: reporting.Reporter) -> None:
        with report.timed("eval"):
            metrics = self.evaluate()
        report.log_val(self.step, metrics, self.tokens_seen())
        self.callbacks.on_evaluate(self, metrics)

    def _maybe_save(self, report: reporting.Reporter) -> None:
        """Every rank asks `should_stop` every step: the signal check is a collective."""
        if self.checkpointer is None:
            return
        total = self.run.total_steps
        signalled = self.checkpointer.should_stop()  # honoured where a checkpoint loses nothing (RL: a round's end)
        self.stop_requested = self.stop_requested or signalled and self.objective.may_save(self.step, total)
        if self.stop_requested or self.checkpointer.due(self.step, total) and self.objective.may_save(self.step, total):
            with report.timed("save"):
                self.checkpointer.save(self.step)

    def _saved(self, step: int, path: Any) -> None:
        self.callbacks.on_checkpoint_saved(self, step, path)


def stateful_parts(run: Run, train_state: Stateful) -> dict[str, Stateful]:
    """Everything a resume restores: model, optimizer, schedule, the trainer's own state and the RNG."""
    return {**model_parts(run.model, run.optimizer, lora.enabled(run.cfg.lora)),
            "scheduler": ScheduleState(run.scheduler, run.dist.print), "train_state": train_state,
            "rng": RngState(run.dist.device.type == "xla")}

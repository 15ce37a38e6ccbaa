"""The training loop: `train_step` (micro-steps, clip, optimizer step), `evaluate`, `fit`."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time

import numpy as np
import torch

from shardlm import ShardlmError
from shardlm.build import Run
from shardlm.data import GlobalSampler, eval_shares, micro_batch_position
from shardlm.data.prefetch import Key, Prefetcher
from shardlm.fp8 import after_optimizer_step
from shardlm.metrics import (
    Eta,
    MetricsLog,
    Progress,
    StepTimer,
    flops_per_token,
    fmt_time,
    gpu_utilization,
    peak_flops,
    peak_memory_bytes,
)
from shardlm.model import num_params
from shardlm.parallel import set_gradient_sync


class Trainer:
    def __init__(self, run: Run, checkpointer=None, prefetch: bool | None = None):
        self.run, self.cfg, self.dist, self.model = run, run.cfg, run.dist, run.model
        self.device = self.dist.device
        t = self.cfg.train
        self.batch, self.seq_len, self.accum = t.batch_size, self.cfg.data.seq_len, t.grad_accum
        self.global_batch = self.dist.world_size * self.batch * self.accum  # blocks per optimizer step
        self.sampler = GlobalSampler(len(run.train), t.seed)
        self.step, self.position, self.bad_steps, self.skipped_steps = 0, 0, 0, 0
        self.checkpointer = checkpointer
        self.stop_requested = False
        self.fp8 = self.cfg.parallel.precision == "fp8"
        self.params = list(self.model.parameters())
        self.prefetch = self.device.type == "cuda" if prefetch is None else prefetch  # background batch loading
        self._prefetcher: Prefetcher | None = None
        fp16, plain_amp = run.plan.dtype == torch.float16, not run.plan.use_fsdp and run.plan.dtype != torch.float32
        self.scaler = torch.amp.GradScaler(self.device.type) if fp16 else None
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=run.plan.dtype)) if plain_amp \
            else contextlib.nullcontext
        n = num_params(self.model)
        hf = run.hf_config
        layers = getattr(hf, "n_layer", getattr(hf, "num_hidden_layers", 0))
        width = getattr(hf, "n_embd", getattr(hf, "hidden_size", 0))
        # nanoGPT's N leaves out the position embeddings (a lookup, no matmul)
        self.flops_per_token = flops_per_token(num_params(self.model, exclude_embeddings=True), layers, width,
                                               self.seq_len)
        self.peak_flops = peak_flops(self.device)
        self.n_params = n

    # ---- one optimizer step -------------------------------------------------------------------------
    def _batch(self, blocks, indices: np.ndarray) -> torch.Tensor:
        batch = blocks.get(indices)
        if self.device.type == "cuda":
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch

    def _indices(self, position: int, m: int) -> np.ndarray:
        """Block indices of this rank's micro-batch `m` of the optimizer step starting at `position`."""
        start = micro_batch_position(position, m, self.dist.rank, self.dist.world_size, self.batch)
        return self.sampler.indices(start, self.batch)

    def _micro_batches(self, position: int, first: int):
        """(key, block indices) of every micro-batch from (position, first) on, in training order."""
        while True:
            for m in range(first, self.accum):
                yield (position, m), self._indices(position, m)
            position, first = position + self.global_batch, 0

    def _train_batch(self, m: int) -> torch.Tensor:
        key: Key = (self.position, m)
        if not self.prefetch:
            return self._batch(self.run.train, self._indices(*key))
        batch = self._prefetcher.next(key) if self._prefetcher else None
        if batch is None:  # first step, or the position moved (a checkpoint was loaded)
            self.close()
            self._prefetcher = Prefetcher(self.run.train.get, self._micro_batches(*key), self.device)
            batch = self._prefetcher.next(key)
        return batch

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def forward_backward_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sum of token losses of this micro-batch (detached); gradients accumulate in the parameters."""
        with self.autocast():
            loss_sum, _ = self.model(tokens[:, :-1], tokens[:, 1:])
        loss = loss_sum / (tokens.shape[0] * self.seq_len * self.accum)  # mean over this rank's step tokens
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss_sum.detach()

    def train_step(self) -> dict:
        if not self.model.training:  # train() walks every module: not per step
            self.model.train()
        opt = self.run.optimizer
        loss_sum = torch.zeros((), device=self.device)
        for m in range(self.accum):
            tokens = self._train_batch(m)
            set_gradient_sync(self.model, m == self.accum - 1)
            loss_sum += self.forward_backward_step(tokens)
        if self.scaler:
            self.scaler.unscale_(opt)
        max_norm = self.cfg.train.grad_clip or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)  # one host sync per optimizer step, needed to skip bad steps
        finite = math.isfinite(grad_norm) and not self._inject_nan()
        if self.scaler:
            self.scaler.step(opt)
            self.scaler.update()
        elif finite:
            opt.step()
            if self.fp8:
                after_optimizer_step(self.model)
        opt.zero_grad(set_to_none=True)
        self.bad_steps = 0 if finite or self.scaler else self.bad_steps + 1
        self.skipped_steps += 0 if finite or self.scaler else 1
        if finite or self.scaler:
            self.run.scheduler.step()
        self.step += 1
        self.position += self.global_batch
        return {"loss_sum": loss_sum, "grad_norm": grad_norm, "finite": finite}

    def _inject_nan(self) -> bool:
        """Test hook: SHARDLM_TEST_NAN_STEPS=3,4 makes those steps non-finite."""
        import os

        steps = os.environ.get("SHARDLM_TEST_NAN_STEPS")
        return bool(steps) and str(self.step + 1) in steps.split(",")

    # ---- evaluation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        val, shares = self.run.val, eval_shares(len(self.run.val), self.dist.rank, self.dist.world_size,
                                                 self.batch, self.cfg.train.eval_batches)
        sums = torch.zeros(3, device=self.device, dtype=torch.float64)  # loss, correct, tokens
        for indices in shares:
            valid = torch.from_numpy(indices >= 0)
            tokens = self._batch(val, np.where(indices >= 0, indices, 0))
            targets = tokens[:, 1:].clone()
            targets[~valid.to(self.device)] = -100
            with self.autocast():
                loss_sum, correct = self.model(tokens[:, :-1], targets)
            sums += torch.stack([loss_sum.double(), correct.double(),
                                 torch.tensor(float(valid.sum() * self.seq_len), device=self.device,
                                              dtype=torch.float64)])
        self.dist.all_reduce_sum(sums)
        loss = (sums[0] / sums[2]).item()
        return {"loss": loss, "ppl": math.exp(min(loss, 700)), "accuracy": (sums[1] / sums[2]).item(),
                "tokens": int(sums[2].item())}

    # ---- the run ------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, d, run = self.cfg, self.dist, self.run
        t = cfg.train
        log = MetricsLog(run.out_dir, cfg.log.tensorboard, d.is_main, cfg=cfg)
        total = run.total_steps
        d.print(self.describe())
        progress = Progress(total, cfg.log.progress, d.is_main, initial=self.step)
        eta = Eta(total)
        tokens_per_step = self.global_batch * self.seq_len
        timer, interval_time, interval_steps = StepTimer(), 0.0, 0
        acc_loss = torch.zeros(1, device=self.device, dtype=torch.float64)
        last_val: dict | None = None
        start_wall, start_step = time.time(), self.step
        evals_left = lambda: (total - self.step) // t.eval_every if t.eval_every else 0  # noqa: E731
        while self.step < total and not self.stop_requested:
            out = self.train_step()
            acc_loss += out["loss_sum"].double()
            _test_signal_hook(self.step, self.dist.rank)
            seconds = timer.lap()
            eta.add_step(seconds)
            interval_time, interval_steps = interval_time + seconds, interval_steps + 1
            if not out["finite"]:
                d.print(f"step {self.step}: non-finite loss/gradient, update skipped "
                        f"({self.bad_steps} in a row, {self.skipped_steps} in all)")
                if self.bad_steps >= t.max_bad_steps:
                    raise ShardlmError(
                        f"{self.bad_steps} consecutive steps had a non-finite loss (last at step {self.step}); "
                        "stopping. Lower train.lr, use parallel.precision=bf16/fp32, or raise "
                        "train.max_bad_steps. The last good checkpoint is kept.")
            if self.step % t.log_every == 0 or self.step == total:
                self.dist.all_reduce_sum(acc_loss)
                denom = interval_steps * tokens_per_step
                loss = (acc_loss[0] / denom).item()
                tps = tokens_per_step * interval_steps / max(interval_time, 1e-9)
                record = {"step": self.step, "split": "train", "loss": loss,
                          "lr": run.scheduler.get_last_lr()[0], "grad_norm": out["grad_norm"],
                          "tokens": self.position * self.seq_len, "tokens_per_s": tps,
                          "mfu": (self.flops_per_token * tps / (self.peak_flops * d.world_size)
                                  if self.peak_flops else None),
                          "peak_mem_gb": peak_memory_bytes(self.device) / 1e9, "device": self.device.type,
                          "skipped_steps": self.skipped_steps, "time_s": time.time() - start_wall,
                          **gpu_utilization(self.device)}
                log.write(record)
                remaining = eta.remaining(self.step, evals_left() + 1, self._saves_left(total))
                progress.update(self.step, {"loss": f"{loss:.4f}", "tok/s": f"{tps:,.0f}",
                                            "eta": fmt_time(remaining)} | self._mem_field())
                acc_loss.zero_()
                interval_time, interval_steps = 0.0, 0
            if t.eval_every and self.step % t.eval_every == 0 and self.step < total:
                last_val = self._eval_and_log(log, progress, eta)
            if self.checkpointer:
                self.stop_requested = self.checkpointer.should_stop()
                if self.stop_requested or self.checkpointer.due(self.step, total):
                    began = time.perf_counter()
                    self.checkpointer.save(self)
                    eta.add_save(time.perf_counter() - began)
            timer.lap()  # evaluation and saving are counted by the ETA on their own
        if not self.stop_requested:
            last_val = self._eval_and_log(log, progress, eta)
        self.close()
        if self.checkpointer:
            self.checkpointer.finish_pending()
        progress.close()
        log.close()
        wall = time.time() - start_wall
        if not self.stop_requested:
            n = self.step - start_step
            this = f"{n} step{'s' * (n != 1)} in {fmt_time(wall)}"
            d.print(f"done: {this}" if not start_step else f"done: step {self.step}/{total}; this invocation: {this}"
                    f" (resumed at step {start_step})", end="")
            d.print(f", val loss {last_val['loss']:.4f} ppl {last_val['ppl']:.2f} accuracy {last_val['accuracy']:.3f}"
                    if last_val else "")
        return {"val": last_val, "steps": self.step, "wall_s": wall}

    def _eval_and_log(self, log: MetricsLog, progress: Progress, eta: Eta) -> dict:
        began = time.perf_counter()
        result = self.evaluate()
        eta.add_eval(time.perf_counter() - began)
        log.write({"step": self.step, "split": "val", **result, "tokens_seen": self.position * self.seq_len})
        progress.write(f"step {self.step}: val loss {result['loss']:.4f} ppl {result['ppl']:.2f} "
                       f"accuracy {result['accuracy']:.3f}")
        return result

    def _saves_left(self, total: int) -> int:
        every = self.cfg.checkpoint.every if self.checkpointer else 0
        return (total - self.step) // every if every else 0

    def _mem_field(self) -> dict[str, str]:
        if self.device.type != "cuda":
            return {}
        return {"mem": f"{torch.cuda.max_memory_allocated(self.device) / 2**30:.1f}G"}

    def _params(self) -> str:
        from shardlm import lora

        trainable, total = lora.count(self.model)
        if trainable == total:
            return f"{total / 1e6:.2f}M parameters"
        return f"{total / 1e6:.2f}M parameters, {trainable:,} trainable ({100 * trainable / total:.2f}%)"

    def describe(self) -> str:
        cfg, d, pl = self.cfg, self.dist, self.run.plan
        if pl.use_fsdp:
            where = (f"{d.info.launcher} launch: {d.world_size} rank(s) on {d.info.num_nodes} node(s), "
                     f"FSDP2 {cfg.parallel.sharding}, mesh {pl.mesh_shape}")
        else:
            where = "1 process, no FSDP (launch with --nproc N or torchrun to shard)"
        extras = [n for n, on in (("activation checkpointing", cfg.parallel.activation_checkpointing),
                                  (f"compile {pl.compile}", pl.compile != "false"),
                                  ("cpu offload", cfg.parallel.cpu_offload)) if on]
        return (f"shardlm: {where}; {self.device.type}, {cfg.parallel.precision}"
                + (f", {', '.join(extras)}" if extras else "") + "\n"
                f"model: {self._params()}; data: {len(self.run.train):,} train / "
                f"{len(self.run.val):,} val blocks of {self.seq_len} tokens\n"
                f"{self.run.total_steps} steps x {self.global_batch} blocks "
                f"({self.global_batch * self.seq_len:,} tokens per step), out_dir {self.run.out_dir}")


def _test_signal_hook(step: int, rank: int) -> None:
    """Test hooks. SHARDLM_TEST_SIGTERM_AT=STEP sends SIGTERM to rank 0 alone after that step;
    SHARDLM_TEST_DIE_AT=STEP:RANK kills that rank with SIGKILL, on a job's first attempt only."""
    if rank == 0 and os.environ.get("SHARDLM_TEST_SIGTERM_AT") == str(step):
        os.kill(os.getpid(), signal.SIGTERM)
    if os.environ.get("SHARDLM_TEST_DIE_AT") == f"{step}:{rank}" and \
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)

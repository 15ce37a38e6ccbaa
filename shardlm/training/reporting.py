"""What a run says about itself while it trains: the run header, training records (interval loss, tokens/s,
MFU, memory), validation records, the progress bar or lines with an ETA, and the closing line.

Why a component of its own (torchtitan's MetricsProcessor, smaller): the loop only says *when* (after a step,
at a log interval, after an evaluation or a save); this says *what*. The Trainer then holds training state
only, and a change to what is reported never touches the loop. The building blocks (MetricsLog, Progress,
Eta, MFU) are in shardlm.observe.metrics.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from shardlm.config import task_defaults_note
from shardlm.data import describe
from shardlm.distributed import checkpointing, cpu_comms, xla
from shardlm.distributed.wrapping import describe_units
from shardlm.models import lora
from shardlm.models.causal_lm import num_params, transformer_blocks
from shardlm.models.moe import active_fraction, expert_params, idle_expert_params, router_record
from shardlm.objectives import objective_family
from shardlm.observe.hardware import gpu_utilization, peak_flops, peak_memory_bytes
from shardlm.observe.metrics import MetricsLog, flops_per_token
from shardlm.observe.progress import Eta, Progress, StepTimer, fmt_time
from shardlm.training.build import Run, describe_optimizer


def global_batch(run: Run) -> int:
    """Blocks per optimizer step, over all ranks (and all devices of an XLA process)."""
    return run.dist.data_parallel * run.cfg.train.batch_size * run.cfg.train.grad_accum


def model_flops_per_token(run: Run, causal: bool = False) -> float:
    """nanoGPT's estimate (`causal`: llm.c's); its N leaves out the position embeddings (a lookup, no matmul),
    and counts a mixture-of-experts model's *active* parameters: the routed experts x top_k / experts."""
    hf = run.hf_config
    layers = getattr(hf, "n_layer", getattr(hf, "num_hidden_layers", 0))
    width = getattr(hf, "n_embd", getattr(hf, "hidden_size", 0))
    active = num_params(run.model, exclude_embeddings=True) - idle_expert_params(run.model, hf)
    return flops_per_token(active, layers, width,
                           run.cfg.data.seq_len, causal)


def _params(run: Run) -> str:
    trainable, total = lora.count(run.model)
    if (share := active_fraction(run.hf_config)) < 1:
        routed, active = expert_params(run.model), total - idle_expert_params(run.model, run.hf_config)
        return (f"{total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active per token (mixture of experts: "
                f"{routed / 1e6:.2f}M in routed experts, top-{run.hf_config.num_experts_per_tok} of "
                f"{round(run.hf_config.num_experts_per_tok / share)})"
                + (f", {trainable:,} trainable" if trainable != total else ""))
    if trainable == total:
        return f"{total / 1e6:.2f}M parameters"
    qlora = lora.quantized_note(run.model, run.cfg.lora, run.dist.device, run.plan.use_fsdp)  # QLoRA's backend
    return (f"{total / 1e6:.2f}M parameters, {trainable:,} trainable ({100 * trainable / total:.2f}%)"
            + (f"; {qlora}" if qlora else ""))


def run_header(run: Run) -> str:
    """Three lines: where and how the run trains, the model and data, the steps and batch; a fourth names the
    fine-tuning defaults in effect (a pretrained model.name), and under FSDP2 one more its units."""
    cfg, d, pl = run.cfg, run.dist, run.plan
    if pl.use_fsdp:
        where = (f"{d.info.launcher} launch: {d.world_size} rank(s) on {d.info.num_nodes} node(s), "
                 f"FSDP2 {cfg.parallel.sharding}, mesh {pl.mesh_shape}"
                 + (f" x tensor {pl.tensor}" if pl.tensor > 1 else "")
                 + (", reduce-scatter by all-to-all or all-reduce"
                    if cpu_comms.applies(d.device.type, pl.mesh_shape) else "")
                 + (f", rows split by context: {d.context.describe()}" if d.context is not None else ""))
    elif d.device.type == "xla":
        where = f"1 process, XLA SPMD over {d.devices} device(s), FSDPv2 {cfg.parallel.sharding}"
    else:
        where = "1 process, no FSDP (launch with --nproc N or torchrun to shard)"
    ac = checkpointing.describe(cfg.parallel.activation_checkpointing, len(transformer_blocks(run.model.hf)))
    extras = [n for n, on in ((ac or "", ac is not None), (f"compile {pl.compile}", pl.compile != "false"),
                              ("cpu offload", cfg.parallel.cpu_offload)) if on]
    # the data and the steps, as the objective counts them: blocks of seq_len tokens, or prompts and completions
    data_line = objective_family(cfg.train.objective).data_line(cfg, run.train, run.val, run.total_steps,
                                                                 global_batch(run))
    return (f"shardlm: {where}; {d.device.type}, {cfg.parallel.precision}"
            + (f", {', '.join(extras)}" if extras else "") + "\n"
            f"model: {_params(run)}; {data_line}, out_dir {run.out_dir}"
            + "".join(f"\n{line}" for line in describe(run.train))
            + f"\n{describe_optimizer(run)}"
            + (f"\n{note}" if (note := task_defaults_note(cfg)) else "")
            + (f"\n{units}" if (units := describe_units(run.model, cfg.parallel.wrap)) else ""))


class Reporter:
    """One per `fit`: opened before the first step (prints the header), closed after the last (prints `done`)."""

    def __init__(self, run: Run, first_step: int, save_every: int):
        cfg, d = run.cfg, run.dist
        self.run, self.dist, self.device = run, d, d.device
        self.total, self.first_step, self.save_every = run.total_steps, first_step, save_every
        self.tokens_per_step = global_batch(run) * cfg.data.seq_len
        self.flops_per_token, self.peak_flops = model_flops_per_token(run), peak_flops(d.device)
        self.causal_share = model_flops_per_token(run, causal=True) / self.flops_per_token  # llm.c's MFU / ours
        self.log = MetricsLog(run.out_dir, cfg.log.tensorboard, d.is_main, cfg=cfg, first_step=first_step)
        if (router_stats := getattr(run.model, "router_stats", None)) is not None:
            router_stats.zero_()  # a model built on meta has it uninitialized
        d.print(run_header(run))
        if self.log.note:
            d.print(self.log.note)
        self.progress = Progress(self.total, cfg.log.progress, d.is_main, initial=first_step)
        self.eta, self.timer, self.began = Eta(self.total), StepTimer(), time.time()
        self.loss_sum = torch.zeros(1, device=d.device, dtype=torch.float64)  # this rank's, since the last record
        self.seconds, self.steps, self.targets = 0.0, 0, 0
        self.objective = objective_family(cfg.train.objective)  # what its records and validation lines hold
        self.stats: torch.Tensor | None = None  # the objective's statistic sums since the last record
        self.rl: dict[str, list[float]] = {}  # each global statistic's values since the last record (online RL)
        self.last_val: dict[str, Any] | None = None
        self.held_out = 0

    def step_done(self, loss_sum: torch.Tensor, targets: int | None = None,
                  stats: torch.Tensor | dict[str, float] | None = None) -> None:
        """After each optimizer step: its time (since the last step or `resume_clock`), its loss and the step's
        global target count (text: every token; preference: pairs; online RL: 1, its loss being the step's), and a
        preference step's statistic sums or an RL step's statistics (global values)."""
        self.loss_sum += loss_sum.double()
        if isinstance(stats, dict):
            for k, v in stats.items():
                self.rl.setdefault(k, []).append(v)
        elif stats is not None:
            self.stats = stats.double() if self.stats is None else self.stats + stats.double()
        self.targets += self.tokens_per_step if targets is None else targets
        seconds = self.timer.lap()
        self.eta.add_step(seconds)
        self.seconds, self.steps = self.seconds + seconds, self.steps + 1

    def resume_clock(self) -> None:
        """Evaluation and saving are timed on their own (`timed`): the next step's time starts here."""
        self.timer.lap()

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        """Time an evaluation (`eval`) or a save (`save`) for the ETA."""
        began = time.perf_counter()
        yield
        (self.eta.add_eval if what == "eval" else self.eta.add_save)(time.perf_counter() - began)

    def _left(self, step: int, every: int) -> int:
        return (self.total - step) // every if every else 0

    def log_train(self, step: int, *, lr: float, grad_norm: float, tokens: int, skipped_steps: int,
                  tokens_by_source: list[int] | None = None, samples: Iterable[str] = ()) -> None:
        """The interval's record (one all-reduce of the loss) and the progress line; starts a new interval.
        A mixture's record also has `tokens_by_source`, the tokens seen from each source (they add up to `tokens`);
        online RL's `samples` (a few completions and their rewards) are printed after it."""
        self.dist.all_reduce_sum(self.loss_sum)
        loss = (self.loss_sum[0] / max(self.targets, 1)).item()
        pref = {}
        if self.stats is not None:  # per pair, over every rank: rewards/chosen, ...
            sums = self.dist.all_reduce_sum(self.stats) / max(self.targets, 1)
            pref = dict(zip(self.objective.stats, sums.tolist(), strict=True))
            self.stats = None
        target_fraction = self.targets / (self.steps * self.tokens_per_step)
        tps = self.tokens_per_step * self.steps / max(self.seconds, 1e-9)
        chips = self.dist.data_parallel * self.dist.context_size * self.dist.tensor  # a split row runs on all its chips
        mfu = self.flops_per_token * tps / (self.peak_flops * chips) if self.peak_flops else None
        if self.objective.sampled:  # the rates of what was sampled and trained
            pref, target_fraction, mfu = self._rl_record(), 1.0, None
            tps = pref.pop("tokens_per_s")
        elif self.rl:  # statistics the objective gave reduced over every rank (kto): their means over the steps
            values, self.rl = self.rl, {}
            pref = {k: float(np.nanmean(v)) if not np.isnan(v).all() else math.nan for k, v in values.items()}
        peak_mem = peak_memory_bytes(self.device)
        self.log.write({"step": step, "split": "train", "loss": loss, "lr": lr, "grad_norm": grad_norm,
                        "tokens": tokens, "tokens_per_s": tps, "mfu": mfu,
                        "mfu_causal": mfu * self.causal_share if mfu is not None else None,
                        **router_record(self.run.model, self.dist.all_reduce_sum),
                        "peak_mem_gb": peak_mem / 1e9, "device": self.device.type,
                        "skipped_steps": skipped_steps, "time_s": time.time() - self.began,
                        **({"target_fraction": target_fraction} if target_fraction < 1 and not pref else {}), **pref,
                        **gpu_utilization(self.device),
                        **({"xla_compilations": xla.compilations()} if self.device.type == "xla" else {}),
                        **({"tokens_by_source": tokens_by_source} if tokens_by_source is not None else {})})
        evals_left = self._left(step, self.run.cfg.train.eval_every) + 1  # + the final one
        remaining = self.eta.remaining(step, evals_left, self._left(step, self.save_every))
        rl = {"reward": f"{pref['reward']:.3f}"} if "reward" in pref else {}  # online RL: the last round's
        self.progress.update(step, {"loss": f"{loss:.4f}", **rl, "tok/s": f"{tps:,.0f}", "eta": fmt_time(remaining)}
                             | ({"mem": f"{peak_mem / 2**30:.1f}G"} if self.device.type == "cuda" else {}))
        for line in samples:
            self.progress.write(line)
        self.loss_sum.zero_()
        self.seconds, self.steps, self.targets = 0.0, 0, 0

    def _rl_record(self) -> dict[str, float]:
        """An RL interval's statistics: each one's mean over the steps that gave it (generation metrics come with
        the steps that sampled), completions per second and tokens (prompt + completion sampled) per second."""
        values, self.rl = self.rl, {}
        completions, tokens = sum(values.pop("step_completions", [])), sum(values.pop("step_tokens", []))
        out = {k: sum(v) / len(v) for k, v in values.items()}
        seconds = max(self.seconds, 1e-9)
        return out | {"completions_per_s": completions / seconds, "tokens_per_s": tokens / seconds}

    def log_val(self, step: int, result: dict[str, Any], tokens_seen: int) -> None:
        """The record keeps `held_out_tokens` next to `tokens` (those scored), so a subset shows as one."""
        held_out = getattr(self.run.val, "target_tokens", len(self.run.val))  # online RL: prompts
        self.log.write({"step": step, "split": "val", **result, "held_out_tokens": held_out,
                        "tokens_seen": tokens_seen})
        self.progress.write(f"step {step}: val {self.describe(result, held_out)}")
        self.last_val, self.held_out = result, held_out

    def describe(self, result: dict[str, Any], held_out: int) -> str:
        """A validation result in words, as the objective says it (online RL: the mean sampled reward and the
        greedy exact match)."""
        return self.objective.describe_val(self.run.cfg, result, held_out)

    def close(self, step: int, stopped: bool) -> dict[str, Any]:
        """Close the outputs; print the closing line unless the run stopped on a signal (train.py says so)."""
        self.progress.close()
        self.log.close()
        wall = time.time() - self.began
        if not stopped:
            n, start = step - self.first_step, self.first_step
            this = f"{n} step{'s' * (n != 1)} in {fmt_time(wall)}"
            self.dist.print(f"done: {this}" if not start else f"done: step {step}/{self.total}; this invocation: "
                            f"{this} (resumed at step {start})", end="")
            v = self.last_val
            self.dist.print(f", val {self.describe(v, self.held_out)}" if v else "")
        return {"val": self.last_val, "steps": step, "wall_s": wall}

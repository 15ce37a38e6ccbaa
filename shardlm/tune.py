"""`shardlm tune CONFIG`: for each FSDP setting that matters, the largest micro-batch that fits and its
tokens/s; prints a table and writes the fastest setting as a YAML override file for `shardlm train`.

Batch search: doubling, then bisection. A batch fits when a training step runs without running out of
memory and its peak (torch.cuda.max_memory_allocated on GPU, the measured step peak on CPU) is within the
budget. Trials run in this process (under torchrun: on every rank, in lockstep, agreeing on the outcome);
memory is freed between them.
"""

from __future__ import annotations

import gc
import itertools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from shardlm import ShardlmError
from shardlm.config import Config, build_config, to_flat_dict

GB = 2**30


@dataclass
class Point:
    setting: dict[str, object]
    max_batch: int = 0
    tokens_per_s: float = 0.0
    peak_gb: float = 0.0


def settings_grid(cfg: Config, world_size: int, on_gpu: bool) -> list[dict[str, object]]:
    shardings = [cfg.parallel.sharding] if world_size == 1 else ["full", "grad_op", "no_shard"]
    precisions = sorted({cfg.parallel.precision, "bf16"}) if on_gpu else [cfg.parallel.precision]
    offload = [False, True] if on_gpu else [False]  # offload trades speed for memory only where there is a GPU
    chunk = cfg.train.loss_chunk_size or 1024  # null (auto) and 0 both try 1024 against 0
    grid = []
    for sharding, ac, chunked, precision, off in itertools.product(shardings, [False, True], [0, chunk], precisions,
                                                                   offload):
        grid.append({"parallel.sharding": sharding, "parallel.activation_checkpointing": ac,
                     "train.loss_chunk_size": chunked, "parallel.precision": precision, "parallel.cpu_offload": off})
    return grid


def _with(cfg: Config, setting: dict[str, object], batch: int) -> Config:
    flat = to_flat_dict(cfg)
    flat.update(setting)
    flat.update({"train.batch_size": batch, "train.grad_accum": 1, "train.max_steps": 10 ** 6,
                 "checkpoint.resume": "none", "checkpoint.save_final": False, "log.tensorboard": False,
                 "train.sample_tokens": 0,
                 # compiling every trial (one graph per batch size) would take minutes per setting; compiled
                 # training is faster than these eager trials and needs no more memory (measured on an H100)
                 "parallel.compile": "false"})
    return build_config(flat)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_trial(cfg: Config, steps: int, budget: float | None) -> tuple[bool, float, float]:
    """(fits, peak GiB, tokens/s) for one config; out-of-memory counts as not fitting."""
    from shardlm.build import build
    from shardlm.estimate import measure_step_peak
    from shardlm.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(build(cfg))
        trainer.train_step()
        peak = measure_step_peak(trainer)
        began = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        tps = steps * trainer.global_batch * trainer.seq_len / (time.perf_counter() - began)
        ok = budget is None or peak <= budget
        result = (ok, peak / GB, tps)
    except torch.OutOfMemoryError:
        result = (False, float("nan"), 0.0)
    finally:
        del trainer
        _free()
    flag = torch.tensor([1.0 if result[0] else 0.0])
    if torch.distributed.is_initialized():  # every rank must agree, or the next trial's collectives mismatch
        flag = flag.to("cuda" if torch.cuda.is_available() else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item()), result[1], result[2]


def search(cfg: Config, setting: dict, budget: float | None, steps: int, max_batch: int, log) -> Point:
    point, lo, hi, batch = Point(setting), 0, None, 1
    measured: dict[int, tuple[float, float]] = {}
    while hi is None:
        ok, peak, tps = run_trial(_with(cfg, setting, batch), steps, budget)
        log(f"  batch {batch:>4}: {'fits' if ok else 'too big'} (peak {peak:.2f} GiB)")
        if ok:
            measured[batch] = (peak, tps)
            lo, batch = batch, batch * 2
            if batch > max_batch:
                hi = max_batch + 1
        else:
            hi = batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, peak, tps = run_trial(_with(cfg, setting, mid), steps, budget)
        log(f"  batch {mid:>4}: {'fits' if ok else 'too big'} (peak {peak:.2f} GiB)")
        if ok:
            measured[mid] = (peak, tps)
        lo, hi = (mid, hi) if ok else (lo, mid)
    if lo:
        point.max_batch, (point.peak_gb, point.tokens_per_s) = lo, measured[lo]
    return point


def tune(cfg: Config, budget_gb: float | None, steps: int = 3, max_batch: int = 256, dist=None) -> list[Point]:
    from shardlm.dist import detect_launch

    on_gpu = torch.cuda.is_available() and cfg.parallel.device != "cpu"
    if budget_gb is None and not on_gpu:
        raise ShardlmError("on CPU, give a memory budget: shardlm tune CONFIG --budget-gb 8")
    info = detect_launch(launcher=cfg.parallel.launcher)
    budget = budget_gb * GB if budget_gb else None
    log = print if info.rank == 0 else (lambda *_: None)
    points = []
    with tempfile.TemporaryDirectory(prefix="shardlm-tune-") as scratch:
        cfg = build_config({**to_flat_dict(cfg), "out_dir": scratch})  # trials never write into a run's out_dir
        for setting in settings_grid(cfg, info.world_size, on_gpu):
            log(" ".join(f"{k.split('.')[-1]}={v}" for k, v in setting.items()))
            points.append(search(cfg, setting, budget, steps, max_batch, log))
    return points


def report(points: list[Point], out: Path) -> str:
    header = (f"{'sharding':<9} {'AC':<5} {'chunk':>5} {'prec':<5} {'offload':<7} {'max batch':>9} "
              f"{'tokens/s':>9} {'peak GiB':>8}")
    rows = [header, "-" * len(header)]
    for p in sorted(points, key=lambda p: -p.tokens_per_s):
        s = p.setting
        rows.append(f"{s['parallel.sharding']!s:<9} {str(s['parallel.activation_checkpointing']):<5} "
                    f"{s['train.loss_chunk_size']!s:>5} {s['parallel.precision']!s:<5} "
                    f"{str(s['parallel.cpu_offload']):<7} {p.max_batch:>9} {p.tokens_per_s:>9.0f} {p.peak_gb:>8.2f}")
    feasible = [p for p in points if p.max_batch > 0]
    if not feasible:
        raise ShardlmError("no setting fits even micro-batch 1 in the budget: raise --budget-gb, shorten "
                           "data.seq_len or use more ranks.")
    best = max(feasible, key=lambda p: p.tokens_per_s)
    tree: dict[str, dict] = {}
    for key, value in {**best.setting, "train.batch_size": best.max_batch}.items():
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# shardlm tune: fastest setting, {best.tokens_per_s:.0f} tokens/s, peak {best.peak_gb:.2f} GiB\n"
                   + yaml.safe_dump(tree, sort_keys=False))
    rows.append(f"\ntokens/s measured eager (trials do not compile); best: {best.tokens_per_s:.0f} tokens/s at "
                f"micro-batch {best.max_batch}; written to {out}\n"
                f"use it: shardlm train CONFIG {out}")
    return "\n".join(rows)


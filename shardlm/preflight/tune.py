"""`shardlm tune CONFIG`: for each FSDP setting that matters, the largest micro-batch that fits a memory budget,
the micro-batch x grad_accum that trains CONFIG's batch with it, and that split's tokens/s and peak; prints a table
and writes the fastest setting as a YAML override file for `shardlm train CONFIG tuned.yaml`.

Each FSDP setting is tried without activation checkpointing first, then with selective, full and (on a GPU)
offload in turn while the one before cannot train the per-rank batch as one micro-batch (`ac_ladder`).

Tune keeps the global batch of CONFIG (ranks x train.batch_size x train.grad_accum blocks per optimizer step).
Changing it changes the optimization, not only the speed: at the same lr and tokens, a larger batch means fewer,
larger steps (Tiny Shakespeare: 490 steps x 32 blocks reach val loss 1.84, 61 x 256 only 2.51). So the per-rank
batch B = batch_size x grad_accum stays; tune only splits it: micro-batch b = the largest divisor of B that fits,
grad_accum = B / b. The search never goes above B (nor above --max-batch); a search that reaches that cap is
marked "(cap)": it fits at least that micro-batch, and perhaps a larger one.

Batch search (`largest_fit`, shared with benchmarks/max_batch.py): doubling, then bisection, one micro-batch per
trial. A batch fits when a training step runs without running out of memory and its peak
(torch.cuda.max_memory_allocated on GPU, the measured step peak on CPU) is within the budget. Tokens/s and peak are
then measured at b x grad_accum itself: gradients kept between micro-batches (unsharded under FSDP until the last
one syncs) can need more memory than a step of one. Trials run in this process (under torchrun: on every rank, in
lockstep, agreeing on the outcome); memory is freed between them.
"""

from __future__ import annotations

import gc
import itertools
import math
import tempfile
import time
from collections.abc import Callable
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
    max_batch: int = 0  # largest micro-batch that fits, searched up to `cap`; 0 = not even 1
    tokens_per_s: float = 0.0  # measured at micro_batch x grad_accum
    peak_gb: float = 0.0  # measured at micro_batch x grad_accum
    micro_batch: int = 0  # the largest divisor of per_rank_batch that fits; 0 = none
    per_rank_batch: int = 0  # train.batch_size x train.grad_accum of the user's config
    cap: int = 0  # the search goes no higher: min(per_rank_batch, --max-batch)
    world_size: int = 1
    context: int = 1  # parallel.context: ranks that split each row (they share one micro-batch)
    tensor: int = 1  # parallel.tensor of the setting: its ranks share one micro-batch too

    @property
    def grad_accum(self) -> int:
        return self.per_rank_batch // self.micro_batch if self.micro_batch else 0

    @property
    def capped(self) -> bool:
        """The search reached its cap: a larger micro-batch may fit too."""
        return self.max_batch >= self.cap > 0


def settings_grid(cfg: Config, world_size: int, on_gpu: bool) -> list[dict[str, object]]:
    shardings = [cfg.parallel.sharding] if world_size == 1 else ["full", "grad_op", "no_shard"]
    precisions = sorted({cfg.parallel.precision, "bf16"}) if on_gpu else [cfg.parallel.precision]
    offload = [False, True] if on_gpu else [False]  # offload trades speed for memory only where there is a GPU
    chunk = cfg.train.loss_chunk_size or 1024  # null (auto) and 0 both try 1024 against 0
    grid = []
    for sharding, chunked, precision, off in itertools.product(shardings, [0, chunk], precisions, offload):
        grid.append({"parallel.sharding": sharding, "parallel.activation_checkpointing": "none",
                     "train.loss_chunk_size": chunked, "parallel.precision": precision, "parallel.cpu_offload": off})
    return grid


def ac_ladder(on_gpu: bool) -> list[str]:
    """Activation checkpointing modes in the order tune tries them on a setting, each while the one before cannot
    train the per-rank batch as one micro-batch: recomputing (or moving) activations costs time, so a setting
    that fits without it is not tried with it. Offload moves them over PCIe: a GPU's only."""
    return ["none", "selective", "full", *(["offload"] if on_gpu else [])]


def _with(cfg: Config, setting: dict[str, object], batch: int, accum: int = 1) -> Config:
    flat = to_flat_dict(cfg)
    flat.update(setting)
    flat.update({"train.batch_size": batch, "train.grad_accum": accum, "train.max_steps": 10 ** 6,
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
    from shardlm.observe.hardware import measure_step_peak
    from shardlm.training.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer.from_config(cfg)
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


Trials = dict[int, tuple[bool, float]]  # batch -> (fits, peak)


def largest_fit(trial: Callable[[int], tuple[bool, float]], cap: int, start: int = 1,
                budget: float | None = None) -> tuple[int, Trials]:
    """The largest batch <= cap that fits (0: not even 1), and every trial's (fits, peak).

    Doubling from `start`, then bisection. With a `budget` (in the unit of the peaks), once two batches fit the
    next trial is where the straight line through their peaks meets it (peak memory grows linearly with the
    batch): start, 2 x start, the line's answer and one more settle a linear case (benchmarks/max_batch.py)."""
    trials: Trials = {}
    lo, hi, batch = 0, cap + 1, max(1, min(start, cap))
    while hi - lo > 1:
        trials[batch] = trial(batch)
        lo, hi = (batch, hi) if trials[batch][0] else (lo, batch)
        batch = next_batch(trials, lo, hi, cap, budget)
    return lo, trials


def next_batch(trials: Trials, lo: int, hi: int, cap: int, budget: float | None) -> int:
    """The next batch to try, strictly between lo (the largest that fits) and hi (the smallest that does not):
    where the line through the peaks of the two largest fits meets the budget (lo + 1 if that is lo, to
    confirm); doubling or bisection without a budget, while there is no line yet, or where a batch that did not
    fit contradicts it."""
    fitted, guess = sorted(b for b, (ok, _) in trials.items() if ok), None
    if budget is not None and len(fitted) >= 2:
        (b1, p1), (b2, p2) = ((b, trials[b][1]) for b in fitted[-2:])
        guess = b2 + math.floor((budget - p2) * (b2 - b1) / (p2 - p1)) if p2 > p1 else None
    if guess is None or (guess >= hi and hi <= cap):
        guess = 2 * lo if hi > cap else (lo + hi) // 2
    return max(lo + 1, min(hi - 1, guess))


def divisors_down(n: int, most: int) -> list[int]:
    """Divisors of n that are <= most, largest first."""
    return [d for d in range(min(n, most), 0, -1) if n % d == 0]


def search(cfg: Config, setting: dict, budget: float | None, steps: int, max_batch: int, world_size: int,
           log) -> Point:
    # a tensor-parallel setting's N ranks read one data index's rows: N times the rows each, the same global batch
    tensor = int(setting.get("parallel.tensor", cfg.parallel.tensor))
    per_rank = cfg.train.batch_size * cfg.train.grad_accum * tensor // cfg.parallel.tensor
    point = Point(setting, per_rank_batch=per_rank, cap=min(max_batch, per_rank), world_size=world_size,
                  context=cfg.parallel.context, tensor=tensor)
    measured: dict[tuple[int, int], tuple[float, float]] = {}

    def fits(batch: int, accum: int = 1) -> tuple[bool, float]:
        ok, peak, tps = run_trial(_with(cfg, setting, batch, accum), steps, budget)
        accumulated = f" x grad_accum {accum}" if accum > 1 else ""
        log(f"  batch {batch:>4}{accumulated}: {'fits' if ok else 'too big'} (peak {peak:.2f} GiB)")
        if ok:
            measured[batch, accum] = (peak, tps)
        return ok, peak

    point.max_batch, _ = largest_fit(fits, point.cap)
    for b in divisors_down(per_rank, point.max_batch):
        if (b, per_rank // b) in measured or fits(b, per_rank // b)[0]:
            point.micro_batch, (point.peak_gb, point.tokens_per_s) = b, measured[b, per_rank // b]
            break
    return point


def tune(cfg: Config, budget_gb: float | None, steps: int = 3, max_batch: int = 256) -> list[Point]:
    from shardlm.distributed.process_group import detect_launch

    on_gpu = torch.cuda.is_available() and cfg.parallel.device != "cpu"
    if budget_gb is None and not on_gpu:
        raise ShardlmError("on CPU, give a memory budget: shardlm tune CONFIG --budget-gb 8")
    info = detect_launch(launcher=cfg.parallel.launcher)
    budget = budget_gb * GB if budget_gb else None
    log = print if info.rank == 0 else (lambda *_: None)
    t = cfg.train
    per_rank = t.batch_size * t.grad_accum
    log(f"per-rank batch kept: train.batch_size {t.batch_size} x train.grad_accum {t.grad_accum} = {per_rank} "
        f"blocks; micro-batches searched up to {min(max_batch, per_rank)}")
    points = []
    with tempfile.TemporaryDirectory(prefix="shardlm-tune-") as scratch:
        cfg = build_config({**to_flat_dict(cfg), "out_dir": scratch})  # trials never write into a run's out_dir
        for base in settings_grid(cfg, info.world_size, on_gpu):
            points += climb(cfg, base, budget, steps, max_batch, info.world_size, on_gpu, log)
        if not any(p.micro_batch == p.per_rank_batch for p in points):  # memory demands more: split the blocks
            points += split_blocks(cfg, budget, steps, max_batch, info.world_size, on_gpu, log)
    return points


def tensor_degrees(cfg: Config, world_size: int) -> list[int]:
    """The parallel.tensor values tune tries when no setting fits the per-rank batch whole: 2, 4, 8 where they
    divide the ranks (with parallel.context), and only for a config that does not split its blocks already."""
    if cfg.parallel.tensor != 1:
        return []
    return [n for n in (2, 4, 8) if world_size % (n * cfg.parallel.context) == 0]


def split_blocks(cfg: Config, budget: float | None, steps: int, max_batch: int, world_size: int, on_gpu: bool,
                 log) -> list[Point]:
    """`full` sharding with each tensor degree, up the activation checkpointing ladder as above. A degree the
    model or config cannot take (its family, its heads) is skipped with its one-line reason."""
    points: list[Point] = []
    for n in tensor_degrees(cfg, world_size):
        base = {**settings_grid(cfg, 1, on_gpu)[0], "parallel.sharding": "full", "parallel.tensor": n}
        try:
            points += climb(cfg, base, budget, steps, max_batch, world_size, on_gpu, log)
        except ShardlmError as e:
            log(f"  parallel.tensor={n} skipped: {e}")
    return points


def climb(cfg: Config, base: dict[str, object], budget: float | None, steps: int, max_batch: int, world_size: int,
          on_gpu: bool, log) -> list[Point]:
    """`base` up the activation checkpointing ladder, a search each, until one trains the per-rank batch as one
    micro-batch."""
    points: list[Point] = []
    for ac in ac_ladder(on_gpu):
        setting = {**base, "parallel.activation_checkpointing": ac}
        log(" ".join(f"{k.split('.')[-1]}={v}" for k, v in setting.items()))
        points.append(search(cfg, setting, budget, steps, max_batch, world_size, log))
        if points[-1].micro_batch == points[-1].per_rank_batch:  # the whole per-rank batch in one micro-batch
            break
    return points


def _row(p: Point) -> str:
    s = p.setting
    fit = f">={p.max_batch} (cap)" if p.capped else str(p.max_batch or "none")
    chosen = f"{p.micro_batch} x {p.grad_accum}" if p.micro_batch else "-"
    sharding = f"{s['parallel.sharding']}" + (f"+tp{p.tensor}" if p.tensor > 1 else "")
    return (f"{sharding:<9} {str(s['parallel.activation_checkpointing']):<9} "
            f"{s['train.loss_chunk_size']!s:>5} {s['parallel.precision']!s:<5} {str(s['parallel.cpu_offload']):<7} "
            f"{fit:>12} {chosen:>13} {p.tokens_per_s:>9.0f} {p.peak_gb:>8.2f}")


def _notes(p: Point) -> list[str]:
    stop = f"the per-rank batch ({p.per_rank_batch})" if p.cap == p.per_rank_batch else \
        f"--max-batch ({p.cap}), below the per-rank batch ({p.per_rank_batch})"
    return [f"max micro: the largest micro-batch that fits the budget; >=N (cap): fits at least N, the search "
            f"stopped at {stop}",
            f"micro x accum: train.batch_size x train.grad_accum; micro = the largest divisor of "
            f"{p.per_rank_batch} that fits, so the product stays {p.per_rank_batch}",
            "tokens/s, peak GiB: measured at that micro x accum, eager (trials do not compile)"]


def _write(best: Point, out: Path) -> None:
    tree: dict[str, dict] = {}
    for key, value in {**best.setting, "train.batch_size": best.micro_batch,
                       "train.grad_accum": best.grad_accum}.items():
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# shardlm tune: fastest setting, {best.tokens_per_s:.0f} tokens/s, peak {best.peak_gb:.2f} GiB;"
                   f" batch_size x grad_accum = {best.per_rank_batch} blocks per rank, as in the config tuned\n"
                   + yaml.safe_dump(tree, sort_keys=False))


def report(points: list[Point], out: Path) -> str:
    feasible = [p for p in points if p.micro_batch > 0]
    if not feasible:
        raise ShardlmError(f"no setting trains the per-rank batch ({points[0].per_rank_batch} blocks) within the "
                           "budget, even as micro-batches of 1: raise --budget-gb, shorten data.seq_len or use "
                           "more ranks.")
    first = points[0]
    world, per_rank = first.world_size // first.context, first.per_rank_batch  # data indices: a row each
    header = (f"{'sharding':<9} {'AC':<9} {'chunk':>5} {'prec':<5} {'offload':<7} {'max micro':>12} "
              f"{'micro x accum':>13} {'tokens/s':>9} {'peak GiB':>8}")
    split = f" (each row split over parallel.context={first.context} ranks)" if first.context > 1 else ""
    rows = [f"global batch kept: {world} rank{'s' * (world != 1)}{split} x {per_rank} blocks = {world * per_rank} "
            "blocks per optimizer step (as in your config)", "", header, "-" * len(header)]
    rows += [_row(p) for p in sorted(points, key=lambda p: -p.tokens_per_s)]
    best = max(feasible, key=lambda p: p.tokens_per_s)
    _write(best, out)
    rows += ["", *_notes(first),
             *(["+tpN: each block split over N ranks (parallel.tensor=N), which read the same rows: N times the "
                "blocks per rank, the same global batch"] if any(p.tensor > 1 for p in points) else []),
             f"best: {best.tokens_per_s:.0f} tokens/s at micro-batch {best.micro_batch} x grad_accum "
             f"{best.grad_accum}; written to {out}", f"use it: shardlm train CONFIG {out}"]
    return "\n".join(rows)

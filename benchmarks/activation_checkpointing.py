"""Activation checkpointing's modes side by side on CPU: the activations each keeps, the step's peak and its time.

    python benchmarks/activation_checkpointing.py                     # 6 x 384 GPT-2 (30M), seq 512, batch 2, fp32
    python benchmarks/activation_checkpointing.py --size 124M --seq 1024 --batch 2 --modes none,selective

For each mode of `parallel.activation_checkpointing` a fresh process builds the same run (GPT-2 BPE, from scratch,
no dropout, eager) and measures, after one step (the optimizer state exists):
- kept for backward: the growth of the resident set across one forward (large blocks mmapped, so freed memory
  leaves it): what the mode keeps until the backward, the loss's chunk buffers included; and the blocks'
  activations, its growth from the first block's input to the last block's output (what the modes differ in);
- step peak: shardlm.observe.hardware.measure_step_peak (what `shardlm tune` measures on CPU): resident parameters
  and optimizer state plus the peak growth of the resident set during one step;
- step time: the median over `--steps` steps, wall clock and the process's CPU seconds. On one thread (`--threads`,
  the default 1) the CPU seconds are the work done, with no OpenMP spin-waits, and move far less with other
  processes' load on a shared machine than the wall clock does.
The modes run in turn, `--repeats` times over (the medians of each repeat's median are reported), so a change in
the machine's load falls on every mode alike. `offload` on a CPU run keeps the activations where they are: its row
shows the wrapper's cost, nothing saved (docs/gpus.md lists the GPU measurements to make).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time

from common import BENCH, DATA_HELP, DEFAULT_DATA, cpu_name, gpt2_overrides

MODES = ["none", "full", "every:2", "selective", "offload"]
GB = 2**30


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def kept_for_backward(trainer) -> tuple[int, int]:
    """Bytes one forward leaves resident for its backward (then dropped without a backward): in all, and from the
    first block's input to the last block's output (the blocks' activations, what the modes differ in)."""
    import ctypes
    import gc

    from shardlm.models.causal_lm import transformer_blocks

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large blocks mmapped, returned to the OS when freed
    blocks = transformer_blocks(trainer.model.hf)
    marks: list[int] = []
    hooks = [blocks[0].register_forward_pre_hook(lambda *_: marks.append(_rss_kb())),
             blocks[-1].register_forward_hook(lambda *_: marks.append(_rss_kb()))]
    batch = trainer.train_batch(0)
    gc.collect()
    libc.malloc_trim(0)
    before = _rss_kb()
    loss_sum, _ = trainer.model(batch.inputs, batch.targets, batch.positions)
    kept = (_rss_kb() - before) * 1024
    del loss_sum
    for hook in hooks:
        hook.remove()
    return kept, (marks[1] - marks[0]) * 1024


def one(args) -> dict:
    """One mode, in this process: the measurements as a dict."""
    import torch

    torch.set_num_threads(args.threads)
    from shardlm.config import load_config
    from shardlm.observe.hardware import measure_step_peak
    from shardlm.training.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="shardlm-ac-") as out:
        extra = [f"parallel.activation_checkpointing={args.one}", "parallel.compile=false", "model.dropout=0.0",
                 "train.sample_tokens=0", "train.eval_every=0", "train.log_every=1000", "log.progress=none",
                 "checkpoint.save_final=false", "checkpoint.resume=none", f"out_dir={out}"]
        cfg = load_config(None, gpt2_overrides(args.size, args.seq, args.batch, "fp32", args.data, extra))
        trainer = Trainer.from_config(cfg)
        trainer.train_step()
        kept, blocks_kept = kept_for_backward(trainer)
        peak = measure_step_peak(trainer)
        walls, cpus = [], []
        for _ in range(args.steps):
            wall, cpu = time.perf_counter(), time.process_time()
            trainer.train_step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        trainer.close()
    return {"mode": args.one, "kept_for_backward_gb": kept / GB, "blocks_kept_gb": blocks_kept / GB,
            "step_peak_gb": peak / GB,
            "step_s": statistics.median(walls), "step_cpu_s": statistics.median(cpus),
            "threads": torch.get_num_threads()}


def run_mode(args, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--one", mode, "--size", args.size, "--seq", str(args.seq), "--batch",
           str(args.batch), "--steps", str(args.steps), "--data", args.data, "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        rows.append({"mode": mode, **{k: statistics.median(r[k] for r in mine)
                                      for k in ("kept_for_backward_gb", "blocks_kept_gb", "step_peak_gb", "step_s",
                                                "step_cpu_s")}})
    base = rows[0]
    for row in rows:
        row["kept_vs_" + base["mode"]] = row["kept_for_backward_gb"] / base["kept_for_backward_gb"]
        row["blocks_vs_" + base["mode"]] = row["blocks_kept_gb"] / base["blocks_kept_gb"]
        row["time_vs_" + base["mode"]] = row["step_s"] / base["step_s"]
        row["cpu_vs_" + base["mode"]] = row["step_cpu_s"] / base["step_cpu_s"]
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]["mode"]
    lines = [f"| mode | blocks' activations GiB | x {base} | kept for backward GiB | x {base} | step peak GiB | "
             f"step s (wall) | x {base} | step CPU s | x {base} |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['blocks_kept_gb']:.3f} | {r['blocks_vs_' + base]:.2f} | "
                     f"{r['kept_for_backward_gb']:.3f} | {r['kept_vs_' + base]:.2f} | "
                     f"{r['step_peak_gb']:.3f} | {r['step_s']:.2f} | {r['time_vs_' + base]:.2f} | "
                     f"{r['step_cpu_s']:.2f} | {r['cpu_vs_' + base]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="6x6x384", help="GPT-2 size: 124M, 350M, ... or LAYERSxHEADSxWIDTH")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per process")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each measured process")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the modes (medians reported)")
    ap.add_argument("--modes", default=",".join(MODES), help="the first is the baseline of the ratios")
    ap.add_argument("--data", default=DEFAULT_DATA, help=DATA_HELP)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run one mode in this process, print its JSON
    ap.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/ac_cpu_DATE.json)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    modes = args.modes.split(",")
    runs = []
    for repeat in range(args.repeats):
        for mode in modes:
            runs.append(run_mode(args, mode))
            print(f"round {repeat + 1}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    rows = summarize(runs)
    print(table(rows))
    out = args.out or BENCH / "results" / f"ac_cpu_{datetime.date.today()}.json"
    with open(out, "w") as f:
        json.dump({"settings": {"size": args.size, "seq": args.seq, "batch": args.batch, "precision": "fp32",
                                "steps": args.steps, "repeats": args.repeats, "data": args.data, "cpu": cpu_name(),
                                "compile": False, "threads": args.threads},
                   "rows": rows, "runs": runs}, f, indent=1)
    print(f"written: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""FSDP2's per-step host cost, measured: the step time of a tiny 12-block GPT on CPU without FSDP, under FSDP2 on
one rank (full, grad_op) and on 2 ranks, and torch.profiler's FSDP2 phases (its `FSDP::` record_function ranges:
all-gather, copy-out, pre/post forward and backward, reduce, reshard) and the optimizer step in ms per step.
Prints one JSON object.

    python benchmarks/fsdp_host.py [--steps 160] [--from 20] [--repeats 3] [--out FILE] [key=value ...]

The model is the one of benchmarks/results/fsdp_host_overhead_cpu_2026-11-26.json (12 x 64 wide, 2 heads, byte
vocabulary, seq 64, batch 4, fp32, eager), so its tiny compute leaves the host cost in plain view. Step times are
from metrics.jsonl (`time_s` between the records of steps --from and --steps); the phases from a profiler started
by a callback of this file (`Profile`) for the 20 steps after those, on rank 0. Ranges nest (an all-gather inside a
pre-forward): each phase is its own inclusive total, not a share of a sum.

Two ranks share this machine's cores, caches and memory: their rows are compared with two one-process runs side by
side (`no_fsdp_2procs`), and gloo's own collective time (its `gloo:` events) is taken out to leave the host cost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model.n_layer=12", "model.n_embd=64", "model.n_head=2", "data.seq_len=64", "model.n_positions=64",
         "train.batch_size=4", "train.eval_every=0", "train.sample_tokens=0", "train.log_every=20",
         "checkpoint.every=0", "log.tensorboard=false", "log.progress=none", "parallel.compile=false"]
VARIANTS = {  # name: (processes, torchrun, overrides); 2 processes without torchrun: two runs side by side
    "no_fsdp": (1, False, ["parallel.fsdp=false"]),
    "no_fsdp_2procs": (2, False, ["parallel.fsdp=false"]),
    "fsdp_full_1rank": (1, True, ["parallel.fsdp=true", "parallel.sharding=full"]),
    "fsdp_grad_op_1rank": (1, True, ["parallel.fsdp=true", "parallel.sharding=grad_op"]),
    "fsdp_full_2ranks": (2, True, ["parallel.fsdp=true", "parallel.sharding=full"]),
    # parallel.wrap=block, the default before 2026-11-29: a unit per block (auto makes these 12 blocks one unit)
    "fsdp_full_1rank_block": (1, True, ["parallel.fsdp=true", "parallel.sharding=full", "parallel.wrap=block"]),
    "fsdp_full_2ranks_block": (2, True, ["parallel.fsdp=true", "parallel.sharding=full", "parallel.wrap=block"]),
}
PROFILED = 20  # steps the profiler covers
NOTE = " ".join([
    "ms_per_step: the median of --repeats runs (ms_per_step_each), each from metrics.jsonl time_s (no_fsdp_2procs:",
    "two one-process runs at once, the mean; the 2-rank rows' x_no_fsdp and host_cost_ms are against it);",
    "host_cost_less_collectives_ms: host_cost_ms less the gloo collectives' own time (gloo:*, profiled; an estimate:",
    "a collective that overlapped other work is taken out whole); profiled_ms_per_step: torch.profiler's inclusive",
    "CPU time of each FSDP:: range (nested ranges overlap) and of Optimizer.step, per step, rank 0, 20 steps of the",
    "first run (profiling inflates them; compare phases, not their sum, to ms_per_step)"])


class Profile:
    """A shardlm callback: torch.profiler over steps (start, start + PROFILED] on rank 0, its ranges named FSDP::
    and the optimizer's summed per step (ms), written as JSON to `out`."""

    def __init__(self, start: int, out: str):
        self.start, self.out, self.prof = start, out, None

    def on_step_end(self, trainer, result) -> None:  # noqa: ARG002 - the event's signature
        import torch

        if not trainer.dist.is_main:
            return
        if trainer.step == self.start:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
        elif trainer.step == self.start + PROFILED and self.prof is not None:
            self.prof.__exit__(None, None, None)
            phases: dict[str, float] = {}
            for e in self.prof.events():
                name = re.sub(r" \(.*\)$| for .*$", "", e.name)  # the unit's name and the prefetch target go
                key = "Optimizer.step" if name.startswith("Optimizer.step") else \
                    "gloo:*" if name.startswith("gloo:") else name if name.startswith("FSDP::") else None
                if key:  # gloo:* are the collectives themselves, run by gloo's threads while a hook waits on them
                    phases[key] = phases.get(key, 0.0) + e.cpu_time_total / 1000 / PROFILED
            Path(self.out).write_text(json.dumps({k: round(v, 3) for k, v in sorted(phases.items())}) + "\n")


def step_ms(run: Path, first: int, last: int) -> float:
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r.get("split") == "train" and "time_s" in r}
    return round((records[last]["time_s"] - records[first]["time_s"]) / (last - first) * 1000, 2)


def measure(name: str, work: Path, args: argparse.Namespace) -> dict:
    from common import ROOT  # here: shardlm imports this file for its callback, without benchmarks/ on its path

    nproc, torchrun, overrides = VARIANTS[name]
    phases = work / f"{name}-phases.json"
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m", "shardlm"] \
        if torchrun else [sys.executable, "-m", "shardlm"]
    runs = [work / name] if torchrun else [work / f"{name}-{i}" for i in range(nproc)]  # side by side, no ranks

    def cmd(run: Path) -> list[str]:
        profiled = [f"--callback={Path(__file__).resolve()}:Profile({args.steps}, '{phases}')"] \
            if run == runs[0] else []  # after the timed steps
        return [*launch, "train", "shakespeare_tiny", *MODEL, f"train.max_steps={args.steps + PROFILED}",
                f"out_dir={run}", *overrides, *args.overrides, *profiled]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd(run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
             for run in runs]
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{out[-2000:]}\n{err[-3000:]}")
    return {"ms_per_step": round(sum(step_ms(run, args.start, args.steps) for run in runs) / len(runs), 2),
            "profiled_ms_per_step": json.loads(phases.read_text()) if phases.exists() else {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--from", dest="start", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=3, help="runs of each variant; ms_per_step is their median")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*", help="key=value for every variant")
    args = ap.parse_args()
    import torch
    from common import cpu_name, emit

    with tempfile.TemporaryDirectory(prefix="shardlm-fsdp-host-") as tmp:
        names, runs = args.variants.split(","), []
        for r in range(args.repeats):  # the variants in turn, so a slow spell of the machine falls on all of them
            (work := Path(tmp) / str(r)).mkdir()
            runs.append({name: measure(name, work, args) for name in names})
    rows = {}
    for name in names:
        times = sorted(run[name]["ms_per_step"] for run in runs)
        rows[name] = {"ms_per_step": statistics.median(times), "ms_per_step_each": times,
                      "profiled_ms_per_step": runs[0][name]["profiled_ms_per_step"]}
    for name, row in rows.items():  # 2 ranks against two runs side by side: the cores, caches and memory shared alike
        base = rows.get("no_fsdp_2procs" if VARIANTS[name][0] == 2 else "no_fsdp", {}).get("ms_per_step")
        if base:
            row["x_no_fsdp"] = round(row["ms_per_step"] / base, 3)
            row["host_cost_ms"] = round(row["ms_per_step"] - base, 2)
            if gloo := row["profiled_ms_per_step"].get("gloo:*"):  # what is left once the transfers are taken out
                row["host_cost_less_collectives_ms"] = round(row["host_cost_ms"] - gloo, 2)
    out = {"benchmark": "fsdp_host", "command": " ".join(["python", "benchmarks/fsdp_host.py", *sys.argv[1:]]),
           "model": MODEL, "steps": [args.start, args.steps], "rows": rows,
           "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                       "omp_num_threads": 1},
           "note": NOTE}
    emit(out, args.out, compact=True)


if __name__ == "__main__":
    main()

"""GPU acceptance check: what shardlm claims about GPUs, measured on this machine in one run (< 8 min, one GPU).

    make gpu-check                                       # = python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --stages throughput,vs_hf --batch 16
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.json   # every stage on CPU, tiny sizes (CI)

Each stage runs in its own process tree under its own timeout (an OOM or a hang cannot take the others
down) and prints one line when it finishes. Stages that measure memory or correctness run first, side by
side (--jobs); then those that measure time, one at a time, alone on the GPU. The last line is one JSON
object, also written to benchmarks/results/gpu_<device>_<date>.json: {"device", "torch", "date",
"stages": [{"name", "ok", "seconds", ...figures}], "mfu", "speedup_vs_hf"}. A failed stage has ok=false
and its error tail (the exit code is then 1). No stage runs past --budget-s. Without a CUDA GPU (and
--dry-run) it says so and exits 0. Subprocesses are `sys.executable -m shardlm | torch.distributed.run`,
so a checkout on PYTHONPATH works.

This file is the driver (which stages, in what order, under which timeouts; the report and the JSON); what each
stage runs and measures, and the sizes of the GPU run and of the dry run, are in benchmarks/gpu_stages.py.

  tests          `pytest -m cuda`: the single-process tests marked cuda pass on CUDA (gradient accumulation,
                 eval = HF labels loss, chunked = plain loss, no recompiles, SIGTERM save, async checkpoints,
                 non-finite steps)
  throughput     GPT-2 124M from scratch (GPT-2 BPE), seq 1024, bf16: tokens/s, MFU (nanoGPT's FLOPs) and
                 peak memory; one process, and torchrun with FSDP2 on one GPU (parallel.fsdp=true); each
                 eager (parallel.compile=false) and compiled (model)
  vs_hf          HF Trainer (SDPA, torch_compile) on the same model, data, batch, precision and AdamW:
                 speedup_vs_hf = the best shardlm tokens/s / HF Trainer's
  max_batch      the largest micro-batch at seq 512 within 16 GiB: shardlm, HF Trainer, shardlm + AC
  xl_offload     GPT-2 XL (1.5B) trains with parallel.cpu_offload=true within 24 GiB (its tokens/s is taken
                 beside the other correctness stages: whether it fits is the check)
  resume         kill -9 right after a checkpoint, then resume: each step's loss equals the uninterrupted
                 run's (fp32: ==, bf16: within gpu_stages.BF16_TOL)
  estimate_tune  `shardlm estimate` is within 15% of the measured step peak; `shardlm tune` writes its file
  profile        torch.profiler over steady-state steps of the compiled 124M: top kernels, GPU busy fraction,
                 which SDPA kernel ran (in throughput's compiled one-process run when both are asked for:
                 the model is compiled once)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from common import BENCH, ROOT, tail

# name -> (timeout s, timed: run alone on the GPU after the others); each runs `gpu_stages.py NAME`
STAGES: dict[str, tuple[int, bool]] = {
    "tests": (240, False),
    "throughput": (300, True),
    "vs_hf": (180, True),
    "max_batch": (300, False),  # 194-239 s on an H200/H100 beside the other checks; 240 s was once too few
    "xl_offload": (240, False),
    "resume": (180, False),
    "estimate_tune": (180, False),
    "profile": (120, True),
}


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun's workers start sessions of their own)."""
    from shardlm.distributed.launch import descendants

    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run_stage(name: str, args: argparse.Namespace, deadline: float) -> dict:
    """The stage in a child process, under min(its timeout, the time left); never raises."""
    timeout, began = min(STAGES[name][0], deadline - time.time()), time.time()
    if timeout < 15:
        return {"name": name, "ok": False, "seconds": 0.0, "error": "not run: the --budget-s time was spent"}
    cmd = [sys.executable, str(BENCH / "gpu_stages.py"), name, "--batch", str(args.batch)]
    cmd += (["--dry-run"] if args.dry_run else []) + (["--profile-here"] if args.profile_here else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
        late = ""
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        late = f"timed out after {timeout:.0f} s\n"
    lines = [x for x in out.splitlines() if x.startswith("STAGE ")]
    result = json.loads(lines[-1][6:]) if lines and not late else \
        {"ok": False, "error": late + tail(subprocess.CompletedProcess(cmd, proc.returncode, out, err))}
    return {"name": name, "ok": bool(result.pop("ok")), "seconds": round(time.time() - began, 1), **result}


def report(s: dict) -> dict:
    note = s.get("summary") or (s.get("error", "").strip().splitlines() or [""])[-1]
    print(f"[{'ok' if s['ok'] else 'FAIL'}] {s['name']:<14} {s['seconds']:6.1f}s  {note}", flush=True)
    return s


def run_all(names: list[str], args: argparse.Namespace, deadline: float) -> list[dict]:
    """The stages that measure memory or correctness side by side, `args.jobs` at a time (a dry run overlaps
    them all); then those that measure time (timed in STAGES) one at a time, alone on the GPU. Correctness
    goes first so that a run cut short by --budget-s loses a timing, never a check."""
    folded = "profile" in names and "throughput" in names  # profiled inside throughput: one compile
    todo = [n for n in names if not (folded and n == "profile")]
    alone = [] if args.dry_run else [n for n in todo if STAGES[n][1]]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_stage, n, args, deadline) for n in todo if n not in alone]
        done = {s["name"]: s for s in (report(f.result()) for f in as_completed(futures))}
    done.update({n: report(run_stage(n, args, deadline)) for n in alone})
    if folded:
        t = done["throughput"]
        done["profile"] = report({"name": "profile", "seconds": t["seconds"], "in_stage": "throughput",
                                  **(t.pop("profile", None) or {"ok": False, "error": "throughput ran no profile"})})
    return [done[n] for n in names]


def summarize(stages: list[dict], device: str, torch_version: str, args: argparse.Namespace, wall: float) -> dict:
    by = {s["name"]: s for s in stages}
    best, hf = by.get("throughput", {}).get("best_tokens_per_s"), by.get("vs_hf", {}).get("hf_tokens_per_s")
    return {"device": device, "torch": torch_version, "date": datetime.date.today().isoformat(),
            "dry_run": args.dry_run, "wall_s": round(wall, 1), "stages": stages,
            "mfu": by.get("throughput", {}).get("best_mfu"),
            "speedup_vs_hf": round(best / hf, 3) if best and hf else None}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every stage on CPU with tiny sizes (CI)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--batch", type=int, default=16, help="micro-batch of throughput, vs_hf and profile")
    p.add_argument("--budget-s", type=float, default=480, help="no stage starts or runs past this many seconds")
    p.add_argument("--jobs", type=int, default=None, help="untimed stages at once (default 5; 2 with --dry-run)")
    p.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/gpu_<device>_<date>.json; "
                                               "a temporary file with --dry-run)")
    return p.parse_args()


def main() -> int:
    args, began = parse_args(), time.time()
    names = [s for s in args.stages.split(",") if s]
    args.profile_here = "profile" in names and "throughput" in names
    if unknown := [s for s in names if s not in STAGES]:
        raise SystemExit(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    device, torch_version = "cpu", importlib.metadata.version("torch")  # a dry run needs no torch here
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: no CUDA GPU on this machine, nothing to check (--dry-run runs every stage on CPU).")
            return 0
        device, torch_version = torch.cuda.get_device_name(), torch.__version__
    else:  # on CPU even where there is a GPU; tiny models run faster with one thread per process
        os.environ.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    args.jobs = args.jobs or (2 if args.dry_run else 5)
    result = summarize(run_all(names, args, began + args.budget_s), device, torch_version, args, time.time() - began)
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    default = Path(tempfile.gettempdir()) / "gpu_check_dry_run.json" if args.dry_run else \
        BENCH / "results" / f"gpu_{slug}_{result['date']}.json"
    out = Path(args.out or default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)
    return 0 if all(s["ok"] for s in result["stages"]) else 1


if __name__ == "__main__":
    sys.exit(main())

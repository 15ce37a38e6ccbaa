"""Tokens/s and MFU of shardlm's training step for GPT-2 124M / 350M / 774M / 1558M (XL) at seq 1024.

    python benchmarks/mfu.py                                   # 124M, 350M and 774M on this device
    python benchmarks/mfu.py --sizes 124M --batch 16 --extra parallel.compile=model
    torchrun --nproc_per_node 1 benchmarks/mfu.py --sizes 124M --extra parallel.fsdp=true   # FSDP2 on one GPU
    python benchmarks/mfu.py --sizes 1558M --batch 4 --cap-gb 24 --extra parallel.cpu_offload=true
MFU = achieved FLOP/s / the device's dense bf16 peak, with FLOPs per token = 6N + 12 L C T (nanoGPT's
formula; N without position embeddings); `mfu_causal` counts attention's causal half, 6 L C T (llm.c's).
On CPU the peak is unknown and MFU is null. `--cap-gb` limits
this process's CUDA memory (torch.cuda.set_per_process_memory_fraction), as on a smaller GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import time

from common import SIZES, cap_memory, gpt2_overrides


def precision_of(args) -> str:
    import torch

    return args.precision or ("bf16" if torch.cuda.is_available() else "fp32")


def overrides(size: str, args) -> list[str]:
    """The shardlm overrides of one measurement: GPT-2 BPE, from scratch, `args.extra` last (they win)."""
    return gpt2_overrides(size, args.seq, args.batch, precision_of(args), args.data, args.extra)


def measure(size: str, args) -> dict:
    import torch

    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    on_gpu = torch.cuda.is_available()
    trainer = Trainer.from_config(load_config(None, overrides(size, args)))
    started = time.perf_counter()
    for _ in range(args.warmup):
        trainer.train_step()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warmup_s = time.perf_counter() - started  # the compile, mostly: what a user waits before the first steps
    began = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    profiled = profile_steps(trainer, args.profile) if args.profile else None
    tps = args.steps * trainer.global_batch * trainer.seq_len / elapsed
    peak = trainer.peak_flops
    plan = trainer.run.plan
    result = {"model": f"gpt2-{size}", "params_m": round(trainer.n_params / 1e6, 1), "batch": args.batch,
              "seq": args.seq, "precision": precision_of(args), "fsdp": plan.use_fsdp, "compile": plan.compile,
              "world_size": trainer.dist.world_size, "tokens_per_s": round(tps),
              "step_s": round(elapsed / args.steps, 4), "warmup_s": round(warmup_s, 1),
              "mfu": round(trainer.flops_per_token * tps / (peak * trainer.dist.world_size), 4) if peak else None,
              "mfu_causal": round(trainer.flops_per_token_causal * tps / (peak * trainer.dist.world_size), 4)
              if peak else None,
              "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else None,
              **({"profile": profiled} if profiled else {})}
    del trainer
    torch.cuda.empty_cache() if on_gpu else None
    return result


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        total += max(0.0, e - max(s, end))
        end = max(end, e)
    return total


def sdpa_kernel(names: list[str]) -> str:
    low = " ".join(names).lower()
    for label, marks in (("cudnn", ("cudnn",)), ("flash", ("flash",)), ("efficient", ("fmha", "efficient"))):
        if any(m in low for m in marks):
            return label
    return "math or unknown"


def profile_steps(trainer, steps: int) -> dict:
    """torch.profiler over `steps` steady-state steps, after the timed ones (same process: no second compile).
    On a GPU: device activity by kernel, the busy fraction of the wall time, which SDPA kernel ran; on CPU
    (the dry run): aten ops by self time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        for _ in range(steps):
            trainer.train_step()
        sync()
    wall_us = (time.perf_counter() - began) * 1e6
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA] if on_gpu else \
        [e for e in prof.events() if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.elapsed_us() if on_gpu else e.self_cpu_time_total)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    attention = [n for n in by_name if re.search(r"flash|fmha|efficient|cudnn|scaled_dot_product|sdpa", n, re.I)]
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in events]) / wall_us if on_gpu else None
    label = sdpa_kernel(attention) if on_gpu else (attention[0] if attention else "none")
    return {"ok": bool(top and attention), "steps": steps,
            "summary": f"GPU busy {busy:.0%}, SDPA: {label}" if on_gpu else f"SDPA: {label}",
            "wall_ms": round(wall_us / 1e3, 1), "gpu_busy_fraction": round(busy, 3) if on_gpu else None,
            "sdpa_kernel": label, "attention_kernels": attention[:6],
            "top_kernels_ms": [[n[:160], round(t / 1e3, 3)] for n, t in top]}  # summed over the profiled steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="124M,350M,774M", help=f"comma-separated: {', '.join(SIZES)} or LxHxC")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", default=None, help="default: bf16 on a GPU, fp32 on CPU")
    p.add_argument("--cap-gb", type=float, default=None, help="CUDA memory cap for this process (GiB)")
    p.add_argument("--data", default="shakespeare")
    p.add_argument("--extra", action="append", default=[], help="extra shardlm override")
    p.add_argument("--profile", type=int, default=0, help="then profile this many steps (torch.profiler)")
    return p.parse_args(argv)


def main() -> None:
    import torch

    from shardlm.distributed.process_group import shutdown

    args = parse_args()
    cap_memory(args.cap_gb)
    results = [measure(size, args) for size in args.sizes.split(",")]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"benchmark": "mfu", "date": datetime.date.today().isoformat(), "device": device,
                      "torch": torch.__version__, "command": " ".join(["python", *sys.argv]), "results": results}),
          flush=True)
    shutdown(0)  # FSDP runs hold a process group: tear it down and leave at once


if __name__ == "__main__":
    main()

"""Context parallelism on CPU (gloo): peak memory per rank at one long row with parallel.context=1 vs 2, and the
step time it costs.

    python benchmarks/cp_memory.py                          # Llama shape, 4 blocks of 256 (GQA 8/2), seq 8192
    python benchmarks/cp_memory.py --seq 16384 --out benchmarks/results/cp_memory_cpu.json

Both sides run on 2 FSDP2 ranks (the same weight shards per rank), each rank holding one row's worth of work:
context 1 trains 2 rows a step (one whole row per rank), context 2 one row split over both ranks (half a row per
rank: what context parallelism is for, a row that would not fit one rank). Measured per rank, from inside the run:
`saved_for_backward_bytes`, the activations: every tensor autograd keeps from the first step's forward for its
backward (saved-tensor hooks, each storage once: the split's shared mask and gathered keys and values included);
`peak_rss_bytes` (ru_maxrss: the interpreter, torch, transformers and the weights included) and `step_rss_bytes`,
the peak above the resident memory before the first step (the step's own: activations, gradients, AdamW's state,
the split's mask and gathered keys); the median step time after one warmup step, and tokens/s per rank. The last
line is one JSON object; `--out` writes it too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from common import ROOT, cpu_name


def overrides(args, context: int, out: str) -> list[str]:
    return ["model.arch=llama", f"model.n_layer={args.layers}", f"model.n_embd={args.width}", "model.n_head=8",
            "model.n_kv_head=2", "model.tokenizer=bytes", "data.train=shakespeare", f"data.seq_len={args.seq}",
            f"data.cache_dir={args.cache}", "train.batch_size=1", f"train.max_steps={args.steps + 10}",
            "train.lr=1e-3", "train.warmup_steps=2", "parallel.precision=fp32", "parallel.compile=false",
            f"parallel.context={context}", "train.sample_tokens=0", "train.eval_every=0", "log.tensorboard=false",
            "log.progress=none", "checkpoint.save_final=false", "checkpoint.every=0", f"out_dir={out}"]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args) -> None:
    """One side's run on each rank under torchrun: a JSON line per rank into args.result."""
    import torch

    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    trainer = Trainer.from_config(load_config(None, overrides(args, args.context, args.out)))
    before = resident_bytes()
    times, losses = [], []
    saved: dict[int, int] = {}

    def pack(t):  # what autograd keeps for the backward, each storage once (the shared mask, views of one tensor)
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    for step in range(args.steps):
        began = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if step == 0 else contextlib.nullcontext():
            out = trainer.train_step()
        losses.append(out["loss_sum"].item())
        times.append(time.perf_counter() - began)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens_per_rank = args.seq // args.context
    record = {"rank": trainer.dist.rank, "context": args.context, "saved_for_backward_bytes": sum(saved.values()),
              "peak_rss_bytes": peak,
              "step_rss_bytes": peak - before, "step_s_median": median(times[1:]),
              "tokens_per_s_per_rank": tokens_per_rank / median(times[1:]), "loss_sums": losses}
    with open(args.result, "a") as f:
        f.write(json.dumps(record) + "\n")
    from shardlm.distributed.process_group import shutdown

    shutdown(0)  # a finished FSDP2 process can abort in interpreter teardown (shardlm.distributed.process_group)


def side(args, context: int) -> list[dict]:
    result = Path(tempfile.mkdtemp(prefix="shardlm-cp-bench-")) / "ranks.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), "--worker", "--context", str(context), "--cache", args.cache,
           "--seq", str(args.seq), "--layers", str(args.layers), "--width", str(args.width), "--steps",
           str(args.steps), "--result", str(result), "--out", tempfile.mkdtemp(prefix="shardlm-cp-run-")]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // 2)), "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return sorted((json.loads(line) for line in result.read_text().splitlines()), key=lambda r: r["rank"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="CPU threads in all (half per rank)")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    args.cache = tempfile.mkdtemp(prefix="shardlm-cp-cache-")
    one, two = side(args, 1), side(args, 2)
    summary = {
        "what": "one long row per rank's work on 2 FSDP2 ranks: parallel.context=1 (a whole row each) vs 2 (the row "
                "split), gloo, CPU, fp32",
        "date": datetime.date.today().isoformat(), "cpu": cpu_name(),
        "model": f"Llama shape, {args.layers} blocks of {args.width}, 8 heads, 2 key/value heads, byte vocabulary",
        "seq": args.seq, "steps": args.steps, "threads": args.threads, "context_1": one, "context_2": two,
        "saved_for_backward_per_rank_vs_context_1": (max(r["saved_for_backward_bytes"] for r in two)
                                                     / max(r["saved_for_backward_bytes"] for r in one)),
        "step_rss_per_rank_vs_context_1": max(r["step_rss_bytes"] for r in two) / max(r["step_rss_bytes"] for r in one),
        "peak_rss_per_rank_vs_context_1": max(r["peak_rss_bytes"] for r in two) / max(r["peak_rss_bytes"] for r in one),
        "time_per_token_vs_context_1": (min(r["tokens_per_s_per_rank"] for r in one)
                                        / min(r["tokens_per_s_per_rank"] for r in two)),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

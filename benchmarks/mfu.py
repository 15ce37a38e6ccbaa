"""Tokens/s and MFU of shardlm's training step for GPT-2 124M / 350M / 774M at seq 1024.

    python benchmarks/mfu.py                                   # all three sizes on this device
    python benchmarks/mfu.py --sizes 124M --batch 16 --extra parallel.compile=true
MFU = achieved FLOP/s / the device's dense bf16 peak, with FLOPs per token = 6N + 12 L C T (nanoGPT's
formula; N without position embeddings). On CPU the peak is unknown and MFU is null.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

SIZES = {"124M": (12, 12, 768), "350M": (24, 16, 1024), "774M": (36, 20, 1280)}
ROOT = Path(__file__).resolve().parent.parent


def measure(size: str, args) -> dict:
    import torch

    from shardlm.build import build
    from shardlm.config import load_config
    from shardlm.trainer import Trainer

    layers, heads, width = SIZES[size]
    on_gpu = torch.cuda.is_available()
    overrides = [f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={width}",
                 f"model.n_positions={args.seq}", "model.tokenizer=gpt2", f"data.seq_len={args.seq}",
                 f"data.train={args.data}", f"train.batch_size={args.batch}", "train.max_steps=1000000",
                 f"parallel.precision={'bf16' if on_gpu else 'fp32'}", "log.tensorboard=false",
                 "out_dir=/tmp/shardlm-mfu", *args.extra]
    trainer = Trainer(build(load_config(None, overrides)))
    for _ in range(args.warmup):
        trainer.train_step()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    tps = args.steps * trainer.global_batch * trainer.seq_len / elapsed
    peak = trainer.peak_flops
    result = {"model": f"gpt2-{size}", "params_m": round(trainer.n_params / 1e6, 1), "batch": args.batch,
              "seq": args.seq, "tokens_per_s": round(tps), "step_s": round(elapsed / args.steps, 4),
              "mfu": round(trainer.flops_per_token * tps / (peak * trainer.dist.world_size), 4) if peak else None,
              "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else None}
    del trainer
    torch.cuda.empty_cache() if on_gpu else None
    return result


def main() -> None:
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="124M,350M,774M")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--data", default="shakespeare")
    p.add_argument("--extra", action="append", default=[], help="extra shardlm override")
    args = p.parse_args()
    results = [measure(size, args) for size in args.sizes.split(",")]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"benchmark": "mfu", "date": datetime.date.today().isoformat(), "device": device,
                      "torch": torch.__version__, "command": " ".join(["python", *sys.argv]), "results": results}))


if __name__ == "__main__":
    main()

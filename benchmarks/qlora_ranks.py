"""QLoRA with torchao's NF4 base (lora.quant_backend=torchao) on 1 process vs 2 FSDP2 ranks (gloo, CPU): what each
rank holds of the 4-bit base, its peak memory, and the step time.

    python benchmarks/qlora_ranks.py                        # GPT-2 shape, 6 blocks of 768, seq 256, batch 2, fp32
    python benchmarks/qlora_ranks.py --layers 12 --steps 6  # GPT-2 124M's 12 blocks

The base is a GPT-2 of random weights saved to a temporary folder (and the bundled GPT-2 tokenizer), loaded as a
pretrained model; LoRA r=16 on every projection of the blocks, which hold their linears in NF4. Both sides train on
the same global batch (2 ranks: half the rows each), so their losses agree (checked: `max_loss_diff`).

Measured per rank, from inside the run: `base_nf4_bytes`, the bytes of the 4-bit weights' codes, scales and factors
this rank holds (the storage of its shards: shardlm.models.nf4.base_bytes), beside `base_fp32_bytes`, what the same
linears take in fp32 whole; `peak_rss_bytes`, the process's peak resident memory (ru_maxrss: the interpreter,
torch and transformers included, ~0.4 GiB of it); the median step time after one warmup step. The last line is one
JSON object; `--out` writes it too.
"""

from __future__ import annotations

import argparse
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


def make_base(folder: Path, layers: int, width: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.tokenizer import load_tokenizer

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64)).save_pretrained(str(folder))
    load_tokenizer("gpt2").save_pretrained(str(folder))


def overrides(args, batch: int, out: str) -> list[str]:
    return [f"model.name={args.base}", "model.dropout=0.0", "data.train=shakespeare", f"data.seq_len={args.seq}",
            f"data.cache_dir={args.cache}", f"train.batch_size={batch}", f"train.max_steps={args.steps + 10}",
            "train.lr=2e-4", "train.warmup_steps=2", "parallel.precision=fp32", "parallel.compile=false",
            "train.sample_tokens=0", "train.eval_every=0", "log.tensorboard=false", "log.progress=none",
            "checkpoint.save_final=false", "checkpoint.every=0", "lora.r=16", "lora.alpha=32", "lora.quantize=nf4",
            "lora.quant_backend=torchao", f"out_dir={out}"]


def worker(args) -> None:
    """One side's run (one process, or each rank under torchrun): a JSON line per rank into args.result."""
    import torch

    from shardlm.config import load_config
    from shardlm.models import nf4
    from shardlm.training.trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer.from_config(load_config(None, overrides(args, args.batch // world, args.out)))
    four_bit = [p for p in trainer.model.parameters() if nf4.is_nf4(p)]
    times, losses = [], []
    for _ in range(args.steps):
        began = time.perf_counter()
        out = trainer.train_step()
        losses.append(out["loss_sum"].item())
        times.append(time.perf_counter() - began)
    loss_sum = torch.tensor(losses, dtype=torch.float64)
    if trainer.dist.distributed:
        torch.distributed.all_reduce(loss_sum)
    tokens = args.batch * args.seq
    record = {"rank": trainer.dist.rank, "world": world, "base_nf4_bytes": nf4.base_bytes(trainer.model),
              "base_fp32_bytes": 4 * sum(p.numel() for p in four_bit), "nf4_linears": len(four_bit),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "step_s_median": median(times[1:]), "losses": [v / tokens for v in loss_sum.tolist()]}
    with open(args.result, "a") as f:
        f.write(json.dumps(record) + "\n")
    from shardlm.distributed.process_group import shutdown

    shutdown(0)  # a finished FSDP2 process can abort in interpreter teardown (shardlm.distributed.process_group)


def side(args, ranks: int) -> list[dict]:
    result = Path(tempfile.mkdtemp(prefix="shardlm-qlora-bench-")) / "ranks.jsonl"
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    cmd = [sys.executable, *launcher, str(Path(__file__).resolve()), "--worker", "--base", args.base, "--cache",
           args.cache, "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--result",
           str(result), "--out", tempfile.mkdtemp(prefix="shardlm-qlora-run-")]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads // ranks), "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return sorted((json.loads(line) for line in result.read_text().splitlines()), key=lambda r: r["rank"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="global batch (2 ranks: half each)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="CPU threads in all (2 ranks: half each)")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--base", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="shardlm-qlora-base-") as base:
        make_base(Path(base), args.layers, args.width)
        args.base, args.cache = base, tempfile.mkdtemp(prefix="shardlm-qlora-cache-")
        one, two = side(args, 1), side(args, 2)
    base_one = one[0]["base_nf4_bytes"]
    summary = {
        "what": "QLoRA (torchao NF4 base, LoRA r=16) on 1 process vs 2 FSDP2 ranks, gloo, CPU, fp32",
        "date": datetime.date.today().isoformat(), "cpu": cpu_name(),
        "model": f"GPT-2 shape, {args.layers} blocks of {args.width}", "seq": args.seq, "global_batch": args.batch,
        "steps": args.steps, "threads": args.threads, "one_process": one[0], "two_ranks": two,
        "base_per_rank_vs_one": max(r["base_nf4_bytes"] for r in two) / base_one,
        "base_nf4_bytes_per_weight": base_one / (one[0]["base_fp32_bytes"] / 4),
        "peak_rss_per_rank_vs_one": max(r["peak_rss_bytes"] for r in two) / one[0]["peak_rss_bytes"],
        "step_time_vs_one": max(r["step_s_median"] for r in two) / one[0]["step_s_median"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(one[0]["losses"], two[0]["losses"], strict=True)),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

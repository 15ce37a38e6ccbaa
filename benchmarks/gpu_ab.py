"""The GPU throughput A/B list of issue 32 (Part 2), in its order, in one call: each variant a benchmarks/mfu.py
(or HF Trainer) process of its own, one JSON line each into --out as it finishes, until --budget-s is spent.

    python benchmarks/gpu_ab.py --out /tmp/ab.jsonl --budget-s 540          # on the GPU
    python benchmarks/gpu_ab.py --size 2x2x64 --xl 2x2x64 --seq 64 --batch 2 --precision fp32 --compile false \
        --steps 2 --warmup 1 --out /tmp/ab.jsonl                              # the same list, tiny, on CPU

The variants (GPT-2 124M, seq 1024, micro-batch 32, vocabulary padded to 64, compiled, bf16):
  base            HEAD's step: the norm read every step, the fp32 residual stream (sync_free_step=false,
                  bf16_residual=false), with a profile of 3 steps
  sdpa            base with transformers' own SDPA mask (model.attention=sdpa): the causal-mask change's A/B
  accum4          base at train.grad_accum=4: the fixed per-step cost F = (4 t1 - t4) / 3
  sync_free       base with the sync-free step alone
  bf16_residual   base with the bf16 residual stream alone
  both            both (today's defaults)
  fsdp1           torchrun, one rank, parallel.fsdp=true (today's defaults), with a profile
  fsdp1_grad_op   the same with parallel.sharding=grad_op
  xl_bf16         GPT-2 XL (1558M), micro-batch 8
  xl_fp8          the same in fp8
  xl_b16          GPT-2 XL at micro-batch 16, bf16 (the 50% MFU goal: a larger batch feeds the matmuls more)
  xl_fp8_blocks   xl_fp8 with parallel.compile=blocks: one block's graph compiled and reused, so the compile does
                  not grow with the depth (on CPU, 12 fp8 blocks: 34 s against 94 s; benchmarks/compile_time.py)
  xl_bf16_blocks  xl_bf16 with parallel.compile=blocks: what whole-model fusion is worth at XL
  hf              HF Trainer (torch_compile, SDPA, the same padding, batch and data): its tokens/s
  b64             micro-batch 64 with today's defaults (train.loss_chunk_size null: the plain compiled loss)
  fsdp1_b16       fsdp1 at half the micro-batch (16), with a profile: the host-bound case
  fsdp1_b16_block fsdp1_b16 with parallel.wrap=block (a unit per block, the default before 2026-11-29; auto
                  groups GPT-2 124M's 12 blocks into 2 units): the per-unit host cost's A/B
  llama_bf16      a Llama-3-8B-shaped body of --large-layers blocks (width 4096, 32 heads, 8 key/value heads, MLP
                  14336), random weights, GPT-2 BPE, parallel.compile=blocks, micro-batch --large-batch: where fp8's
                  matmuls are large enough to pay (torchtitan measures +28% at 8B)
  llama_fp8       the same in fp8
Before the list: the device, driver, CUDA, cuDNN, torch and transformers versions as the first line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import BENCH, ROOT, dims

OLD = ["train.sync_free_step=false", "parallel.bf16_residual=false"]
NEW = ["train.sync_free_step=true", "parallel.bf16_residual=true"]


def variants(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, argv after the interpreter) in the issue's order."""
    common = ["--seq", str(a.seq), "--precision", a.precision, "--steps", str(a.steps), "--warmup", str(a.warmup),
              "--extra", "model.vocab_multiple=64", "--extra", f"parallel.compile={a.compile}"]

    def mfu(size: str, batch: int, extra: list[str], profile: int = 0, torchrun: bool = False) -> list[str]:
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] if torchrun else []
        return [*launch, str(BENCH / "mfu.py"), "--sizes", size, "--batch", str(batch), *common,
                *(["--profile", str(profile)] if profile else []), *[f"--extra={e}" for e in extra]]

    llama = [*NEW, "model.arch=llama", f"model.n_kv_head={a.large_kv}", f"model.intermediate_size={a.large_mlp}",
             "parallel.compile=blocks"]
    hf = [str(BENCH / "vs_hf_trainer.py"), "--side", "hf", "--model", ",".join(map(str, dims(a.size))), "--seq",
          str(a.seq), "--batch", str(a.batch), "--precision", a.precision, "--steps", str(a.steps + a.warmup),
          "--warmup", str(a.warmup), "--data", "shakespeare", "--vocab-multiple", "64",
          *(["--hf-compile"] if a.compile != "false" else [])]
    return [
        ("base", mfu(a.size, a.batch, OLD, profile=3)),
        ("sdpa", mfu(a.size, a.batch, [*OLD, "model.attention=sdpa"])),
        ("accum4", mfu(a.size, a.batch, [*OLD, "train.grad_accum=4"])),
        ("sync_free", mfu(a.size, a.batch, ["train.sync_free_step=true", "parallel.bf16_residual=false"])),
        ("bf16_residual", mfu(a.size, a.batch, ["train.sync_free_step=false", "parallel.bf16_residual=true"])),
        ("both", mfu(a.size, a.batch, NEW)),
        ("fsdp1", mfu(a.size, a.batch, [*NEW, "parallel.fsdp=true"], profile=3, torchrun=True)),
        ("fsdp1_grad_op", mfu(a.size, a.batch, [*NEW, "parallel.fsdp=true", "parallel.sharding=grad_op"],
                              torchrun=True)),
        ("xl_bf16", mfu(a.xl, a.xl_batch, NEW)),
        ("xl_fp8", mfu(a.xl, a.xl_batch, NEW) + ["--precision", "fp8"]),
        ("xl_b16", mfu(a.xl, 2 * a.xl_batch, NEW)),
        ("xl_fp8_blocks", mfu(a.xl, a.xl_batch, [*NEW, "parallel.compile=blocks"]) + ["--precision", "fp8"]),
        ("xl_bf16_blocks", mfu(a.xl, a.xl_batch, [*NEW, "parallel.compile=blocks"])),
        ("hf", hf),
        ("b64", mfu(a.size, 2 * a.batch, NEW)),
        ("fsdp1_b16", mfu(a.size, a.batch // 2, [*NEW, "parallel.fsdp=true"], profile=3, torchrun=True)),
        ("fsdp1_b16_block", mfu(a.size, a.batch // 2, [*NEW, "parallel.fsdp=true", "parallel.wrap=block"],
                                torchrun=True)),
        ("llama_bf16", mfu(a.large, a.large_batch, llama)),
        ("llama_fp8", mfu(a.large, a.large_batch, llama) + ["--precision", "fp8"]),
    ]


def environment() -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "commit": os.environ.get("SHARDLM_COMMIT")}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                          "--format=csv,noheader"], capture_output=True, text=True) if torch.cuda.is_available() \
        else None
    info["nvidia_smi"] = smi.stdout.strip() if smi else None
    return info


def run_one(name: str, argv: list[str], timeout: float) -> dict:
    began = time.time()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"name": name, "ok": False, "error": f"timed out after {timeout:.0f} s", "wall_s": round(timeout)}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{") or x.startswith("RESULT ")]
    row: dict = {"name": name, "ok": proc.returncode == 0 and bool(lines), "wall_s": round(time.time() - began, 1),
                 "command": " ".join(["python", *[a.replace(str(ROOT) + "/", "") for a in argv]])}
    if row["ok"]:
        last = lines[-1]
        got = json.loads(last[7:] if last.startswith("RESULT ") else last)
        row["result"] = got["results"][0] if "results" in got else got
    else:
        row["error"] = (proc.stdout[-800:] + "\n" + proc.stderr[-2500:]).strip()
    return row


def summary(row: dict) -> str:
    r = row.get("result") or {}
    if not row["ok"]:
        return f"{row['name']:>14}  FAILED ({row.get('error', '')[-200:]!r})"
    tps = r.get("tokens_per_s")
    return (f"{row['name']:>14}  {tps:>10,.0f} tok/s  mfu {r.get('mfu')}  llm.c {r.get('mfu_causal')}  "
            f"step {r.get('step_s')} s  warmup {r.get('warmup_s')} s  "
            f"mem {r.get('peak_mem_gb', r.get('peak_memory_gb'))} GB  "
            f"({row['wall_s']} s)" if tps else f"{row['name']:>14}  {r}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--only", default="", help="comma-separated variant names (default: all, in order)")
    p.add_argument("--size", default="124M")
    p.add_argument("--xl", default="1558M")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--xl-batch", type=int, default=8)
    p.add_argument("--large", default="8x32x4096", help="llama_*: LxHxC of the Llama-shaped model")
    p.add_argument("--large-kv", type=int, default=8)
    p.add_argument("--large-mlp", type=int, default=14336)
    p.add_argument("--large-batch", type=int, default=8)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--compile", default="model")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    deadline = time.time() + a.budget_s
    with open(a.out, "a") as out:
        out.write(json.dumps({"name": "environment", **environment()}) + "\n")
        for name, argv in variants(a):
            if a.only and name not in a.only.split(","):
                continue
            left = deadline - time.time()
            if left < 45:
                print(f"{name:>14}  not run: {left:.0f} s of the budget left", flush=True)
                continue
            row = run_one(name, argv, min(left, 300))
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(summary(row), flush=True)


if __name__ == "__main__":
    main()

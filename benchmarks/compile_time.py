"""How long torch.compile takes before the first step, by compile mode (parallel.compile=model or blocks) and
precision (bf16, or fp8 converted as shardlm converts it), as the number of blocks grows. Prints one JSON line per
case and a summary.

Why: on an H200 GPT-2 XL in fp8 with parallel.compile=model was still compiling after 211 s (the GPU idle), where
bf16 compiles in about a minute. compile=model traces every block into one graph, so its compile time grows with
the depth; compile=blocks compiles each block on its own, and blocks of one class whose guards pass reuse the
first one's code. Graph capture, AOTAutograd and partitioning are the same work on any device, so this part of
the compile time is measured here on CPU (fp8 emulated: the same amax/scale/cast graph, fp32 matmuls); the code
generation differs (C++ on CPU, Triton on CUDA).

    python benchmarks/compile_time.py --layers 4,8 --width 256           # ~2 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from common import cpu_name
from transformers import GPT2Config, GPT2LMHeadModel


def first_steps(layers: int, width: int, mode: str, precision: str, seq: int, batch: int) -> dict:
    """Seconds of the first training step (compile included) and of the second (compiled code only)."""
    import torch._dynamo

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_head=max(1, width // 64), n_embd=width, n_positions=seq,
                                       vocab_size=512, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa"))
    blocks = model.transformer.h
    if precision == "fp8":
        from shardlm.models.fp8 import convert_to_float8

        convert_to_float8(model, blocks, fsdp=False, emulate=True)
    if mode == "blocks":
        for block in blocks:
            block.compile(dynamic=False)
    else:
        model.compile(dynamic=False)
    ids = torch.randint(0, 512, (batch, seq))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        times.append(time.perf_counter() - start)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"layers": layers, "width": width, "compile": mode, "precision": precision,
            "first_step_s": round(times[0], 2), "second_step_s": round(times[1], 3),
            "compile_s": round(times[0] - times[1], 2), "graphs": graphs}


def in_fresh_process(argv: list[str]) -> dict:
    """One case in a process of its own with an empty inductor cache: no case reuses another's compiled code."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="4,8", help="comma-separated block counts (default: 4,8)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--precisions", default="fp32,fp8", help="fp32 and/or fp8 (emulated: fp8 casts, fp32 matmuls)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # precision/layers/mode: one case, in this process
    a = p.parse_args()
    if a.case:
        precision, layers, mode = a.case.split("/")
        print(json.dumps(first_steps(int(layers), a.width, mode, precision, a.seq, a.batch)))
        return
    rows = []
    for precision in a.precisions.split(","):
        for layers in a.layers.split(","):
            for mode in ("model", "blocks"):
                row = in_fresh_process(["--case", f"{precision}/{layers}/{mode}", "--width", str(a.width),
                                        "--seq", str(a.seq), "--batch", str(a.batch)])
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(json.dumps({"summary": "compile seconds by (precision, layers): model vs blocks",
                      "device": cpu_name(), "torch": torch.__version__,
                      "cases": {f"{r['precision']}/{r['layers']}/{r['compile']}": r["compile_s"] for r in rows}}))


if __name__ == "__main__":
    main()

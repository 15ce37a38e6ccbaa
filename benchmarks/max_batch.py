"""The largest micro-batch that fits a memory budget: shardlm vs Hugging Face Trainer, same settings.

    python benchmarks/max_batch.py                       # GPT-2 124M, seq 512, fp32, 6 GiB budget (CPU)
    python benchmarks/max_batch.py --budget-gb 16 --cap-gb 16 --precision bf16   # on a GPU: a 16 GiB card
    python benchmarks/max_batch.py --sides shardlm --ac  # shardlm alone, with activation checkpointing

A batch "fits" when the peak memory of a training step (the second one: the optimizer state exists)
stays within the budget. On CUDA the peak is torch.cuda.max_memory_allocated, and `--cap-gb` makes each
trial process unable to allocate more (torch.cuda.set_per_process_memory_fraction): out of memory counts
as not fitting. On CPU it is measured the same way for both sides: large blocks are mmapped, the
kernel's peak-RSS counter is reset before the step, and its growth is added to the bytes resident before
the step (parameters + optimizer state). Each trial runs in a fresh process.

Search (shardlm.preflight.tune.largest_fit), from `--start` (s) up to `--max-batch`: once two batches fit, the next
trial is where the straight line through their peaks meets the budget (peak memory grows linearly with the
batch): s, 2s, the line's answer and one more settle it when memory is linear, instead of ~2 log2(max) trials.
Doubling, then bisection, where there is no line yet or a batch that did not fit contradicts it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from common import DATA_HELP, DEFAULT_DATA, ROOT, cap_memory, shardlm_overrides


def model_dims(args) -> dict:
    layers, heads, width = args.model
    return {"n_layer": layers, "n_head": heads, "n_embd": width}


def trial_shardlm(args) -> int:
    from shardlm.config import load_config
    from shardlm.observe.hardware import measure_step_peak
    from shardlm.training.trainer import Trainer

    s = {"model": model_dims(args), "seq": args.seq, "batch": args.batch, "precision": args.precision, "steps": 2}
    extra = ["parallel.compile=false"] + (["parallel.activation_checkpointing=true"] if args.ac else [])
    trainer = Trainer.from_config(load_config(None, shardlm_overrides(s, args.data, extra)))
    trainer.train_step()
    return measure_step_peak(trainer)


def trial_hf(args) -> int:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from shardlm.observe.hardware import StepPeak

    torch.manual_seed(0)
    config = GPT2Config(n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        **model_dims(args))
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    data = [{"input_ids": torch.randint(0, 50257, (args.seq,))} for _ in range(2 * args.batch)]
    for row in data:
        row["labels"] = row["input_ids"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = {}

    class Measure(TrainerCallback):
        def on_step_begin(self, _targs, state, _control, **kw):
            if state.global_step == 1:  # the second step: AdamW state exists
                peak["meter"] = StepPeak(model, kw["optimizer"], device)
                peak["meter"].start()

        def on_step_end(self, _targs, state, _control, **_kw):
            if state.global_step == 2:
                peak["bytes"] = peak["meter"].stop()

    targs = TrainingArguments(output_dir="/tmp/hf-maxbatch", per_device_train_batch_size=args.batch, max_steps=2,
                              save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                              bf16=args.precision == "bf16", gradient_checkpointing=args.ac, disable_tqdm=True,
                              dataloader_num_workers=0)
    Trainer(model=model, args=targs, train_dataset=data, callbacks=[Measure()]).train()
    return peak["bytes"]


def trial_argv(side: str, batch: int, args) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--trial", side, "--batch", str(batch),
            "--seq", str(args.seq), "--precision", args.precision, "--data", args.data,
            "--model", ",".join(map(str, args.model))]
    return argv + (["--ac"] if args.ac else []) + (["--cap-gb", str(args.cap_gb)] if args.cap_gb else [])


def fits(side: str, batch: int, args) -> tuple[bool, float]:
    """(fits, peak GiB) of one trial in a fresh process; out of memory (CUDA, or the OS killing it) = no fit."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(trial_argv(side, batch, args), capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PEAK ")]
    if not lines:
        if proc.returncode < 0 or "out of memory" in proc.stderr.lower():
            return False, float("nan")
        raise RuntimeError(f"{side} trial at batch {batch} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    peak = int(lines[0][5:]) / 2**30
    print(f"{side} batch {batch}: peak {peak:.2f} GiB", file=sys.stderr, flush=True)  # progress, if cut short
    return peak <= args.budget_gb, peak


def search(side: str, args) -> dict:
    """Largest batch <= args.max_batch that fits (0: not even 1), with the peak of every trial
    (shardlm.preflight.tune.largest_fit: doubling, then the line through the peaks, then bisection)."""
    from shardlm.preflight.tune import largest_fit

    lo, trials = largest_fit(lambda batch: fits(side, batch, args), args.max_batch, args.start, args.budget_gb)
    return {"max_batch": lo, "capped": lo == args.max_batch, "trials": len(trials),
            "peak_gb_by_batch": {str(k): round(v, 3) if math.isfinite(v) else None  # None: out of memory
                                 for k, (_, v) in sorted(trials.items())}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--trial", choices=["shardlm", "hf"])
    p.add_argument("--sides", default="shardlm,hf")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--model", type=lambda v: tuple(int(x) for x in v.split(",")), default=(12, 12, 768),
                   help="n_layer,n_head,n_embd (GPT-2 BPE vocabulary)")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--budget-gb", type=float, default=6.0)
    p.add_argument("--cap-gb", type=float, default=None, help="CUDA: each trial may allocate at most this (GiB)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--start", type=int, default=1, help="the first trial's batch (then twice it, then the line)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing on both sides")
    p.add_argument("--data", default=DEFAULT_DATA, help=DATA_HELP)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.trial:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        cap_memory(args.cap_gb)
        peak = trial_shardlm(args) if args.trial == "shardlm" else trial_hf(args)
        print(f"PEAK {peak}", flush=True)
        return
    import torch

    found = {side: search(side, args) for side in args.sides.split(",")}
    ours, theirs = found.get("shardlm"), found.get("hf")
    print(json.dumps({
        "benchmark": "max_batch", "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__, "command": " ".join(["python", *sys.argv]),
        "model": "gpt2-" + "x".join(map(str, args.model)), "seq": args.seq, "precision": args.precision,
        "budget_gb": args.budget_gb, "cap_gb": args.cap_gb, "activation_checkpointing": args.ac,
        "shardlm": ours, "hf_trainer": theirs,
        "max_batch_ratio": ours["max_batch"] / max(1, theirs["max_batch"]) if ours and theirs else None,
    }))


if __name__ == "__main__":
    main()

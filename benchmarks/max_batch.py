"""The largest micro-batch that fits a memory budget: shardlm vs Hugging Face Trainer, same settings.

    python benchmarks/max_batch.py                       # GPT-2 124M, seq 512, fp32, 6 GiB budget (CPU)
    python benchmarks/max_batch.py --budget-gb 16 --precision bf16   # on a GPU: max_memory_allocated

A batch "fits" when the peak memory of a training step (the second one: the optimizer state exists)
stays within the budget. On CUDA the peak is torch.cuda.max_memory_allocated; on CPU it is measured the
same way for both sides: large blocks are mmapped, the kernel's peak-RSS counter is reset before the
step, and its growth is added to the bytes resident before the step (parameters + optimizer state).
Each trial runs in a fresh process. Search: doubling, then bisection.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def trial_shardlm(args) -> int:
    from shardlm.build import build
    from shardlm.config import load_config
    from shardlm.estimate import measure_step_peak
    from shardlm.trainer import Trainer
    from vs_hf_trainer import shardlm_overrides

    s = {"model": {"n_layer": 12, "n_head": 12, "n_embd": 768}, "seq": args.seq, "batch": args.batch,
         "precision": args.precision, "steps": 2}
    extra = ["parallel.activation_checkpointing=true"] if args.ac else []
    trainer = Trainer(build(load_config(None, shardlm_overrides(s, args.data, extra))))
    trainer.train_step()
    return measure_step_peak(trainer)


def trial_hf(args) -> int:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from shardlm.estimate import StepPeak

    torch.manual_seed(0)
    config = GPT2Config(n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    data = [{"input_ids": torch.randint(0, 50257, (args.seq,))} for _ in range(2 * args.batch)]
    for row in data:
        row["labels"] = row["input_ids"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = {}

    class Measure(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            if state.global_step == 1:  # the second step: AdamW state exists
                peak["meter"] = StepPeak(model, kw["optimizer"], device)
                peak["meter"].start()

        def on_step_end(self, targs, state, control, **kw):
            if state.global_step == 2:
                peak["bytes"] = peak["meter"].stop()

    targs = TrainingArguments(output_dir="/tmp/hf-maxbatch", per_device_train_batch_size=args.batch, max_steps=2,
                              save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                              bf16=args.precision == "bf16", gradient_checkpointing=args.ac, disable_tqdm=True,
                              dataloader_num_workers=0)
    Trainer(model=model, args=targs, train_dataset=data, callbacks=[Measure()]).train()
    return peak["bytes"]


def fits(side: str, batch: int, args) -> tuple[bool, float]:
    cmd = [sys.executable, __file__, "--trial", side, "--batch", str(batch), "--seq", str(args.seq),
           "--precision", args.precision, "--data", args.data] + (["--ac"] if args.ac else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PEAK ")]
    if not lines:  # out of memory (CUDA OOM or the OS killing the trial) counts as not fitting
        return False, float("nan")
    peak = int(lines[0][5:]) / 2**30
    return peak <= args.budget_gb, peak


def search(side: str, args) -> dict:
    trials, lo, hi, batch = {}, 0, None, 1
    while hi is None:  # doubling
        ok, trials[batch] = fits(side, batch, args)
        if ok:
            lo, batch = batch, batch * 2
        else:
            hi = batch
        if batch > args.max_batch:
            hi = batch
    while hi - lo > 1:  # bisection
        mid = (lo + hi) // 2
        ok, trials[mid] = fits(side, mid, args)
        lo, hi = (mid, hi) if ok else (lo, mid)
    return {"max_batch": lo, "peak_gb_by_batch": {str(k): round(v, 3) for k, v in sorted(trials.items())}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trial", choices=["shardlm", "hf"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--budget-gb", type=float, default=6.0)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--ac", action="store_true", help="activation checkpointing on both sides")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "wikitext-2" / "train.txt"))
    args = p.parse_args()
    if args.trial:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        peak = trial_shardlm(args) if args.trial == "shardlm" else trial_hf(args)
        print(f"PEAK {peak}", flush=True)
        return
    import torch

    ours, theirs = search("shardlm", args), search("hf", args)
    print(json.dumps({
        "benchmark": "max_batch", "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__, "command": " ".join(["python", *sys.argv]), "model": "gpt2-124M",
        "seq": args.seq, "precision": args.precision, "budget_gb": args.budget_gb, "activation_checkpointing": args.ac,
        "shardlm": ours, "hf_trainer": theirs,
        "max_batch_ratio": ours["max_batch"] / max(1, theirs["max_batch"]),
    }))


if __name__ == "__main__":
    main()

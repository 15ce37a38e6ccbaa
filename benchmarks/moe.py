"""A mixture of experts against a dense model of the same active size, both trained by `shardlm train` on CPU:
the router's auxiliary loss and expert load over the run, the measured step peak, tokens/s and the loss.

    python benchmarks/moe.py [--steps 60] [--out benchmarks/results/moe_cpu.json]

MoE: Mixtral-style, 4 layers x 256 wide, 8 experts of 512, top-2, `router_aux_loss_coef` 0.02 (Mixtral's),
`output_router_logits: true` so the loss is the model's own with the router term. Dense: Llama-style, the same
attention and width, one MLP of 1024 (= 2 experts x 512: the same active MLP per token). Both from scratch on
the bundled Tiny Shakespeare, byte tokenizer, seq 128, batch 8, AdamW 3e-3, one process. The step peak is
`shardlm.observe.hardware.measure_step_peak` on a fresh trainer of each (CPU: parameters + optimizer state +
the step's RSS growth). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, cpu_name

COMMON = ["model.n_layer=4", "model.n_embd=256", "model.n_head=4", "model.tokenizer=bytes", "data.train=shakespeare",
          "data.seq_len=128", "train.batch_size=8", "train.lr=3e-3", "train.warmup_steps=10", "train.eval_every=0",
          "train.log_every=10", "train.sample_tokens=0", "log.tensorboard=false", "log.progress=none",
          "checkpoint.save_final=false", "parallel.device=cpu"]
MOE = ["model.arch=mixtral", "model.intermediate_size=512",
       "model.config_overrides={num_local_experts: 8, num_experts_per_tok: 2, output_router_logits: true, "
       "router_aux_loss_coef: 0.02}"]
DENSE = ["model.arch=llama", "model.intermediate_size=1024"]


def train(name: str, extra: list[str], steps: int, root: Path) -> dict:
    out = root / name
    proc = subprocess.run([sys.executable, "-m", "shardlm", "train", *COMMON, *extra, f"train.max_steps={steps}",
                           f"out_dir={out}"], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r.get("split") == "train"]
    val = [r for r in records if r.get("split") == "val"][-1]
    header = next(x for x in proc.stdout.splitlines() if x.startswith("model:"))
    keep = ("step", "loss", "router_aux_loss", "expert_load_min", "expert_load_max", "expert_load_cv")
    return {"header": header, "val_loss": round(val["loss"], 4),
            "tokens_per_s": round(sum(r["tokens_per_s"] for r in train_records[1:]) / max(1, len(train_records) - 1)),
            "records": [{k: (round(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in keep if k in r}
                        for r in train_records]}


def step_peak(extra: list[str]) -> float:
    """GiB of one step's peak, in a process of its own."""
    code = ("import sys; from shardlm.config import load_config; from shardlm.training.trainer import Trainer; "
            "from shardlm.observe.hardware import measure_step_peak; "
            "t = Trainer.from_config(load_config(None, sys.argv[1:])); t.train_step(); "
            "print(measure_step_peak(t) / 2**30)")
    proc = subprocess.run([sys.executable, "-c", code, *COMMON, *extra, "out_dir=/tmp/shardlm-moe-peak"],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return round(float(proc.stdout.strip().splitlines()[-1]), 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: train(name, extra, a.steps, Path(tmp)) for name, extra in (("moe", MOE), ("dense", DENSE))}
    for name, extra in (("moe", MOE), ("dense", DENSE)):
        runs[name]["step_peak_gib"] = step_peak(extra)
    cpu = cpu_name()
    result = {"benchmark": "moe", "date": datetime.date.today().isoformat(), "device": f"{cpu} (CPU)",
              "torch": torch.__version__, "command": " ".join(["python", "benchmarks/moe.py", *sys.argv[1:]]),
              "moe": MOE, "dense": DENSE, "common": COMMON, "steps": a.steps, "runs": runs}
    line = json.dumps(result)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(line)


if __name__ == "__main__":
    main()

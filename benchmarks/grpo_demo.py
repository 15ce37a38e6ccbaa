"""The GRPO demo's effect, measured: greedy exact match on the 200 bundled held-out prompts (chat_tasks_heldout) of
the exported chat_tiny model before and after `shardlm train grpo_tiny`, per task and per prompt (a sign test on
the prompts that changed), with the run's curve of reward and held-out exact match against steps and the CPU
minutes it took. Prints one JSON object.

    python benchmarks/grpo_demo.py [--model runs/chat_tiny-hf] [--out benchmarks/results/grpo_demo.json]
                                   [--keep DIR] [key=value ...]

The flow is the one configs/grpo_tiny.yaml describes: `shardlm train chat_tiny && shardlm export runs/chat_tiny
runs/chat_tiny-hf` (not repeated here: --model names the export), then `shardlm train grpo_tiny
model.name=MODEL` (key=value arguments go to it, e.g. train.lr=1e-4 grpo.temperature=1.0), `shardlm export` of
that run. Before and after score the same greedy answers with shardlm's exact-match code
(shardlm.inference.exact_match, `shardlm eval --exact-match`'s rule), the task read from each prompt; the curve is
the run's own metrics.jsonl (train: the sampled reward of each step; val: the validation's greedy exact match on
the same 200 prompts, which configs/grpo_tiny.yaml sets as data.val).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import ROOT, children_cpu_s, cpu_name, emit, exact_rate, heldout_answers, per_task, shardlm, sign_test


def curve(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_keys = ("step", "reward", "rewards/exact_match/mean", "rewards/partial_match/mean", "frac_reward_zero_std",
                  "completions/mean_length", "entropy", "clip_ratio/region_mean", "kl", "grad_norm", "time_s")
    val_keys = ("step", "exact_match", "reward", "rewards/exact_match/mean", "rewards/partial_match/mean",
                "completions/mean_length")

    def pick(r: dict, keys: tuple[str, ...]) -> dict:
        return {k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in keys if k in r}

    return {"train": [pick(r, train_keys) for r in records if r.get("split") == "train"],
            "val": [pick(r, val_keys) for r in records if r.get("split") == "val"]}


def machine(load_before: list[float]) -> dict:
    import torch

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "load_average_at_start": load_before,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "runs" / "chat_tiny-hf"), help="the exported chat_tiny run")
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--keep", default=None, help="work in this folder and keep the run (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="key=value for the GRPO run (configs/grpo_tiny.yaml)")
    args = ap.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    model = Path(args.model).resolve()
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="shardlm-grpo-demo-") as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        before = heldout_answers(model, args.heldout)
        run = work / "grpo"
        cpu0, wall0 = children_cpu_s(), time.time()
        shardlm("train", "grpo_tiny", f"model.name={model}", f"out_dir={run}", "log.tensorboard=false",
                "log.progress=none", *args.overrides)
        train_wall, train_cpu = time.time() - wall0, children_cpu_s() - cpu0
        shardlm("export", str(run), str(work / "grpo-hf"))
        after = heldout_answers(work / "grpo-hf", args.heldout)
        config = yaml.safe_load((run / "config.yaml").read_text())
        points = curve(run)
    rate = exact_rate
    out = {"benchmark": "grpo_demo", "command": " ".join(["python", "benchmarks/grpo_demo.py", *sys.argv[1:]]),
           "config": "configs/grpo_tiny.yaml", "overrides": args.overrides, "model": str(model),
           "settings": {"train": {k: config["train"].get(k) for k in ("objective", "batch_size", "grad_accum",
                                                                       "max_steps", "lr", "schedule", "warmup_steps",
                                                                       "weight_decay", "beta1", "beta2", "grad_clip",
                                                                       "seed")},
                        "grpo": config["grpo"], "data": {k: config["data"][k] for k in ("train", "val", "seq_len")}},
           "train_wall_minutes": round(train_wall / 60, 1), "train_cpu_minutes": round(train_cpu / 60, 1),
           "wall_minutes": round((time.time() - began) / 60, 1),
           "before": {"exact_match": rate(before), "per_task": per_task(before)},
           "after": {"exact_match": rate(after), "per_task": per_task(after)},
           "exact_match_gain": round(rate(after) - rate(before), 4), "sign_test": sign_test([before], [after]),
           "curve": points, "machine": machine(load_before),
           "note": "exact match: greedy answers to the first N prompts of chat_tasks_heldout (never trained on) equal "
                   "to the reference; before = the exported chat_tiny run GRPO starts from, after = the GRPO run's "
                   "export. curve.val[].exact_match is the run's own validation on the same prompts"}
    emit(out, args.out)


if __name__ == "__main__":
    main()

"""The preference demo's effect, measured: exact match on the bundled held-out prompts (chat_tasks_heldout) of
the instruction-tuned chat demo model before and after preference tuning (configs/dpo_tiny.yaml) on pairs of its
own answers. Prints one JSON object.

    python benchmarks/dpo_demo.py [--sft-run runs/chat_tiny] [--pairs onpolicy|bundled|DIR] [--samples 16]
                                  [--heldout 200] [--out benchmarks/results/dpo_demo.json] [--keep DIR] [key=value ...]

The flow is the one configs/dpo_tiny.yaml describes: `shardlm train chat_tiny` (skipped with --sft-run),
`shardlm export SFT SFT-hf`, `python benchmarks/dpo_pairs.py SFT-hf PAIRS` (on-policy pairs: the SFT model's
own right answer chosen, its own wrong answer rejected; --pairs DIR trains on pairs already made there, --pairs
bundled on the bundled near-miss pairs chat_pairs), then `shardlm train dpo_tiny model.name=SFT-hf
data.train=PAIRS/pairs_train.jsonl data.val=PAIRS/pairs_val.jsonl`;
key=value arguments go to that last command (e.g. train.objective=dpo train.lr=1e-4). "Before" is `shardlm eval
SFT data.val=chat_tasks_heldout --exact-match N`, "after" the same on the tuned run; the per-task counts score
the same greedy answers of each run's export (shardlm's exact-match code, the task read from the prompt);
rewards/accuracy and the validation loss come from the tuned run's metrics.jsonl. Every run and score is a real
shardlm command or shardlm's own code.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import ROOT, cpu_name, emit, heldout_answers, per_task


def python(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"python {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def shardlm(*args: str) -> str:
    return python("-m", "shardlm", *args)


def run(config: str, out: Path, extra: list[str]) -> float:
    began = time.time()
    shardlm("train", config, f"out_dir={out}", "log.tensorboard=false", "log.progress=none", *extra)
    return round(time.time() - began, 1)


def exact_match(path: Path, export: Path, heldout: int) -> dict:
    """`shardlm eval RUN --exact-match N`, and the right answers per task of the run's export (same prompts,
    same greedy answers and rule: shardlm.inference.exact_match)."""
    result = json.loads(shardlm("eval", str(path), "data.val=chat_tasks_heldout", "--exact-match", str(heldout)))
    return {"exact_match": result["exact_match"], "exact_match_n": result["exact_match_n"],
            "heldout_answer_loss": result["loss"], "per_task": per_task(heldout_answers(export, heldout))}


def machine() -> dict:
    import torch

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-run", default=None, help="reuse this chat_tiny run dir instead of training one")
    ap.add_argument("--pairs", default="onpolicy",
                    help="onpolicy: sample them from the SFT export (benchmarks/dpo_pairs.py); bundled: chat_pairs; "
                         "or a folder holding pairs_train.jsonl and pairs_val.jsonl")
    ap.add_argument("--samples", type=int, default=16, help="onpolicy: sampled answers per prompt")
    ap.add_argument("--pair-prompts", type=int, default=3000, help="onpolicy: first N conversations of train.jsonl")
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--keep", default=None, help="work in this folder and keep the runs (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="key=value for the DPO run (configs/dpo_tiny.yaml)")
    args = ap.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="shardlm-dpo-demo-") as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        sft_seconds = None
        if args.sft_run:
            sft = Path(args.sft_run).resolve()
        else:
            sft = work / "sft"
            sft_seconds = run("chat_tiny", sft, [])
        export = work / "sft-hf"
        shardlm("export", str(sft), str(export))
        before = exact_match(sft, export, args.heldout)
        pairs_seconds, pairs_stats = None, None
        if args.pairs == "bundled":
            data = ["data.train=chat_pairs", "data.val=chat_pairs_val", "model.chat_template=chatml"]
        else:
            folder = work / "pairs" if args.pairs == "onpolicy" else Path(args.pairs).resolve()
            if args.pairs == "onpolicy":
                began_pairs = time.time()
                python("benchmarks/dpo_pairs.py", str(export), str(folder), "--samples", str(args.samples),
                       "--train", str(args.pair_prompts), "--heldout", str(args.heldout))
                pairs_seconds = round(time.time() - began_pairs, 1)
            if (folder / "pairs_stats.json").exists():
                pairs_stats = json.loads((folder / "pairs_stats.json").read_text())
            data = [f"data.train={folder / 'pairs_train.jsonl'}", f"data.val={folder / 'pairs_val.jsonl'}"]
        dpo = work / "dpo"
        dpo_seconds = run("dpo_tiny", dpo, [f"model.name={export}", *data, *args.overrides])
        shardlm("export", str(dpo), str(work / "dpo-hf"))
        after = exact_match(dpo, work / "dpo-hf", args.heldout)
        records = [json.loads(line) for line in (dpo / "metrics.jsonl").read_text().splitlines()]
        config = yaml.safe_load((dpo / "config.yaml").read_text())
    train = [r for r in records if r.get("split") == "train"]
    val = [r for r in records if r.get("split") == "val"]
    keep = ("step", "loss", "rewards/accuracy", "rewards/margin", "rewards/chosen", "rewards/rejected")

    def pick(r: dict) -> dict:
        return {k: r[k] for k in keep if k in r}

    settings = {"train": {k: config["train"][k] for k in ("objective", "batch_size", "max_steps", "lr", "warmup_steps",
                                                          "weight_decay", "min_lr_ratio", "seed")},
                "preference": config["preference"], "data": {k: config["data"][k] for k in ("train", "val", "seq_len")}}
    out = {"benchmark": "dpo_demo", "command": " ".join(["python", "benchmarks/dpo_demo.py", *sys.argv[1:]]),
           "configs": ["configs/chat_tiny.yaml", "configs/dpo_tiny.yaml"],
           "sft_run": "trained here" if sft_seconds is not None else str(args.sft_run),
           "sft_train_seconds": sft_seconds,
           "pairs": args.pairs, "pairs_seconds": pairs_seconds, "pairs_stats": pairs_stats,
           "dpo_overrides": args.overrides, "dpo_settings": settings, "dpo_train_seconds": dpo_seconds,
           "wall_seconds": round(time.time() - began, 1),
           "before": before, "after": after,
           "exact_match_gain": round(after["exact_match"] - before["exact_match"], 4),
           "dpo_val": [pick(r) for r in val], "dpo_final_val_loss": val[-1]["loss"] if val else None,
           "dpo_final_val_rewards_accuracy": val[-1].get("rewards/accuracy") if val else None,
           "dpo_last_train": pick(train[-1]) if train else None,
           "machine": {**machine(), "load_average_at_start": load_before},
           "note": "exact match: greedy answers to the first N prompts of chat_tasks_heldout (never trained on, no "
                   "pair made from them) equal to the reference; before = the instruction-tuned chat_tiny run that "
                   "DPO starts from, after = the DPO run. rewards/* are the DPO run's own validation records on its "
                   "validation pairs (beta-scaled log-ratio to the reference, the SFT model)"}
    emit(out, args.out)


if __name__ == "__main__":
    main()

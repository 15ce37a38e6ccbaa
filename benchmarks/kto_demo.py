"""The KTO demo's effect, measured: exact match on the bundled held-out prompts (chat_tasks_heldout) of the
instruction-tuned chat demo model before and after KTO on its own answers, each labelled right or wrong by exact
match (a thumbs up or down). Prints one JSON object.

    python benchmarks/kto_demo.py [--sft-run runs/chat_tiny] [--labels DIR] [--samples 4] [--label-prompts 3000]
                                  [--desirable-weight balance|W] [--heldout 200] [--keep DIR]
                                  [--out benchmarks/results/kto_demo.json] [key=value ...]

dpo_demo.py's flow with KTO records in place of pairs: `shardlm train chat_tiny` (skipped with --sft-run),
`shardlm export SFT SFT-hf`, `python benchmarks/kto_labels.py SFT-hf LABELS` (the SFT model's greedy answer and
--samples answers at temperature 1 to each of the first --label-prompts chat_tasks training prompts, labelled
desirable when right; --labels DIR trains on labels already made there), then `shardlm train dpo_tiny
model.name=SFT-hf train.objective=kto data.train=LABELS/kto_train.jsonl data.val=LABELS/kto_val.jsonl
preference.desirable_weight=W`. W is by default undesirable / desirable of the training records (the KTO paper's
w_d x n_d / (w_u x n_u) = 1; TRL warns outside 1 to 4/3); --desirable-weight 1 is TRL's default. key=value
arguments go last to that command (e.g. train.lr=1e-4). "Before" and "after" are `shardlm eval RUN
data.val=chat_tasks_heldout --exact-match N` of the SFT and the KTO run, the per-task counts and the prompts
gained and lost (sign test) the same greedy answers of each run's export by shardlm's exact-match code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import emit, heldout_answers, sign_test
from dpo_demo import exact_match, machine, python, run, shardlm

KEEP = ("step", "loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-run", default=None, help="reuse this chat_tiny run dir instead of training one")
    ap.add_argument("--labels", default=None, help="a folder holding kto_train.jsonl and kto_val.jsonl (default: "
                                                   "make them from the SFT export with benchmarks/kto_labels.py)")
    ap.add_argument("--samples", type=int, default=4, help="sampled answers per prompt besides the greedy one")
    ap.add_argument("--label-prompts", type=int, default=3000, help="first N conversations of train.jsonl")
    ap.add_argument("--desirable-weight", default="balance",
                    help="preference.desirable_weight: balance (undesirable / desirable records) or a number")
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--keep", default=None, help="work in this folder and keep the runs (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="key=value for the KTO run (configs/dpo_tiny.yaml's settings)")
    args = ap.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="shardlm-kto-demo-") as tmp:
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
        labels, labels_seconds = Path(args.labels or work / "labels").resolve(), None
        if not args.labels:
            began_labels = time.time()
            python("benchmarks/kto_labels.py", str(export), str(labels), "--samples", str(args.samples),
                   "--train", str(args.label_prompts))
            labels_seconds = round(time.time() - began_labels, 1)
        stats = json.loads((labels / "kto_stats.json").read_text()) if (labels / "kto_stats.json").exists() else None
        records = [json.loads(line) for line in (labels / "kto_train.jsonl").read_text().splitlines()]
        desirable = sum(r["label"] for r in records)
        weight = (round((len(records) - desirable) / max(desirable, 1), 2) if args.desirable_weight == "balance"
                  else float(args.desirable_weight))
        kto = work / "kto"
        kto_seconds = run("dpo_tiny", kto, [f"model.name={export}", "train.objective=kto",
                                            f"data.train={labels / 'kto_train.jsonl'}",
                                            f"data.val={labels / 'kto_val.jsonl'}",
                                            f"preference.desirable_weight={weight}", *args.overrides])
        shardlm("export", str(kto), str(work / "kto-hf"))
        after = exact_match(kto, work / "kto-hf", args.heldout)
        paired = sign_test([heldout_answers(export, args.heldout)], [heldout_answers(work / "kto-hf", args.heldout)])
        metrics = [json.loads(line) for line in (kto / "metrics.jsonl").read_text().splitlines()]
        config = yaml.safe_load((kto / "config.yaml").read_text())
    val = [{k: r[k] for k in KEEP if k in r} for r in metrics if r.get("split") == "val"]
    train = [{k: r[k] for k in KEEP if k in r} for r in metrics if r.get("split") == "train"]
    settings = {"train": {k: config["train"][k] for k in ("objective", "batch_size", "max_steps", "lr", "warmup_steps",
                                                          "weight_decay", "min_lr_ratio", "seed")},
                "preference": {k: config["preference"][k] for k in ("beta", "desirable_weight", "undesirable_weight",
                                                                    "kto_loss_type", "reference")},
                "data": {k: config["data"][k] for k in ("train", "val", "seq_len")}}
    out = {"benchmark": "kto_demo", "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(["python", "benchmarks/kto_demo.py", *sys.argv[1:]]),
           "configs": ["configs/chat_tiny.yaml", "configs/dpo_tiny.yaml (train.objective=kto)"],
           "sft_run": "trained here" if sft_seconds is not None else str(args.sft_run),
           "sft_train_seconds": sft_seconds,
           "labels": str(args.labels or "made here"), "labels_seconds": labels_seconds,
           "train_records": {"desirable": desirable, "undesirable": len(records) - desirable},
           "labels_stats": stats, "kto_overrides": args.overrides, "kto_settings": settings,
           "kto_train_seconds": kto_seconds, "wall_seconds": round(time.time() - began, 1),
           "before": before, "after": after, "exact_match_gain": round(after["exact_match"] - before["exact_match"], 4),
           "paired_vs_before": paired, "kto_val": val, "kto_last_train": train[-1] if train else None,
           "machine": {**machine(), "load_average_at_start": load_before},
           "note": "exact match: greedy answers to the first N prompts of chat_tasks_heldout (never trained on, no "
                   "record made from them) equal to the reference; before = the instruction-tuned chat_tiny run KTO "
                   "starts from (also its reference model), after = the KTO run. kl, rewards/* are the KTO run's "
                   "records (TRL's: rewards/chosen = beta x log-ratio to the reference over the desirable examples, "
                   "rewards/rejected over the undesirable ones); paired_vs_before: held-out prompts right only "
                   "after (gained) and only before (lost), two-sided sign test"}
    emit(out, args.out)


if __name__ == "__main__":
    main()

"""The chat demo's effect, measured: exact match on the bundled held-out prompts (chat_tasks_heldout) before and
after instruction tuning (configs/chat_tiny.yaml), and answers-only loss vs whole-example loss
(data.train_on_prompt=true) at equal steps. Prints one JSON object.

    python benchmarks/chat_demo.py [--steps 600] [--heldout 200] [--out benchmarks/results/chat_demo.json]

"Before" is the same model as initialised (seeded as the run's): one step at lr 1e-9, since a run saves no
checkpoint at step 0. Each run is a real
`shardlm train`, each score a real `shardlm eval RUN data.val=chat_tasks_heldout --exact-match N`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, cpu_name, emit


def shardlm(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "shardlm", *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"shardlm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def train_and_score(out: Path, steps: int, heldout: int, extra: list[str]) -> dict:
    began = time.time()
    shardlm("train", "chat_tiny", f"out_dir={out}", f"train.max_steps={steps}", "log.tensorboard=false",
            "log.progress=none", *extra)
    seconds = time.time() - began
    # the answers' loss whatever the run trained on (a whole-example run's config says train_on_prompt=true)
    result = json.loads(shardlm("eval", str(out), "data.val=chat_tasks_heldout", "data.train_on_prompt=false",
                                "--exact-match", str(heldout)))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "val"]
    return {"steps": steps, "train_seconds": round(seconds, 1), "exact_match": result["exact_match"],
            "exact_match_n": result["exact_match_n"], "heldout_answer_loss": result["loss"],
            "final_val_loss_as_trained": val[-1]["loss"] if val else None, "examples": result["examples"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardlm-chat-demo-") as tmp:
        runs = {"before": train_and_score(Path(tmp) / "before", 1, args.heldout, ["train.lr=1e-9",
                                                                                  "train.warmup_steps=0"]),
                "answers_only": train_and_score(Path(tmp) / "answers", args.steps, args.heldout, []),
                "whole_example": train_and_score(Path(tmp) / "whole", args.steps, args.heldout,
                                                 ["data.train_on_prompt=true"])}
    cpu = cpu_name()
    import torch

    out = {"benchmark": "chat_demo", "config": "configs/chat_tiny.yaml", "machine": {
        "cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__}, **runs,
        "note": "exact match on chat_tasks_heldout (never trained on); heldout_answer_loss is the mean loss on the "
                "answer tokens of the held-out conversations, comparable between the runs; final_val_loss_as_trained "
                "is the run's own validation loss (all tokens for the whole-example run)"}
    emit(out, args.out)


if __name__ == "__main__":
    main()

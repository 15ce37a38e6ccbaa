"""The optimizers side by side in one run (issue 30): validation loss against steps for AdamW, Muon, 8-bit AdamW,
Adafactor and schedule-free AdamW on one small GPT from scratch, the same data order, token budget and schedule
shape; their optimizer-state bytes; and their step times, measured interleaved (one step of each in turn, so a
busy machine slows them alike).

    python benchmarks/optimizers.py --out benchmarks/results/optimizers_cpu.json   # ~10 min on 2 CPU cores
    shardlm plot /tmp/shardlm-optimizers/adamw /tmp/shardlm-optimizers/muon ...      # the curves together

Figures: the step at which each run's validation loss first reaches AdamW's final one (linear interpolation
between evaluations), as a share of AdamW's steps; final losses; state bytes (this process's, as held: 8-bit
codes with their scales); median step time and the optimizer step alone, each over AdamW's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, cpu_name

RUNS = {  # name: overrides (each optimizer at its usual learning rate; Adafactor's is relative to each weight's RMS)
    "adamw": ["train.optimizer=adamw"],
    "muon": ["train.optimizer=muon"],
    "adamw8bit": ["train.optimizer=adamw8bit"],
    "adafactor": ["train.optimizer=adafactor", "train.lr=1e-2"],
    "schedule_free_adamw": ["train.optimizer=schedule_free_adamw"],
}


def base(a: argparse.Namespace, out: Path) -> list[str]:
    layers, heads, width = (int(x) for x in a.size.split("x"))
    return [f"data.train={a.data}", f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={width}",
            "model.dropout=0.0", "model.vocab_multiple=64", f"data.seq_len={a.seq}", f"train.batch_size={a.batch}",
            f"train.max_steps={a.steps}",
            "train.lr=3e-3", f"train.warmup_steps={a.warmup}", f"train.eval_every={a.eval_every}",
            f"train.eval_batches={a.eval_batches}", "train.log_every=10", "train.sample_tokens=0",
            "log.tensorboard=false", "log.progress=none", "checkpoint.resume=none", "checkpoint.save_final=false",
            f"out_dir={out}"]


def steps_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which `curve` (step, val loss) reaches `target`, interpolated between evaluations."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:], strict=False):
        if l1 <= target:
            return s1 if l0 == l1 else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def train_one(a: argparse.Namespace, name: str) -> dict:
    """One run in-process: its validation curve from metrics.jsonl and its optimizer's state bytes."""
    from shardlm.config import load_config
    from shardlm.training.optim.optimizers import state_bytes
    from shardlm.training.trainer import Trainer

    out = Path(a.work) / name
    trainer = Trainer.from_config(load_config(None, [*base(a, out), *RUNS[name]]))
    began = time.perf_counter()
    summary = trainer.fit()
    wall = time.perf_counter() - began
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["loss"]) for r in records if r["split"] == "val"]
    return {"curve": curve, "final_val_loss": curve[-1][1], "state_bytes": state_bytes(trainer.run.optimizer),
            "wall_s": round(wall, 1), "steps": summary["steps"], "params": trainer.n_params}


def step_times(a: argparse.Namespace, rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds per training step and per optimizer step, the optimizers' steps taken in turn."""

    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    trainers = {name: Trainer.from_config(load_config(None, [*base(a, Path(a.work) / f"time-{name}"), *RUNS[name],
                                                             "train.eval_every=0"]))
                for name in RUNS}
    for t in trainers.values():  # warm up (torchao compiles its update on the first step)
        for _ in range(3):
            t.train_step()
    whole: dict[str, list[float]] = {n: [] for n in RUNS}
    opt: dict[str, list[float]] = {n: [] for n in RUNS}
    for _ in range(rounds):
        for name, t in trainers.items():
            began = time.perf_counter()
            t.train_step()
            whole[name].append(time.perf_counter() - began)
            # the optimizer step alone, on the gradients of one more backward
            t.model.train()
            batch = t.train_batch(0)
            t.forward_backward_step(batch)
            began = time.perf_counter()
            t.run.optimizer.step()
            opt[name].append(time.perf_counter() - began)
            t.run.optimizer.zero_grad(set_to_none=True)
    return {n: {"step_s": statistics.median(whole[n]), "optimizer_step_s": statistics.median(opt[n])} for n in RUNS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="4x4x128", help="LAYERSxHEADSxWIDTH of the GPT (byte vocabulary)")
    p.add_argument("--data", default="shakespeare")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--timing-rounds", type=int, default=20)
    p.add_argument("--work", default="/tmp/shardlm-optimizers", help="run folders (shardlm plot reads them)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    import torch

    runs = {name: train_one(a, name) for name in RUNS}
    times = step_times(a, a.timing_rounds)
    ref = runs["adamw"]
    target, ref_steps = ref["final_val_loss"], ref["curve"][-1][0]
    for name, r in runs.items():
        reached = steps_to(r["curve"], target)
        r["steps_to_adamw_final"] = None if reached is None else round(reached, 1)
        r["steps_ratio"] = None if reached is None else round(reached / ref_steps, 3)
        r["final_loss_vs_adamw"] = round(r["final_val_loss"] / target - 1, 4)
        r["state_ratio"] = round(r["state_bytes"] / ref["state_bytes"], 3)
        r.update({k: round(v, 4) for k, v in times[name].items()})
        r["step_time_vs_adamw"] = round(times[name]["step_s"] / times["adamw"]["step_s"], 3)
    result = {"benchmark": "optimizers", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "machine": cpu_name(), "threads": torch.get_num_threads(),
              "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "settings": {**{k: v for k, v in vars(a).items() if k not in ("out", "work")},
                           "base_overrides": base(a, Path(a.work) / "NAME"), "runs": RUNS},
              "plot": f"shardlm plot {' '.join(str(Path(a.work) / n) for n in RUNS)}", "runs": runs}
    line = json.dumps(result)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

"""The distillation demo's effect, measured: greedy exact match on the 200 bundled held-out prompts
(chat_tasks_heldout) of a 2-layer student distilled from the chat_tiny run (configs/distill_tiny.yaml) against the
same student trained by instruction tuning alone (the same config with train.objective=sft: same steps, lr, data,
seed, batch), per task and per prompt (a sign test on the prompts that changed), with the noise of a second seed and
a paired bootstrap over the prompts, and the CPU minutes each run took. Prints one JSON object.

    python benchmarks/distill_demo.py [--teacher runs/chat_tiny-hf] [--seeds 1337,1] [--out FILE]
                                      [--keep DIR] [key=value ...]

The flow is the one configs/distill_tiny.yaml describes: `shardlm train chat_tiny && shardlm export runs/chat_tiny
runs/chat_tiny-hf` (not repeated here unless --train-teacher CONFIG: --teacher names the export), then for each
seed `shardlm train distill_tiny distill.teacher=TEACHER train.seed=SEED` and the same with train.objective=sft
(key=value arguments go to both, e.g. train.max_steps=300; `distill.` keys only matter to the first), `shardlm
export` of each run. Every model (the teacher too) answers the same prompts greedily, scored with shardlm's
exact-match code (shardlm.inference.exact_match, `shardlm eval --exact-match`'s rule), the task read from each
prompt. With --keep, a run whose folder holds its cost.json (written after its export) is scored, not trained again:
`--arms sft` can train the baselines while the teacher is still training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import ROOT, children_cpu_s, cpu_name, emit, exact_rate, heldout_answers, per_task, shardlm, sign_test


def bootstrap(base: list[list[dict]], new: list[list[dict]], draws: int = 10000) -> dict:
    """95% interval of the mean exact-match difference (new - base, averaged over the seeds), resampling the prompts
    (paired: a prompt's outcomes under every run move together)."""
    n = len(base[0])
    diff = [sum(ns[i]["exact"] - bs[i]["exact"] for bs, ns in zip(base, new, strict=True)) / len(base)
            for i in range(n)]
    rng = random.Random(0)
    means = sorted(sum(diff[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return {"low": round(means[int(0.025 * draws)], 4), "high": round(means[int(0.975 * draws)], 4), "draws": draws}


def val_records(run: Path) -> list[dict]:
    keys = ("step", "loss", "distill/loss", "distill/nll", "distill/teacher_entropy", "distill/student_entropy")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in keys if k in r}
            for r in records if r.get("split") == "val"]


def train_and_score(name: str, work: Path, heldout: int, overrides: list[str]) -> dict:
    """Train (unless --keep's folder holds this run complete, with its cost), export and score one student."""
    run, cost_file = work / name, work / name / "cost.json"
    if not cost_file.exists():
        cpu0, wall0 = children_cpu_s(), time.time()
        shardlm("train", "distill_tiny", f"out_dir={run}", "log.tensorboard=false", "log.progress=none",
                *overrides)
        cost = {"train_wall_minutes": round((time.time() - wall0) / 60, 2),
                "train_cpu_minutes": round((children_cpu_s() - cpu0) / 60, 2)}
        shardlm("export", str(run), str(work / f"{name}-hf"))
        cost_file.write_text(json.dumps(cost) + "\n")
    rows = heldout_answers(work / f"{name}-hf", heldout)
    return {"rows": rows, "exact_match": exact_rate(rows), "per_task": per_task(rows), "val": val_records(run),
            **json.loads(cost_file.read_text())}


def teacher_export(args: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    """The teacher's export, trained here first with --train-teacher CONFIG (e.g. chat_tiny)."""
    if not args.train_teacher:
        return Path(args.teacher).resolve(), {}
    cpu0, wall0 = children_cpu_s(), time.time()
    shardlm("train", args.train_teacher, f"out_dir={work / 'teacher'}", "log.tensorboard=false", "log.progress=none")
    cost = {"train_wall_minutes": round((time.time() - wall0) / 60, 2),
            "train_cpu_minutes": round((children_cpu_s() - cpu0) / 60, 2)}
    shardlm("export", str(work / "teacher"), str(work / "teacher-hf"))
    return work / "teacher-hf", cost


def machine(load_before: list[float]) -> dict:
    import torch

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "load_average_at_start": load_before,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


def arm_summary(runs: list[dict]) -> dict:
    ems = [r["exact_match"] for r in runs]
    return {"exact_match_mean": round(sum(ems) / len(ems), 4), "exact_match_per_seed": ems,
            "per_task_per_seed": [r["per_task"] for r in runs], "val_per_seed": [r["val"] for r in runs],
            "train_cpu_minutes_per_seed": [r["train_cpu_minutes"] for r in runs],
            "train_wall_minutes_per_seed": [r["train_wall_minutes"] for r in runs]}


def report(args: argparse.Namespace, seeds: list[int], teacher: Path, teacher_rows: list[dict], teacher_cost: dict,
           distilled: list[dict], sft: list[dict], config: dict, began: float, load_before: list[float]) -> dict:
    d_rows, s_rows = [r["rows"] for r in distilled], [r["rows"] for r in sft]
    d_arm, s_arm = arm_summary(distilled), arm_summary(sft)
    spread = lambda arm: round(max(arm["exact_match_per_seed"]) - min(arm["exact_match_per_seed"]), 4)  # noqa: E731
    return {"benchmark": "distill_demo",
            "command": " ".join(["python", "benchmarks/distill_demo.py", *sys.argv[1:]]),
            "config": "configs/distill_tiny.yaml", "overrides": args.overrides, "init": args.init,
            "teacher": str(teacher),
            "seeds": seeds,
            "settings": {"model": {k: config["model"][k] for k in ("n_layer", "n_head", "n_embd")},
                         "train": {k: config["train"].get(k) for k in ("batch_size", "grad_accum", "max_steps", "lr",
                                                                        "schedule", "warmup_steps", "weight_decay")},
                         "distill": config["distill"],
                         "data": {k: config["data"][k] for k in ("train", "val", "seq_len")}},
            "teacher_model": {"exact_match": exact_rate(teacher_rows), "per_task": per_task(teacher_rows),
                              **teacher_cost},
            "distilled": d_arm, "sft_only": s_arm,
            "exact_match_gain": round(d_arm["exact_match_mean"] - s_arm["exact_match_mean"], 4),
            "gain_per_seed": [round(d["exact_match"] - s["exact_match"], 4)
                              for d, s in zip(distilled, sft, strict=True)],
            "sign_test": sign_test(s_rows, d_rows), "bootstrap_95": bootstrap(s_rows, d_rows),
            "seed_spread": {"distilled": spread(d_arm), "sft_only": spread(s_arm)},
            "wall_minutes": round((time.time() - began) / 60, 1), "machine": machine(load_before),
            "note": "exact match: greedy answers to the first N prompts of chat_tasks_heldout (never trained on) "
                    "equal to the reference. distilled = configs/distill_tiny.yaml, sft_only = the same with "
                    "train.objective=sft, per seed the same init, data order, steps and lr. sign_test pools the "
                    "seeds' pairs (a prompt counted once per seed); bootstrap_95 resamples prompts for the mean "
                    "gain; seed_spread is the max - min exact match of an arm over the seeds"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default=str(ROOT / "runs" / "chat_tiny-hf"), help="the exported teacher run")
    ap.add_argument("--train-teacher", default=None, metavar="CONFIG", help="train and export this config first "
                    "(e.g. chat_tiny) and distill from it")
    ap.add_argument("--seeds", default="1337,1", help="train.seed of each pair of runs (comma-separated)")
    ap.add_argument("--arms", default="distill,sft", help="sft alone trains the baselines only (with --keep, a "
                    "later run of both reuses them: a run folder holding cost.json is not trained again)")
    ap.add_argument("--init", default=None, metavar="PATTERN", help="both students start from this export instead "
                    "of random weights, {seed} replaced by the seed (e.g. a first phase's sft-{seed}-hf: GKD distils "
                    "an instruction-tuned student, and the baseline then continues by sft for the same steps)")
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--keep", default=None, help="work in this folder and keep the runs (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="key=value for both students' runs (configs/distill_tiny.yaml)")
    args = ap.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    began = time.time()
    seeds, arms = [int(s) for s in args.seeds.split(",")], args.arms.split(",")
    with tempfile.TemporaryDirectory(prefix="shardlm-distill-demo-") as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        runs: dict[str, list[dict]] = {"distill": [], "sft": []}
        teacher, teacher_cost = Path(args.teacher).resolve(), {}
        if "distill" in arms:
            teacher, teacher_cost = teacher_export(args, work)
        for seed in seeds:
            common = [f"distill.teacher={teacher}", f"train.seed={seed}", *args.overrides]
            if args.init:
                common.insert(0, f"model.name={Path(args.init.format(seed=seed)).resolve()}")
            if "distill" in arms:
                runs["distill"].append(train_and_score(f"distill-{seed}", work, args.heldout, common))
            if "sft" in arms:
                runs["sft"].append(train_and_score(f"sft-{seed}", work, args.heldout,
                                                   [*common, "train.objective=sft"]))
        if arms != ["distill", "sft"]:
            out: dict = {arm: [{k: v for k, v in r.items() if k != "rows"} for r in rs] for arm, rs in runs.items()}
        else:
            config = yaml.safe_load((work / f"distill-{seeds[0]}" / "config.yaml").read_text())
            out = report(args, seeds, teacher, heldout_answers(teacher, args.heldout), teacher_cost, runs["distill"],
                         runs["sft"], config, began, load_before)
    emit(out, args.out)


if __name__ == "__main__":
    main()

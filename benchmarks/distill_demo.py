"""What distillation is for, measured: a student with a few labels and many prompts nobody labelled, which a teacher
answers. Greedy accuracy on held-out prompts of a 2-layer student distilled from the RL demo's teacher (offline on
stored top-K scores, and on-policy in GKD's order) against the same student instruction-tuned on the labels alone,
at equal student steps, over three seeds, with a sign test. `make demo-distill` runs it; its last line is one JSON
object.

    python benchmarks/distill_demo.py [--work runs/sort] [--seeds 0,1,2] [--labelled 200] [--out FILE]
                                      [--data-only] [key=value ...]

The task is the RL demo's (benchmarks/grpo_demo.py, `make demo-rl`): sort 13 distinct letters. Its GRPO'd model,
--work/grpo-hf, is the teacher: it sorts the held-out 13-letter strings without a miss. The student's data:
- the labels: --labelled examples drawn from the RL demo's corpus (strings of 2 to 12 letters, "s>" then sorted s;
  another sample for each seed);
- the prompts nobody labelled: the RL demo's 4,000 13-letter prompts (none of them held out), answered by the
  teacher (greedy).
Arms, each trained from random weights for distill_tiny's train.max_steps (student steps are equal):
- sft: instruction tuning on the labels alone (the baseline);
- distilled: configs/distill_tiny.yaml: the labels and the teacher's answers, the loss half forward KL to the
  teacher's stored top-16 and half next-token loss;
- teacher_answers: sft on the same examples (the teacher's answers as hard labels: what the soft targets add);
- on_policy: GKD's order: sft on the labels for half the steps (warm), then the other half on the student's own
  samples of the unlabelled prompts, scored by the live teacher (distill.on_policy=1, forward KL).
Every export answers the held-out prompts greedily, scored by the RL demo's rule (exact match after trimming).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from common import ROOT, children_cpu_s, cpu_name, emit, shardlm, sign_test
from grpo_demo import answers, greedy, rate

from shardlm.config import load_config

ARMS = ("sft", "distilled", "teacher_answers", "warm", "on_policy")  # the runs each seed trains into --work/distill


def labelled(work: Path, seed: int, n: int) -> list[dict]:
    """`n` examples of the RL demo's corpus (its held-out strings are not in it), a sample of its own per seed."""
    lines = (work / "corpus.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in random.Random(seed).sample(lines, n)]
    return [{"prompt": f"{t.split('>')[0]}>", "completion": t.split(">")[1]} for t in texts]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_data(work: Path, seeds: list[int], n: int, said: list[str]) -> None:
    """--work/distill: heldout.jsonl (the held-out prompts as examples: the runs' validation), unlabelled.jsonl
    (the RL prompts, each with `said`'s answer: the teacher's), labelled-SEED.jsonl and taught-SEED.jsonl (those
    labels and the teacher's answers, shuffled) per seed."""
    folder = work / "distill"
    folder.mkdir(parents=True, exist_ok=True)
    held = [json.loads(line) for line in (work / "heldout.jsonl").read_text().splitlines()]
    write_jsonl(folder / "heldout.jsonl", [{"prompt": r["prompt"], "completion": r["answer"]} for r in held])
    prompts = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
    taught = [{"prompt": r["prompt"], "completion": a} for r, a in zip(prompts, said, strict=True)]
    write_jsonl(folder / "unlabelled.jsonl", taught)
    for seed in seeds:
        labels = labelled(work, seed, n)
        write_jsonl(folder / f"labelled-{seed}.jsonl", labels)
        mixed = labels + taught
        random.Random(seed).shuffle(mixed)
        write_jsonl(folder / f"taught-{seed}.jsonl", mixed)


def teacher_says(work: Path, teacher: Path) -> list[str]:
    """The teacher's greedy answer to each RL prompt (prompts.jsonl)."""
    prompts = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
    return [a[0] for a in answers(teacher, prompts)]


def train(folder: Path, name: str, *overrides: str) -> float:
    """`shardlm train distill_tiny` into folder/name with the overrides, exported to folder/name-hf; its CPU
    seconds."""
    before = children_cpu_s()
    shardlm("train", "distill_tiny", f"out_dir={folder / name}", f"data.val={folder / 'heldout.jsonl'}",
            "log.tensorboard=false", "log.progress=none", *overrides)
    shardlm("export", str(folder / name), str(folder / f"{name}-hf"))
    return children_cpu_s() - before


def seed_runs(folder: Path, teacher: Path, seed: int, steps: int, overrides: list[str]) -> dict[str, float]:
    """The arms of one seed; each one's CPU seconds."""
    common = [f"train.seed={seed}", f"distill.teacher={teacher}", *overrides]
    labels, taught = f"data.train={folder / f'labelled-{seed}.jsonl'}", f"data.train={folder / f'taught-{seed}.jsonl'}"
    cpu = {"sft": train(folder, f"sft-{seed}", labels, "train.objective=sft", *common),
           "distilled": train(folder, f"distilled-{seed}", taught, *common),
           "teacher_answers": train(folder, f"teacher_answers-{seed}", taught, "train.objective=sft", *common),
           "warm": train(folder, f"warm-{seed}", labels, "train.objective=sft", f"train.max_steps={steps // 2}",
                         *common)}
    cpu["on_policy"] = train(folder, f"on_policy-{seed}", f"model.name={folder / f'warm-{seed}-hf'}",
                             f"data.train={folder / 'unlabelled.jsonl'}", f"train.max_steps={steps - steps // 2}",
                             "distill.on_policy=1", "distill.alpha=1", "distill.teacher_topk=0",
                             "distill.max_new_tokens=16", *common)
    return cpu


def curve(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "val_loss": round(r["loss"], 4)} for r in records if r.get("split") == "val"]


def arm(folder: Path, name: str, seeds: list[int], rows: list[dict], cpu: list[dict]) -> dict:
    scored = [greedy(folder / f"{name}-{seed}-hf", rows) for seed in seeds]
    rates = [rate(s) for s in scored]
    return {"mean": round(sum(rates) / len(rates), 4), "per_seed": rates, "spread": round(max(rates) - min(rates), 4),
            "cpu_minutes_per_seed": [round(c[name] / 60, 2) for c in cpu],
            "val_loss_curve": curve(folder / f"{name}-{seeds[0]}"), "rows": scored}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(ROOT / "runs" / "sort"), help="the RL demo's folder (its data, its "
                    "grpo-hf teacher); the runs go to its distill/")
    ap.add_argument("--seeds", default="0,1,2", help="each seed: a labelled sample, train.seed of every arm")
    ap.add_argument("--labelled", type=int, default=200, help="labelled examples a seed draws from the corpus")
    ap.add_argument("--data-only", action="store_true", help="write --work/distill's data (the recipe's) and stop")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="key=value for every arm (configs/distill_tiny.yaml)")
    args = ap.parse_args()
    work, seeds = Path(args.work).resolve(), [int(s) for s in args.seeds.split(",")]
    folder, teacher = work / "distill", work / "grpo-hf"
    if not teacher.is_dir():
        raise SystemExit(f"{teacher} does not exist: the teacher is the RL demo's model. Run `make demo-rl` (or "
                         f"python benchmarks/grpo_demo.py --work {work}) first.")
    made = [f"{name}-{seed}" for name in ARMS for seed in seeds if (folder / f"{name}-{seed}").exists()]
    if made and not args.data_only:  # `shardlm train` into a finished run trains nothing: the CPU times would be 0
        raise SystemExit(f"{folder} already holds this demo's runs ({', '.join(made)}): remove them (rm -r "
                         f"{' '.join(str(folder / m) + '*' for m in made)}) or give another --work folder.")
    began = time.time()
    write_data(work, seeds, args.labelled, teacher_says(work, teacher))
    if args.data_only:
        print(f"wrote {folder}/heldout.jsonl, unlabelled.jsonl, labelled-SEED.jsonl and taught-SEED.jsonl "
              f"(seeds {args.seeds})")
        return
    steps = load_config("distill_tiny", args.overrides).train.max_steps
    cpu = [seed_runs(folder, teacher, seed, steps, args.overrides) for seed in seeds]
    rows = [json.loads(line) for line in (work / "heldout.jsonl").read_text().splitlines()]
    arms = {name: arm(folder, name, seeds, rows, cpu) for name in ARMS}
    tests = {name: sign_test(arms["sft"]["rows"], arms[name]["rows"]) for name in ARMS if name != "sft"}
    import torch

    out = {"benchmark": "distill_demo", "command": " ".join(["python", "benchmarks/distill_demo.py", *sys.argv[1:]]),
           "seeds": seeds, "labelled": args.labelled, "heldout": len(rows), "steps": steps,
           "sft": arms["sft"]["mean"], "distilled": arms["distilled"]["mean"], "p": tests["distilled"]["p_two_sided"],
           "on_policy": arms["on_policy"]["mean"], "p_on_policy": tests["on_policy"]["p_two_sided"],
           "teacher_answers": arms["teacher_answers"]["mean"], "teacher": rate(greedy(teacher, rows)),
           "arms": {name: {k: v for k, v in a.items() if k != "rows"} for name, a in arms.items()},
           "sign_tests_vs_sft": tests, "wall_minutes": round((time.time() - began) / 60, 1),
           "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__},
           "note": "greedy exact match on the RL demo's held-out 13-letter strings (no run trained on them); every "
                   f"arm {steps} student steps from random weights (on_policy: {steps // 2} of sft on the labels, "
                   "the warm arm, then the rest on its own samples); the sign tests pool the seeds' prompts against "
                   "sft's; spread = max - min over the seeds"}
    emit(out, args.out, compact=True)


if __name__ == "__main__":
    main()

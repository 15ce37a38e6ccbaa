"""What online RL is for, measured end to end: pretrain a tiny base on a generated corpus that holds a skill, then
GRPO on prompts a step beyond the corpus, scored only by a reward; held-out greedy accuracy before and after, the
base's pass@k, a control that continues pretraining for the same CPU time, a sign test. `make demo-rl` runs it;
its last line is one JSON object.

    python benchmarks/grpo_demo.py [--work runs/sort] [--seed 0] [--out FILE] [--data-only] [key=value ...]

The task: sort distinct letters ("qzbe>beqz"). The corpus holds strings of 2 to 12 letters, the longest rarer;
RL asks for 13, a length the base never saw, which it sorts right a quarter of the time (greedy) and more often
among samples. A hash of each string (salted by --seed) puts a tenth of all strings in the held-out split: none of
them is in the corpus or the RL prompts, so another --seed is another corpus and another held-out split.

The flow is the recipes' (configs/sort_tiny.yaml, configs/grpo_tiny.yaml): write runs/sort/*.jsonl, `shardlm
train sort_tiny`, export, `shardlm train grpo_tiny` (key=value arguments go to it) and, for the control, `shardlm
train sort_tiny` again from the export at the pretraining's final learning rate for as many steps as fit in the
RL run's CPU seconds. Greedy and sampled answers are scored here, by the reward's rule (exact match after
trimming), on all the held-out prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import string
import sys
import time
from pathlib import Path

from common import ROOT, children_cpu_s, cpu_name, emit, exact_rate, shardlm, sign_test

from shardlm.config import load_config

LENGTHS = {n: 1.0 for n in range(2, 11)} | {11: 0.3, 12: 0.15}  # the corpus's string lengths and their weights
ASKED = 13  # the length RL and the held-out prompts ask for
RUNS = ("base", "grpo", "control", "chat-sft", "chat-grpo")  # the runs a demo trains into --work
CHAT_SFT = 10  # --chat: the longest string its instruction tuning shows (with 12, it sorts 13 at 0.94 before RL)


def held_out(s: str, seed: int) -> bool:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{s}".encode(), digest_size=4).digest(), "little") % 10 == 0


def write_task(folder: Path, seed: int, documents: int = 150_000, prompts: int = 4000, heldout: int = 400) -> None:
    """corpus.jsonl (text documents "s>sorted(s)"), prompts.jsonl and heldout.jsonl ({"prompt", "answer"})."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    lengths, weights = list(LENGTHS), list(LENGTHS.values())
    with open(folder / "corpus.jsonl", "w") as f, open(folder / "chat_sft.jsonl", "w") as chat_sft:
        written = 0
        while written < documents:
            s = "".join(rng.sample(string.ascii_lowercase, rng.choices(lengths, weights)[0]))
            if not held_out(s, seed):
                f.write(json.dumps({"text": f"{s}>{''.join(sorted(s))}"}) + "\n")
                written += 1
                if len(s) <= CHAT_SFT:  # the chat flow's instruction tuning: the corpus's shorter strings, asked
                    turns = [*ask(s), {"role": "assistant", "content": "".join(sorted(s))}]
                    chat_sft.write(json.dumps({"messages": turns}) + "\n")
    train: list[dict] = []
    held: list[dict] = []
    while len(train) < prompts or len(held) < heldout:
        s = "".join(rng.sample(string.ascii_lowercase, ASKED))
        into, cap = (held, heldout) if held_out(s, seed) else (train, prompts)
        if len(into) < cap:
            into.append({"prompt": f"{s}>", "answer": "".join(sorted(s))})
    for name, rows in (("prompts.jsonl", train), ("heldout.jsonl", held)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        chat = [{"prompt": ask(r["prompt"][:-1]), "answer": r["answer"]} for r in rows]
        (folder / f"chat_{name}").write_text("".join(json.dumps(r) + "\n" for r in chat))


def ask(s: str) -> list[dict]:
    return [{"role": "user", "content": f"Sort: {s}"}]


def answers(export: Path, rows: list[dict], samples: int = 0) -> list[list[str]]:
    """Each prompt's greedy answer (samples=0), or `samples` answers at temperature 1, decoded and trimmed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardlm.tokenizer import end_of_turn_id

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    stops = [tok.eos_token_id, end_of_turn_id(tok)]  # a text answer ends at EOS, a chat answer at the turn's end
    torch.manual_seed(0)
    out = []
    with torch.no_grad():
        for start in range(0, len(rows), 100):  # the prompts are one length: batches need no padding
            ids = torch.tensor([prompt_ids(tok, r["prompt"]) for r in rows[start:start + 100]])
            n = max(samples, 1)
            ids = ids.repeat_interleave(n, 0)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ASKED + 2,
                                 do_sample=samples > 0, temperature=1.0 if samples else None,
                                 top_k=0 if samples else None,
                                 eos_token_id=stops, pad_token_id=tok.eos_token_id)
            texts = [t.strip() for t in tok.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)]
            out += [texts[i:i + n] for i in range(0, len(texts), n)]
    return out


def prompt_ids(tok, prompt: str | list[dict]) -> list[int]:
    """A text prompt's ids, or a conversation's through the tokenizer's chat template (as GRPO renders them)."""
    if isinstance(prompt, str):
        return tok(prompt)["input_ids"]
    return tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def greedy(export: Path, rows: list[dict]) -> list[dict]:
    return [{"exact": a[0] == r["answer"]} for a, r in zip(answers(export, rows), rows, strict=True)]


def pass_at_k(export: Path, rows: list[dict], n: int = 16) -> dict:
    """The unbiased pass@k of n samples a prompt (Chen et al. 2021), for k = 1, 2, 4, ..., n."""
    right = [sum(a == r["answer"] for a in got) for got, r in zip(answers(export, rows, n), rows, strict=True)]
    ks = [2**i for i in range(int(math.log2(n)) + 1)]
    return {f"pass@{k}": round(sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in right) / len(rows), 4)
            for k in ks}


def rate(rows: list[dict]) -> float:
    return round(exact_rate(rows), 4)


def curve(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keep = ("step", "reward", "frac_reward_zero_std", "entropy", "exact_match", "completions/mean_length")
    return {split: [{k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in keep if k in r}
                    for r in records if r.get("split") == split] for split in ("train", "val")}


def timed(*args: str) -> float:
    """Run `shardlm ARGS` and return the CPU seconds it took (its processes, all cores)."""
    before = children_cpu_s()
    shardlm(*args)
    return children_cpu_s() - before


def chat_flow(work: Path, seed: int, quiet: tuple[str, ...]) -> dict:
    """The same gain asked in ChatML: the base instruction-tuned on conversations of up to CHAT_SFT letters (the
    template's tokens have rows in the base: sort_tiny sets model.chat_template=chatml), then grpo_tiny on the
    same prompts as conversations; greedy exact match on the held-out ones before and after GRPO."""
    began = children_cpu_s()
    shardlm("train", "sort_tiny", f"model.name={work / 'base-hf'}", f"data.train={work / 'chat_sft.jsonl'}",
            "data.val=null", "train.objective=sft", "train.max_steps=300", "train.lr=1e-3", "train.warmup_steps=20",
            "train.eval_every=0", f"train.seed={seed}", f"out_dir={work / 'chat-sft'}", *quiet)
    shardlm("export", str(work / "chat-sft"), str(work / "chat-sft-hf"))
    shardlm("train", "grpo_tiny", f"model.name={work / 'chat-sft-hf'}", f"data.train={work / 'chat_prompts.jsonl'}",
            f"data.val={work / 'chat_heldout.jsonl'}", "data.seq_len=64", f"train.seed={seed}",
            f"out_dir={work / 'chat-grpo'}", *quiet)
    shardlm("export", str(work / "chat-grpo"), str(work / "chat-grpo-hf"))
    rows = [json.loads(line) for line in (work / "chat_heldout.jsonl").read_text().splitlines()]
    before, after = greedy(work / "chat-sft-hf", rows), greedy(work / "chat-grpo-hf", rows)
    return {"before": rate(before), "after": rate(after), "sign_test": sign_test([before], [after]),
            "base_pass_at_k": pass_at_k(work / "chat-sft-hf", rows),
            "cpu_minutes": round((children_cpu_s() - began) / 60, 2),
            "curve": curve(work / "chat-grpo"),
            "note": f"before = the base instruction-tuned 300 steps in ChatML on strings of up to {CHAT_SFT} letters, "
                    "after = GRPO from it asked in ChatML (grpo_tiny, data.seq_len=64)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(ROOT / "runs" / "sort"), help="the task's data and the runs go here")
    ap.add_argument("--seed", type=int, default=0, help="the generator's seed: another corpus and held-out split")
    ap.add_argument("--data-only", action="store_true", help="write the task's data (the recipes' runs/sort) and stop")
    ap.add_argument("--chat", action="store_true", help="then the chat flow: instruction-tune the base in ChatML on "
                    f"strings of up to {CHAT_SFT} letters, GRPO asked in ChatML")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="key=value for the GRPO run (configs/grpo_tiny.yaml)")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    made = [name for name in RUNS if (work / name).exists()]
    if made and not args.data_only:  # `shardlm train` into a finished run trains nothing: the CPU times would be 0
        raise SystemExit(f"{work} already holds this demo's runs ({', '.join(made)}): remove them (rm -r "
                         f"{' '.join(str(work / name) for name in made)}) or give another --work folder.")
    began = time.time()
    write_task(work, args.seed)
    if args.data_only:
        print(f"wrote {work}/corpus.jsonl, prompts.jsonl and heldout.jsonl (seed {args.seed})")
        return
    quiet = ("log.tensorboard=false", "log.progress=none")
    data = [f"data.train={work / 'prompts.jsonl'}", f"data.val={work / 'heldout.jsonl'}"]
    pre_cpu = timed("train", "sort_tiny", f"data.train={work / 'corpus.jsonl'}", f"out_dir={work / 'base'}",
                    f"train.seed={args.seed}", *quiet)
    shardlm("export", str(work / "base"), str(work / "base-hf"))
    rows = [json.loads(line) for line in (work / "heldout.jsonl").read_text().splitlines()]
    before, passes = greedy(work / "base-hf", rows), pass_at_k(work / "base-hf", rows)
    rl_cpu = timed("train", "grpo_tiny", f"model.name={work / 'base-hf'}", *data, f"out_dir={work / 'grpo'}",
                   f"train.seed={args.seed}", *quiet, *args.overrides)
    shardlm("export", str(work / "grpo"), str(work / "grpo-hf"))
    pretrain = load_config("sort_tiny").train
    steps = max(1, round(rl_cpu / (pre_cpu / pretrain.max_steps)))
    control_cpu = timed("train", "sort_tiny", f"model.name={work / 'base-hf'}", f"data.train={work / 'corpus.jsonl'}",
                        f"out_dir={work / 'control'}", f"train.max_steps={steps}", "train.warmup_steps=0",
                        f"train.lr={pretrain.lr * 0.1}", "train.schedule=constant", f"train.seed={args.seed + 1}",
                        "train.eval_every=0", *quiet)
    shardlm("export", str(work / "control"), str(work / "control-hf"))
    after, control = greedy(work / "grpo-hf", rows), greedy(work / "control-hf", rows)
    import torch

    chat = chat_flow(work, args.seed, quiet) if args.chat else None
    gain = sign_test([before], [after])
    out = {"benchmark": "grpo_demo", "command": " ".join(["python", "benchmarks/grpo_demo.py", *sys.argv[1:]]),
           "seed": args.seed, "heldout": len(rows), "before": rate(before), "after": rate(after),
           "p": gain["p_two_sided"], "sign_test": gain,
           "base_pass_at_k": passes, "control": rate(control),
           "control_sign_test": sign_test([before], [control]), "control_steps": steps,
           "cpu_minutes": {"pretraining": round(pre_cpu / 60, 2), "grpo": round(rl_cpu / 60, 2),
                           "control": round(control_cpu / 60, 2)},
           "wall_minutes": round((time.time() - began) / 60, 1), "curve": curve(work / "grpo"),
           "chat": chat, "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__},
           "note": "greedy exact match on the held-out 13-letter strings (no phase trained on them); before = the "
                   "pretrained base, after = GRPO's export, control = the base pretrained on for the GRPO run's CPU "
                   "seconds at the pretraining's final learning rate; base_pass_at_k: 16 samples a prompt at "
                   "temperature 1"}
    emit(out, args.out, compact=True)


if __name__ == "__main__":
    main()

"""On-policy preference pairs for the DPO demo: the instruction-tuned model's own right and wrong answers.

    python benchmarks/dpo_pairs.py MODEL_HF OUT_DIR [--samples 16] [--temperature 1.0] [--train N] [--val N]
                                   [--heldout N] [--seed 0]

MODEL_HF is an exported (Hugging Face) chat model, e.g. `shardlm export runs/chat_tiny runs/chat_tiny-hf`. For
each prompt of the bundled instruction data (chat_tasks `train.jsonl`, and `val.jsonl` for validation pairs: a
conversation's messages before its last assistant turn) the script takes the model's greedy answer and
`--samples` answers sampled at `--temperature`, and checks each as `shardlm eval --exact-match` does (the
answer equals the conversation's reference answer after trimming whitespace). Then, per prompt:

- chosen = the model's own right answer (a sample equal to the reference);
- rejected = the model's greedy answer when it is wrong, else its most frequent wrong sample;
- a prompt with no right sample, or no wrong one, gives no pair.

This is rejection-sampling ("best-of-n") DPO: the pairs move probability toward answers the model already
reaches sometimes and away from the ones it gives instead, so greedy accuracy (pass@1) moves toward pass@n.
It writes OUT_DIR/pairs_train.jsonl and OUT_DIR/pairs_val.jsonl (TRL's conversational preference format, as
the bundled chat_pairs), the answers they were drawn from (samples_train.jsonl, samples_val.jsonl) and
OUT_DIR/pairs_stats.json: counts, and pass@1 (greedy) and pass@n per task on the
training prompts and on the first `--heldout` held-out prompts (chat_tasks_heldout; scored, never paired),
which is the ceiling preference tuning on such pairs aims at.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from common import ROOT

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "shardlm" / "assets" / "chat_tasks"))
from make_pairs import parse  # noqa: E402  (the chat_tasks prompt -> task)

from shardlm.inference.exact_match import Scored  # noqa: E402  (the exact-match rule of `shardlm eval`)
from shardlm.inference.generate import generate_batch, pad_id  # noqa: E402
from shardlm.tokenizer import end_of_turn_id  # noqa: E402

TASKS_DIR = ROOT / "shardlm" / "assets" / "chat_tasks"
# chat_tiny's ChatML without the newline after the last answer's <|im_end|>: prompts render exactly as before
# (generation stops at <|im_end|>), but a pair's answers end at <|im_end|>. Under ChatML each answer also holds that
# newline, a token generation never reaches and the SFT model gives log-probability -8 to -17: it dominated the
# answers' scores, and the preference loss could move it instead of the answers (configs/dpo_tiny.yaml uses this)



def conversations(path: Path, n: int | None) -> list[tuple[list[dict], str, str]]:
    """(prompt messages, reference answer, task) of the first n conversations of a chat_tasks file."""
    out = []
    for line in path.read_text().splitlines()[:n]:
        messages = json.loads(line)["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out.append((messages[:last], messages[last]["content"], parse(messages[last - 1]["content"])[0]))
    return out


def answers(model, tok, prompts: list[list[dict]], samples: int, temperature: float, max_new_tokens: int,
            batch: int) -> list[tuple[str, list[str]]]:
    """(greedy answer, sampled answers) of each prompt."""
    stop, pad = end_of_turn_id(tok), pad_id(tok)
    out = []
    for first in range(0, len(prompts), batch):
        ids = [list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]) for p in prompts[first:first + batch]]
        greedy = generate_batch(model, ids, max_new_tokens, stop, temperature=0.0, pad=pad)
        sampled = generate_batch(model, ids, max_new_tokens, stop, temperature=temperature, num_samples=samples,
                                 pad=pad)
        for [g], s in zip(greedy, sampled, strict=True):
            out.append((tok.decode(g, skip_special_tokens=True), [tok.decode(a, skip_special_tokens=True) for a in s]))
        print(f"sampled {first + len(ids)}/{len(prompts)} prompts", file=sys.stderr, flush=True)
    return out


def right(answer: str, reference: str) -> bool:
    return Scored("", reference, answer).exact


def make_pairs(rows, got, per_prompt: int = 1) -> tuple[list[dict], dict]:
    pairs, stats = [], collections.Counter()
    for (prompt, reference, task), (greedy, sampled) in zip(rows, got, strict=True):
        good = [a for a in sampled if right(a, reference)]
        bad = [a.strip() for a in sampled if not right(a, reference) and a.strip()]
        if not good:
            stats["no_right_sample"] += 1
            continue
        if right(greedy, reference) and not bad:
            stats["no_wrong_sample"] += 1
            continue
        if not right(greedy, reference) and greedy.strip():
            rejected, stats["rejected_greedy"] = greedy.strip(), stats["rejected_greedy"] + 1
        elif bad:
            rejected = collections.Counter(bad).most_common(1)[0][0]
            stats["rejected_sampled"] += 1
        else:  # greedy wrong but empty, every sample right or empty
            stats["no_wrong_sample"] += 1
            continue
        # further pairs: the next most frequent distinct wrong answers, against the same right one
        others = [a for a, _ in collections.Counter(bad).most_common() if a != rejected][:per_prompt - 1]
        for wrong in (rejected, *others):
            stats[f"pairs_{task}"] += 1
            pairs.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": good[0].strip()}],
                          "rejected": [{"role": "assistant", "content": wrong}]})
    stats["pairs"] = len(pairs)
    return pairs, dict(sorted(stats.items()))


def pass_at(rows, got) -> dict:
    """pass@1 (greedy) and pass@n (any sample right), overall and per task."""
    by_task: dict[str, list[tuple[bool, bool]]] = collections.defaultdict(list)
    for (_, reference, task), (greedy, sampled) in zip(rows, got, strict=True):
        by_task[task].append((right(greedy, reference), any(right(a, reference) for a in sampled)))
    every = [x for v in by_task.values() for x in v]

    def frac(xs, k):
        return round(sum(x[k] for x in xs) / max(len(xs), 1), 4)

    return {"prompts": len(every), "pass@1_greedy": frac(every, 0), "pass@n": frac(every, 1),
            "per_task": {t: {"prompts": len(v), "greedy_right": sum(x[0] for x in v),
                             "any_sample_right": sum(x[1] for x in v)} for t, v in sorted(by_task.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="an exported chat model (Hugging Face folder)")
    ap.add_argument("out", help="folder for pairs_train.jsonl, pairs_val.jsonl and pairs_stats.json")
    ap.add_argument("--samples", type=int, default=16, help="sampled answers per prompt (n)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--train", type=int, default=None, help="first N conversations of train.jsonl (default all)")
    ap.add_argument("--val", type=int, default=None, help="first N conversations of val.jsonl (default all)")
    ap.add_argument("--heldout", type=int, default=200, help="held-out prompts scored for pass@1/pass@n (0: none)")
    ap.add_argument("--per-prompt", type=int, default=1,
                    help="pairs per prompt: the first as above, then its next most frequent distinct wrong answers")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64, help="prompts per generate call")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stats: dict = {"model": str(args.model), "samples": args.samples, "temperature": args.temperature,
                   "seed": args.seed, "max_new_tokens": args.max_new_tokens}
    began = time.time()
    with torch.no_grad():
        for split, source, n in (("train", "train.jsonl", args.train), ("val", "val.jsonl", args.val)):
            rows = conversations(TASKS_DIR / source, n)
            got = answers(model, tok, [r[0] for r in rows], args.samples, args.temperature, args.max_new_tokens,
                          args.batch)
            pairs, counts = make_pairs(rows, got, args.per_prompt if split == "train" else 1)
            (out / f"pairs_{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
            (out / f"samples_{split}.jsonl").write_text("".join(
                json.dumps({"prompt": r[0], "reference": r[1], "task": r[2], "greedy": g, "samples": s}) + "\n"
                for r, (g, s) in zip(rows, got, strict=True)))
            stats[split] = {"source": f"chat_tasks/{source}", **counts, **pass_at(rows, got)}
        if args.heldout:
            rows = conversations(TASKS_DIR / "heldout.jsonl", args.heldout)
            got = answers(model, tok, [r[0] for r in rows], args.samples, args.temperature, args.max_new_tokens,
                          args.batch)
            stats["heldout"] = {"source": "chat_tasks/heldout.jsonl (scored only, no pair)", **pass_at(rows, got)}
    stats["seconds"] = round(time.time() - began, 1)
    (out / "pairs_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()

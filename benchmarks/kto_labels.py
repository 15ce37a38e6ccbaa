"""KTO records for the KTO demo: the instruction-tuned model's own answers, each labelled by exact match.

    python benchmarks/kto_labels.py MODEL_HF OUT_DIR [--samples 4] [--temperature 1.0] [--train N] [--val N]
                                    [--seed 0]

MODEL_HF is an exported (Hugging Face) chat model, e.g. `shardlm export runs/chat_tiny runs/chat_tiny-hf`. Each
prompt of the bundled instruction data (the first `--train` conversations of chat_tasks `train.jsonl`, and of
`val.jsonl` for validation) is answered greedily and `--samples` times at `--temperature` (seeded), by
benchmarks/dpo_pairs.py's sampling code. Each distinct non-empty answer of a prompt becomes one record of TRL's
unpaired format, `{"prompt": messages, "completion": [assistant message], "label": ...}`, labelled desirable
(true) when it equals the conversation's reference answer by shardlm's exact-match rule (`shardlm eval
--exact-match`'s, via dpo_pairs.right), undesirable otherwise: a thumbs up or down from a check. An answer a
prompt repeats is written once (a sampled answer equal to the greedy one adds nothing), empty answers are
dropped and counted. The records are shuffled (seeded): KTO's mismatched completion for the KL reference point
is the record before in its run of `train.batch_size` records, which should come from another prompt.

It writes OUT_DIR/kto_train.jsonl, OUT_DIR/kto_val.jsonl and OUT_DIR/kto_stats.json (counts per label and per
task, pass@1 and pass@n of the prompts, and w_d = undesirable / desirable: the desirable_weight that puts KTO's
w_d x desirable / (w_u x undesirable) at 1, the low end of the paper's recommended 1 to 4/3), and prints the
stats.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time
from pathlib import Path

import torch
from dpo_pairs import TASKS_DIR, answers, conversations, pass_at, right


def records(rows, got) -> tuple[list[dict], dict]:
    """The KTO records of the prompts' answers (greedy first, then the samples; each distinct answer once)."""
    out, counts = [], collections.Counter()
    for (prompt, reference, task), (greedy, sampled) in zip(rows, got, strict=True):
        seen = set()
        for answer in (greedy, *sampled):
            answer = answer.strip()
            if not answer:
                counts["empty_dropped"] += 1
                continue
            if answer in seen:
                counts["repeats_dropped"] += 1
                continue
            seen.add(answer)
            label = right(answer, reference)
            counts["desirable" if label else "undesirable"] += 1
            counts[f"{task}/{'desirable' if label else 'undesirable'}"] += 1
            out.append({"prompt": prompt, "completion": [{"role": "assistant", "content": answer}], "label": label})
    counts["records"] = len(out)
    return out, dict(sorted(counts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="an exported chat model (Hugging Face folder)")
    ap.add_argument("out", help="folder for kto_train.jsonl, kto_val.jsonl and kto_stats.json")
    ap.add_argument("--samples", type=int, default=4, help="sampled answers per prompt, besides the greedy one")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--train", type=int, default=3000, help="first N conversations of train.jsonl (0: all)")
    ap.add_argument("--val", type=int, default=0, help="first N conversations of val.jsonl (0: all)")
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
            rows = conversations(TASKS_DIR / source, n or None)
            got = answers(model, tok, [r[0] for r in rows], args.samples, args.temperature, args.max_new_tokens,
                          args.batch)
            labelled, counts = records(rows, got)
            random.Random(args.seed).shuffle(labelled)
            (out / f"kto_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labelled))
            balance = counts.get("undesirable", 0) / max(counts.get("desirable", 0), 1)
            stats[split] = {"source": f"chat_tasks/{source}", **counts,
                            "desirable_weight_for_balance": round(balance, 2), **pass_at(rows, got)}
    stats["seconds"] = round(time.time() - began, 1)
    (out / "kto_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    for split in ("train", "val"):
        s = stats[split]
        print(f"{split}: {s['records']} records, {s.get('desirable', 0)} desirable, {s.get('undesirable', 0)} "
              f"undesirable ({s['prompts']} prompts; pass@1 {s['pass@1_greedy']}, pass@{args.samples} "
              f"{s['pass@n']})")
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()

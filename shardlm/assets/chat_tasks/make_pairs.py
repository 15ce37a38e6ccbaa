"""Write the chat_tasks preference pairs (pairs_train.jsonl, pairs_val.jsonl) next to this file.

Standard library only and deterministic: `python shardlm/assets/chat_tasks/make_pairs.py` rewrites both files
byte for byte from train.jsonl and val.jsonl (run make.py first if those are missing); `make_pairs.py DIR` writes
them to DIR instead. Every line is one pair in the conversational preference format that TRL's DPOTrainer reads,
{"prompt": [messages], "chosen": [{"role": "assistant", ...}], "rejected": [{"role": "assistant", ...}]}:
the prompt is a conversation's messages before its last assistant turn, chosen is that turn (the right answer)
and rejected is a plausible wrong answer of the same task kind (a near miss: the input copied back, half done,
off by one, one letter or one swap wrong...). No pair comes from heldout.jsonl, whose prompts make.py already
keeps out of train.jsonl and val.jsonl.
"""

from __future__ import annotations

import json
import random
import re
import string
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make import NAMES, TASKS  # noqa: E402  (the tasks' phrasings and answers, make.py next to this file)

SEED = 20240602
N_TRAIN = 3000  # pairs from the first conversations of train.jsonl
N_VAL = 200  # pairs from the first conversations of val.jsonl
# a pair's two sides share one row of data.seq_len tokens, so each gets seq_len / 2: conversations whose sides
# would be longer than this (ChatML, byte tokens) are skipped, not cut (configs/dpo_tiny.yaml: seq_len 256)
MAX_SIDE = 128


def _pattern(template: str) -> re.Pattern[str]:
    """A phrasing of make.py as a regex whose groups are its input: {x} -> letters/digits, {a} {b} -> a digit."""
    parts = re.split(r"(\{[xab]\})", template)
    body = "".join({"{x}": r"([a-z0-9]+)", "{a}": r"(\d)", "{b}": r"(\d)"}.get(p, re.escape(p)) for p in parts)
    return re.compile(body + r"\Z")


PATTERNS = [(name, _pattern(t)) for name in NAMES for t in TASKS[name][2]]


def parse(prompt: str) -> tuple[str, str]:
    """(task, input) of a user message written by make.py; the input as make.py draws it (add: "a b")."""
    for name, pattern in PATTERNS:
        m = pattern.match(prompt)
        if m:
            return name, " ".join(m.groups())
    raise ValueError(f"not a chat_tasks prompt: {prompt!r}")


def _one_letter_wrong(r: random.Random, s: str, alphabet: str) -> str:
    i = r.randrange(len(s))
    return s[:i] + r.choice([c for c in alphabet if c != s[i]]) + s[i + 1:]


def _one_swap(r: random.Random, s: str) -> str:
    """s with one pair of different neighbouring characters swapped (s itself if all are equal)."""
    spots = [i for i in range(len(s) - 1) if s[i] != s[i + 1]]
    if not spots:
        return s
    i = r.choice(spots)
    return s[:i] + s[i + 1] + s[i] + s[i + 2:]


def _half_reversed(r: random.Random, x: str) -> str:
    """Only the first or only the second half of the reversal done: 'abcde' -> 'cbade' or 'abedc'."""
    k = len(x) // 2 + r.randrange(2)
    return x[:k][::-1] + x[k:] if r.random() < 0.5 else x[:k] + x[k:][::-1]


# task -> the kinds of wrong answer, each (rng, input, right answer) -> a string; pair-wise one is drawn
WRONG: dict[str, tuple[Callable[[random.Random, str, str], str], ...]] = {
    "reverse": (lambda r, x, y: x, lambda r, x, y: _half_reversed(r, x), lambda r, x, y: _one_swap(r, y)),
    "uppercase": (lambda r, x, y: x, lambda r, x, y: _one_letter_wrong(r, y, string.ascii_uppercase),
                  lambda r, x, y: y[:-1] + y[-1].lower()),
    "add": (lambda r, x, y: str(int(y) + 1), lambda r, x, y: str(max(int(y) - 1, 0) if y != "0" else 1)),
    "next_letter": (lambda r, x, y: x, lambda r, x, y: chr(ord(x) + 2) if x < "y" else chr(ord(x) - 1)),
    "repeat": (lambda r, x, y: x, lambda r, x, y: x * 3),
    "sort_digits": (lambda r, x, y: x, lambda r, x, y: _one_swap(r, y), lambda r, x, y: y[::-1]),
}


def wrong_answer(r: random.Random, name: str, x: str, right: str) -> str:
    """A wrong answer of the task's kinds, drawn until it differs from the right one (e.g. a palindrome)."""
    kinds = list(WRONG[name])
    r.shuffle(kinds)
    for kind in kinds:
        answer = kind(r, x, right)
        if answer != right:
            return answer
    return _one_letter_wrong(r, right, string.digits if right.isdigit() else string.ascii_letters)


def chatml_tokens(messages: list[dict]) -> int:
    """Tokens of messages under ChatML with a byte tokenizer: <|im_start|>role\ncontent<|im_end|>\n each,
    <|im_start|> and <|im_end|> one token apiece."""
    return sum(len(m["role"]) + len(m["content"].encode()) + 4 for m in messages)


def pair(r: random.Random, conversation: dict) -> dict:
    messages = conversation["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt, right = messages[:last], messages[last]["content"]
    name, x = parse(prompt[-1]["content"])
    assert TASKS[name][1](x) == right, (prompt[-1], right)
    rejected = wrong_answer(r, name, x, right)
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": right}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def pairs(r: random.Random, path: Path, n: int) -> list[dict]:
    """Pairs from the first conversations of `path` until there are n, skipping those with a side over MAX_SIDE."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = pair(r, json.loads(line))
            if max(chatml_tokens(row["prompt"] + row[side]) for side in ("chosen", "rejected")) <= MAX_SIDE:
                rows.append(row)
                if len(rows) == n:
                    return rows
    raise SystemExit(f"{path} gave {len(rows)} pairs that fit, {n} wanted (run make.py)")


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE  # default: next to this file, as the bundled ones
    r = random.Random(SEED)
    for source, target, n in (("train.jsonl", "pairs_train.jsonl", N_TRAIN), ("val.jsonl", "pairs_val.jsonl", N_VAL)):
        rows = pairs(r, HERE / source, n)
        path = out / target
        with path.open("w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{target}: {len(rows)} pairs, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()

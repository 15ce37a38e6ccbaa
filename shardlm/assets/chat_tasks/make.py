"""Write the chat_tasks instruction set (train.jsonl, val.jsonl, heldout.jsonl) next to this file.

Standard library only and deterministic: `python shardlm/assets/chat_tasks/make.py` rewrites the three files
byte for byte. Every line is one conversation in the OpenAI/TRL chat format,
{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}.

Six tasks with short exact answers (at most 12 characters), each phrased three ways, so that a tiny byte-level
model trained from scratch has to read the prompt. heldout.jsonl is single-turn and none of its prompts occurs
in train.jsonl or val.jsonl: for the tasks with many possible inputs (reverse, uppercase, repeat, sort) its
inputs are unseen in any phrasing; for the two small ones (add: 100 digit pairs, next letter: 25 letters) only
the held-out phrasing of an input is unseen, and every input keeps at least one phrasing in training.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from pathlib import Path

SEED = 20240601
N_TRAIN = 6000
N_VAL = 300
N_HELDOUT = 200
P_SYSTEM = 0.2  # conversations that open with a system message
P_TWO_TURNS = 0.15  # train/val conversations with two user/assistant exchanges

SYSTEM_PROMPTS = ("Answer briefly.", "Reply with the answer only.", "You are a helpful assistant. Answer briefly.")

LOWER = string.ascii_lowercase


def _letters(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(LOWER) for _ in range(rng.randint(lo, hi)))


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(rng.randint(lo, hi)))


# name -> (draw an input, the answer to it, the phrasings, whether the input space is small)
Task = tuple[Callable[[random.Random], str], Callable[[str], str], tuple[str, ...], bool]

TASKS: dict[str, Task] = {
    "reverse": (
        lambda r: _letters(r, 3, 5),
        lambda x: x[::-1],
        ("Reverse: {x}", "Reverse the letters of {x}.", "Write {x} backwards."),
        False,
    ),
    "uppercase": (
        lambda r: _letters(r, 3, 6),
        lambda x: x.upper(),
        ("Uppercase: {x}", "Make {x} uppercase.", "Write {x} in capital letters."),
        False,
    ),
    "add": (
        lambda r: f"{r.randint(0, 9)} {r.randint(0, 9)}",
        lambda x: str(sum(int(d) for d in x.split())),
        ("Add {a} and {b}.", "What is {a} + {b}?", "{a} plus {b} equals?"),
        True,
    ),
    "next_letter": (
        lambda r: r.choice(LOWER[:-1]),
        lambda x: chr(ord(x) + 1),
        ("Next letter after {x}?", "Which letter comes after {x}?", "What follows {x} in the alphabet?"),
        True,
    ),
    "repeat": (
        lambda r: _letters(r, 2, 4),
        lambda x: x * 2,
        ("Repeat twice: {x}", "Write {x} two times.", "Say {x} twice, no spaces."),
        False,
    ),
    "sort_digits": (
        lambda r: _digits(r, 3, 6),
        lambda x: "".join(sorted(x)),
        (
            "Sort the digits: {x}",
            "Put the digits of {x} in ascending order.",
            "Arrange {x} from smallest to largest digit.",
        ),
        False,
    ),
}
NAMES = tuple(TASKS)


def _prompt(name: str, x: str, variant: int) -> str:
    template = TASKS[name][2][variant]
    if name == "add":
        a, b = x.split()
        return template.format(a=a, b=b)
    return template.format(x=x)


class Sampler:
    """Draws (prompt, answer) pairs, keeping the held-out ones out of train and val."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.held_prompts: set[str] = set()
        self.held_inputs: set[tuple[str, str]] = set()  # (task, input): every phrasing held out

    def heldout(self, n: int) -> list[tuple[str, str]]:
        pairs: list[tuple[str, str]] = []
        for i in range(n):
            name = NAMES[i % len(NAMES)]
            draw, answer, variants, small = TASKS[name]
            while True:
                x = draw(self.rng)
                prompt = _prompt(name, x, self.rng.randrange(len(variants)))
                if (name, x) in self.held_inputs or prompt in self.held_prompts:
                    continue
                # a small task's input keeps at least one phrasing in training
                held = sum(_prompt(name, x, v) in self.held_prompts for v in range(len(variants)))
                if small and held >= len(variants) - 1:
                    continue
                break
            if not small:
                self.held_inputs.add((name, x))
            self.held_prompts.add(prompt)
            pairs.append((prompt, answer(x)))
        self.rng.shuffle(pairs)
        return pairs

    def seen(self) -> tuple[str, str]:
        name = self.rng.choice(NAMES)  # tasks equally likely, whatever share of each is held out
        draw, answer, variants, _ = TASKS[name]
        while True:
            x = draw(self.rng)
            prompt = _prompt(name, x, self.rng.randrange(len(variants)))
            if (name, x) not in self.held_inputs and prompt not in self.held_prompts:
                return prompt, answer(x)


def _conversation(rng: random.Random, exchanges: list[tuple[str, str]]) -> dict[str, list[dict[str, str]]]:
    messages = []
    if rng.random() < P_SYSTEM:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for prompt, answer in exchanges:
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def _split(sampler: Sampler, n: int) -> list[dict[str, list[dict[str, str]]]]:
    rng = sampler.rng
    rows = []
    for _ in range(n):
        turns = 2 if rng.random() < P_TWO_TURNS else 1
        rows.append(_conversation(rng, [sampler.seen() for _ in range(turns)]))
    return rows


def _write(path: Path, rows: list[dict[str, list[dict[str, str]]]]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    rng = random.Random(SEED)
    sampler = Sampler(rng)
    heldout = [_conversation(rng, [pair]) for pair in sampler.heldout(N_HELDOUT)]
    train = _split(sampler, N_TRAIN)
    val = _split(sampler, N_VAL)
    here = Path(__file__).resolve().parent
    for name, rows in (("train", train), ("val", val), ("heldout", heldout)):
        _write(here / f"{name}.jsonl", rows)
        print(f"{name}.jsonl: {len(rows)} conversations, {(here / f'{name}.jsonl').stat().st_size} bytes")


if __name__ == "__main__":
    main()

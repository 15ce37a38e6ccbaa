"""Render every vendored chat template with transformers' own apply_chat_template.

Run: .venv-test/bin/python tests/data/chat_templates/check.py   (from the repo root, or anywhere)

Each template is set on the repo's GPT-2 tokenizer, with the template's special
tokens added as additional special tokens and bos/eos set as sources.json says.
Prints each rendering; exits non-zero if any template fails to render, a listed
special token is missing from the rendering or is not a single token id, or a
template that declares supports_system=false accepts a system message.
"""

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GPT2 = ROOT / "shardlm" / "assets" / "gpt2-tokenizer"

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]


def tokenizer_for(meta: dict, template: str):
    tok = AutoTokenizer.from_pretrained(str(GPT2))
    specials = [t for t in meta["special_tokens"] + meta.get("tool_special_tokens", [])]
    for name in ("bos_token", "eos_token", "end_of_turn"):
        if meta.get(name) and meta[name] not in specials:
            specials.append(meta[name])
    tok.add_special_tokens({"additional_special_tokens": specials})
    if meta.get("bos_token"):
        tok.bos_token = meta["bos_token"]
    tok.eos_token = meta["eos_token"]
    tok.chat_template = template
    return tok


def render(tok, messages, **kwargs) -> str:
    out = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(out, str), type(out)
    return out


def check(name: str, meta: dict) -> list[str]:
    problems = []
    template = (HERE / name).read_text(encoding="utf-8")
    tok = tokenizer_for(meta, template)
    head = [SYSTEM] if meta["supports_system"] else []
    cases = [
        ("chat", head + TURNS, {}),
        ("generation prompt", head + TURNS[:3], {"add_generation_prompt": True}),
    ]
    if name == "qwen3.jinja":
        cases.append(("generation prompt, enable_thinking=False", head + TURNS[:3],
                      {"add_generation_prompt": True, "enable_thinking": False}))
    renderings = []
    for label, messages, kwargs in cases:
        try:
            text = render(tok, messages, **kwargs)
        except Exception as exc:  # noqa: BLE001 - report every failure
            problems.append(f"{name} [{label}]: {type(exc).__name__}: {exc}")
            continue
        renderings.append(text)
        print(f"----- {name} [{label}] -----")
        print(text)
        print("----- end -----")
    joined = "".join(renderings)
    for special in meta["special_tokens"]:
        if special not in joined:
            problems.append(f"{name}: special token {special!r} not emitted")
        ids = tok(special, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            problems.append(f"{name}: {special!r} encodes to {len(ids)} ids")
    if not meta["supports_system"]:
        try:
            render(tok, [SYSTEM] + TURNS)
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: system message rejected as expected: {exc}")
        else:
            problems.append(f"{name}: supports_system is false but a system message rendered")
    return problems


def main() -> int:
    sources = json.loads((HERE / "sources.json").read_text(encoding="utf-8"))
    problems = []
    for name, meta in sources.items():
        problems += check(name, meta)
    for p in problems:
        print("PROBLEM:", p)
    failed = {p.split(":")[0].split(" ")[0] for p in problems}
    print(f"{len(sources) - len(failed)} of {len(sources)} templates OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

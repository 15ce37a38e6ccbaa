"""`shardlm generate PATH --chat`: answers under the model's chat template, as the model was instruction-tuned.

One conversation: `--prompt TEXT` (a user message) or `--messages FILE` (a JSON list of {role, content}, or a
JSON object with "messages"); the template renders it with its generation prompt and the answer stops at the
template's end-of-turn token. With neither, on a terminal, an interactive loop: each line is a user message,
the conversation is kept (`/reset` clears it, an empty line or Ctrl-D ends).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

import torch

from shardlm import ShardlmError
from shardlm.inference.generate import check_options, generate_batch, load_generator, pad_id
from shardlm.tokenizer import end_of_turn_id


def read_messages(path: str) -> list[dict]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ShardlmError(f"--messages '{path}' is not a file: give a JSON file holding a list of "
                           '{"role": ..., "content": ...} messages.')
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardlmError(f"--messages '{path}' is not valid JSON ({e}). Give a list of "
                           '{"role": ..., "content": ...} messages.') from None
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ShardlmError(f"--messages '{path}' must hold a non-empty list of "
                           '{"role": ..., "content": ...} messages (or {"messages": [...]}).')
    return messages


def answer(model, tok, messages: list[dict], max_new_tokens: int, temperature: float, top_k: int,
           top_p: float) -> str:
    if not getattr(tok, "chat_template", None):
        raise ShardlmError("--chat needs a chat template and this model's tokenizer has none: train with "
                           "model.chat_template=chatml (or plain, or a .jinja file), or generate without --chat.")
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
    except Exception as e:  # noqa: BLE001 - the template's own refusal (roles, order)
        raise ShardlmError(f"the chat template refuses these messages ({str(e).splitlines()[0]}).") from None
    [[new]] = generate_batch(model, [list(ids)], max_new_tokens, end_of_turn_id(tok), temperature, top_k, top_p,
                             pad=pad_id(tok))
    return tok.decode(new, skip_special_tokens=True).strip()


def chat_command(path: str, prompt: str | None = None, messages_file: str | None = None,
                 max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, as_json: bool = False, out: TextIO | None = None, inp: TextIO | None = None) -> int:
    out, inp = out or sys.stdout, inp or sys.stdin
    if prompt is not None and messages_file is not None:
        raise ShardlmError("give --prompt or --messages, not both.")
    check_options(max_new_tokens, temperature, top_k, top_p, 1, 1)
    messages = read_messages(messages_file) if messages_file else \
        [{"role": "user", "content": prompt}] if prompt is not None else None
    if messages is None and not inp.isatty():
        raise ShardlmError("--chat without --prompt or --messages is an interactive loop and needs a terminal: "
                           "give --prompt TEXT or --messages FILE.")
    model, tok = load_generator(path)
    torch.manual_seed(seed)
    if messages is not None:
        text = answer(model, tok, messages, max_new_tokens, temperature, top_k, top_p)
        print(json.dumps({"messages": messages, "answer": text}, ensure_ascii=False) if as_json else text,
              file=out, flush=True)
        return 0
    history: list[dict] = []
    print("chat: type a message; /reset starts over; an empty line ends", file=out, flush=True)
    for line in iter(lambda: inp.readline(), ""):
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = []
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        reply = answer(model, tok, history, max_new_tokens, temperature, top_k, top_p)
        history.append({"role": "assistant", "content": reply})
        print(f"assistant: {reply}", file=out, flush=True)
    return 0

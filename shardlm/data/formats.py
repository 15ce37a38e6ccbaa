"""Records -> examples: the dataset formats fine-tuning data comes in, recognised from their fields.

| format       | fields                                                        | trained on                  |
|--------------|---------------------------------------------------------------|-----------------------------|
| `completion` | `prompt` + `completion`, text (TRL's)                          | the completion (+ EOS)      |
| `completion` | `prompt` + `completion`, lists of messages (TRL's)            | the completion's turns      |
| `completion` | `instruction` (+ `input`) + `output` (Alpaca), as a chat      | the output                  |
| `chat`       | `messages: [{role, content}]` (OpenAI/TRL)                     | every assistant turn        |
| `chat`       | `conversations: [{from, value}]` (ShareGPT), roles mapped     | every assistant turn        |
| `text`       | anything else: `data.text_field` as a document                | every token                 |

An `Example` is either text (`prompt`, `completion`) or a conversation (`messages`, with the assistant turns
from `first_trained` on trained). A record that does not fit its source's format is one `file:line` error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm import ShardlmError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "chatgpt": "assistant", "system": "system", "tool": "tool",
                  "function": "tool", "observation": "tool", "function_call": "assistant"}
# The roles a conversation may hold (OpenAI's, with Llama 3.1's `ipython` for tool output): any other is most
# likely a misnamed answer (`bot`), which a permissive template would render as context and never train
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
# (format, variant) by the fields that identify it, in the order they are tried
VARIANTS = ((("chosen", "rejected"), "preference", "pairs"),
            (("messages",), "chat", "messages"), (("conversations",), "chat", "sharegpt"),
            (("prompt", "completion"), "completion", "prompt_completion"),
            (("instruction", "output"), "completion", "alpaca"))


class BadExample(ShardlmError):
    """One record that cannot be made an example (skipped, counted, with `data.on_bad_example=skip`)."""


@dataclass
class Example:
    prompt: str = ""  # text examples
    completion: str = ""
    messages: list[dict] = field(default_factory=list)  # conversations
    first_trained: int = 0  # the first message whose assistant turns are trained

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)


def detect(record: dict) -> tuple[str, str]:
    """(format, variant) of a record: ("chat", "messages"), ("completion", "alpaca"), ("text", "text"), ..."""
    for keys, fmt, variant in VARIANTS:
        if all(k in record for k in keys):
            return fmt, variant
    return "text", "text"


def near_miss(record: dict) -> str:
    """A hint for a record that detects as text but holds part of an example format's fields: the format it half
    has, and the misspelled field it most likely means ("" when it holds none of them)."""
    import difflib

    names = [str(k) for k in record]
    for keys, fmt, _ in VARIANTS:
        have = [k for k in keys if k in record]
        if have and len(have) < len(keys):
            missing = [k for k in keys if k not in record]
            guesses = [g for m in missing for g in difflib.get_close_matches(m, names, n=1, cutoff=0.7)]
            meant = f" (is {', '.join(repr(g) for g in guesses)} a misspelling?)" if guesses else ""
            return (f" It has {', '.join(repr(k) for k in have)} of a {fmt} example, which needs "
                    f"{' and '.join(repr(k) for k in keys)}: {', '.join(repr(m) for m in missing)} is missing{meant}.")
    return ""


def variant_of(record: dict, fmt: str, where: str, text_field: str) -> str:
    """The variant of `record` within the configured format, or a clear error naming what is missing."""
    found_fmt, variant = detect(record)
    if found_fmt == fmt:
        return variant
    fields = ", ".join(map(str, list(record)[:10])) or "none"
    wanted = {"chat": "'messages' (a list of {role, content}) or 'conversations' (ShareGPT)",
              "completion": "'prompt' and 'completion', or 'instruction' and 'output' (Alpaca)",
              "preference": "'chosen' and 'rejected' (with 'prompt', or conversations that share one)",
              "text": f"'{text_field}'"}[fmt]
    fix = "Fix the record, or set data.format to the format of the data" if found_fmt != "text" else \
        "Fix or remove the record (a misspelled field?)"
    raise BadExample(f"{where}: a {fmt} example needs {wanted} (fields found: {fields}). {fix}.")


def _text(value: object, name: str, where: str, allow_empty: bool = False) -> str:
    """`name` as the message shows it: `'prompt'`, `message 2's 'content'`."""
    if not isinstance(value, str):
        kind = type(value).__name__ if value is not None else "null"
        raise BadExample(f"{where}: {name} is {kind}, not a string. Give text there.")
    if not allow_empty and not value.strip():
        raise BadExample(f"{where}: {name} is empty. Give it text, or remove the example "
                         "(data.on_bad_example=skip skips such examples).")
    return value


def _message(m: object, where: str, i: int, keys: tuple[str, str] = ("role", "content"),
             roles: dict[str, str] | None = None) -> dict:
    role_key, content_key = keys
    if not isinstance(m, dict) or role_key not in m or content_key not in m:
        got = ", ".join(map(str, m)) if isinstance(m, dict) else type(m).__name__
        raise BadExample(f"{where}: message {i} is not {{'{role_key}': ..., '{content_key}': ...}} (got {got}). "
                         "Fix the message.")
    role = m[role_key]
    if roles is not None:
        if role not in roles:
            raise BadExample(f"{where}: message {i} has '{role_key}': {role!r}, which is not a ShareGPT role "
                             f"({', '.join(sorted(roles))}). Rename it.")
        role = roles[role]
    if not isinstance(role, str):
        raise BadExample(f"{where}: message {i}'s '{role_key}' is not a string. Give a role such as 'user'.")
    if role not in ROLES:
        raise BadExample(f"{where}: message {i} has role {role!r}, which is not a chat role ({', '.join(ROLES)}): "
                         "its turn would be context, never trained. Rename it ('assistant' if it is the model's "
                         "answer).")
    content = _text(m[content_key], f"message {i}'s '{content_key}'", where, allow_empty=role != "assistant")
    return {"role": role, "content": content}


def _messages(value: object, name: str, where: str, keys=("role", "content"), roles=None) -> list[dict]:
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else type(value).__name__
        raise BadExample(f"{where}: '{name}' is {what}; it must be a non-empty list of messages. Fix or remove the "
                         "example.")
    return [_message(m, where, i, keys, roles) for i, m in enumerate(value)]


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if system is None or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _check_trained(messages: list[dict], first: int, where: str) -> None:
    if not any(m["role"] == "assistant" for m in messages[first:]):
        part = "its completion has" if first else "it has"
        roles = ", ".join(dict.fromkeys(repr(m["role"]) for m in messages[first:]))
        raise BadExample(f"{where}: the conversation has no assistant turn to train on ({part} none, only {roles}). "
                         "Add the assistant's answer, or remove the example.")
    if messages[0]["role"] == "assistant" and first == 0:
        raise BadExample(f"{where}: the conversation starts with an assistant turn; it needs the user's (or a "
                         "system) message first.")


def to_example(record: dict, variant: str, where: str, system: str | None = None) -> Example:
    """One record of a known variant -> an Example (BadExample if it does not hold one)."""
    if variant == "prompt_completion":
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return Example(prompt=_text(prompt, "'prompt'", where, allow_empty=True),
                           completion=_text(completion, "'completion'", where))
        if isinstance(prompt, list) and isinstance(completion, list):
            p = _with_system(_messages(prompt, "'prompt'", where), system)
            c = _messages(completion, "'completion'", where)
            _check_trained(p + c, len(p), where)
            return Example(messages=p + c, first_trained=len(p))
        raise BadExample(f"{where}: 'prompt' and 'completion' must both be text or both be lists of messages "
                         f"(got {type(prompt).__name__} and {type(completion).__name__}).")
    if variant == "alpaca":
        instruction = _text(record["instruction"], "'instruction'", where)
        extra = record.get("input") or ""
        user = instruction + "\n\n" + _text(extra, "'input'", where, allow_empty=True) if extra else instruction
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": _text(record["output"], "'output'", where)}]
        if record.get("system"):
            messages.insert(0, {"role": "system", "content": _text(record["system"], "'system'", where)})
        return Example(messages=_with_system(messages, system), first_trained=0)
    if variant == "sharegpt":
        messages = _messages(record["conversations"], "conversations", where, ("from", "value"), SHAREGPT_ROLES)
        if isinstance(record.get("system"), str) and record["system"]:
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        messages = _messages(record["messages"], "messages", where)
    messages = _with_system(messages, system)
    _check_trained(messages, 0, where)
    return Example(messages=messages)


@dataclass
class Pair:
    """A preference pair: one prompt, a chosen and a rejected answer; all text, or all lists of messages."""
    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)

    @property
    def identical(self) -> bool:
        return self.chosen == self.rejected


def _implicit_prompt(chosen: list[dict], rejected: list[dict], where: str) -> tuple[list[dict], list, list]:
    """Conversations given whole (no 'prompt'): the prompt is what they share before their last assistant turn."""
    last = max((i for i, m in enumerate(chosen) if m["role"] == "assistant"), default=-1)
    if last < 0 or chosen[:last] != rejected[:last] or last >= len(rejected):
        raise BadExample(f"{where}: 'chosen' and 'rejected' differ before their last assistant turn, so they do not "
                         "answer the same prompt. Give a 'prompt' and the two answers, or make the conversations "
                         "share every message before the answer.")
    return chosen[:last], chosen[last:], rejected[last:]


def to_pair(record: dict, where: str, system: str | None = None) -> Pair:
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise BadExample(f"{where}: a text pair needs 'prompt' (a string) beside 'chosen' and 'rejected'. Add it.")
        return Pair(prompt, _text(chosen, "'chosen'", where), _text(rejected, "'rejected'", where))
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise BadExample(f"{where}: 'chosen' and 'rejected' must both be text or both be lists of messages (got "
                         f"{type(chosen).__name__} and {type(rejected).__name__}).")
    c, r = _messages(chosen, "chosen", where), _messages(rejected, "rejected", where)
    if prompt is None:
        p, c, r = _implicit_prompt(c, r, where)
    else:
        p = _messages(prompt, "prompt", where)
    for side, turns in (("chosen", c), ("rejected", r)):
        if not any(m["role"] == "assistant" for m in turns):
            raise BadExample(f"{where}: '{side}' has no assistant answer. Give the answer as an assistant message.")
    return Pair(_with_system(p, system), c, r)

"""Prompt records of online RL: what is sampled from, what the reward functions see, and the prompt's token ids.

A record is TRL's `{"prompt": text or messages, ...any other fields}`; every other field goes to the reward
functions (`answer`, `solution`, `tests`, ...). Example data serves as well, its answer becoming the `answer`
field the built-in rewards compare with:
- chat data (`{"messages": [...]}`): the prompt is every turn before the last assistant turn, that turn the
  answer (a conversation that does not end with the assistant's turn is all prompt, with no answer);
- prompt/completion data: the completion is the answer, unless the record has an `answer` of its own.
A conversational prompt is rendered with the chat template and its generation prompt, as `generate --chat` and
`eval --exact-match` render it (`data.system_prompt` added where it has no system message); a text prompt is
tokenized as TRL tokenizes it. The reward functions get conversational completions as TRL gives them: one
assistant message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardlm.data.formats import ROLES, BadExample


@dataclass
class RLPrompt:
    prompt: str | list[dict]  # as the reward functions see it
    fields: dict[str, Any] = field(default_factory=dict)  # every other field of the record, `answer` included

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def _messages(value: Any, name: str, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadExample(f"{where}: '{name}' must be text or a non-empty list of messages, got "
                         f"{'an empty list' if isinstance(value, list) else type(value).__name__}. Fix the record.")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadExample(f"{where}: message {i} of '{name}' is not {{'role': text, 'content': text}}. "
                             "Fix the message.")
        if m["role"] not in ROLES:
            raise BadExample(f"{where}: message {i} of '{name}' has role {m['role']!r}, which is not a chat role "
                             f"({', '.join(ROLES)}). Rename it.")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if system is None or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def rl_prompt(record: dict, where: str, system: str | None = None) -> RLPrompt:
    """A record as an RL prompt (BadExample, one line naming the fix, when it holds none)."""
    if "prompt" in record:
        prompt = record["prompt"]
        fields = {k: v for k, v in record.items() if k not in ("prompt", "completion")}
        if "completion" in record and "answer" not in record:
            completion = record["completion"]
            fields["answer"] = completion[-1]["content"] if isinstance(completion, list) and completion and \
                isinstance(completion[-1], dict) else completion
        if isinstance(prompt, str):
            if not prompt.strip():
                raise BadExample(f"{where}: 'prompt' is empty. Give the text to sample completions of.")
            return RLPrompt(prompt, fields)
        return RLPrompt(_with_system(_messages(prompt, "prompt", where), system), fields)
    if "messages" in record:
        messages = _messages(record["messages"], "messages", where)
        fields = {k: v for k, v in record.items() if k != "messages"}
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if answers and answers[-1] == len(messages) - 1:
            if answers[-1] == 0:
                raise BadExample(f"{where}: the conversation is a single assistant turn: no prompt to answer. Add "
                                 "the user's message.")
            fields.setdefault("answer", messages[-1]["content"])
            messages = messages[:-1]
        return RLPrompt(_with_system(messages, system), fields)
    found = ", ".join(record) or "none"
    raise BadExample(f"{where}: no 'prompt' (nor chat 'messages') in this record (fields found: {found}). An RL "
                     "prompt record is {\"prompt\": text or messages, ...fields for the rewards}.")


def prompt_token_ids(tok, prompt: RLPrompt) -> list[int]:
    if prompt.conversational:
        return list(tok.apply_chat_template(prompt.prompt, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])
    return list(tok(prompt.prompt)["input_ids"])


def completion_for_rewards(text: str, prompt: RLPrompt) -> str | list[dict]:
    """A decoded completion as TRL hands it to the reward functions."""
    return [{"role": "assistant", "content": text}] if prompt.conversational else text

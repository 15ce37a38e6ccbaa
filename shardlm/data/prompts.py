"""Prompt records of online RL: what is sampled from, what the reward functions see, and the prompt's token ids;
`PromptRows`, a split of them (what `run.train` and `run.val` are for train.objective grpo and rloo).

A record is TRL's `{"prompt": text or messages, ...any other fields}`; every other field goes to the reward
functions (`answer`, `solution`, `tests`, ...). Example data serves as well, its answer becoming the `answer`
field the built-in rewards compare with (Alpaca and ShareGPT records as the conversation instruction tuning reads):
- chat data (`{"messages": [...]}`): the prompt is every turn before the last assistant turn, that turn the
  answer (a conversation that does not end with the assistant's turn is all prompt, with no answer);
- prompt/completion data: the completion is the answer, unless the record has an `answer` of its own.
An `"answer": null` is no answer (as a record without one). The rewards get the fields every prompt holds;
`FieldNames` also keeps, for a field only some hold, the first record that lacks it, for the message that needs it.
A conversational prompt is rendered with the chat template and its generation prompt, as `generate --chat` and
`eval --exact-match` render it (`data.system_prompt` added where it has no system message); a text prompt is
tokenized as TRL tokenizes it. The reward functions get conversational completions as TRL gives them: one
assistant message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardlm import ShardlmError
from shardlm.config import DataConfig
from shardlm.data.formats import ROLES, BadExample, detect, to_example


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


_AS_CHAT = {"alpaca": ("instruction", "input", "output", "system"), "sharegpt": ("conversations", "system")}


def rl_prompt(record: dict, where: str, system: str | None = None) -> RLPrompt:
    """A record as an RL prompt (BadExample, one line naming the fix, when it holds none). `"answer": null` is no
    answer, as `eval --exact-match` reads it: left out (the completion or the chat's last answer stands in), so a
    reward that needs it names the record instead of comparing completions with the text 'None'."""
    if record.get("answer", "") is None:
        record = {k: v for k, v in record.items() if k != "answer"}
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
    variant = detect(record)[1]
    if variant in _AS_CHAT:  # Alpaca and ShareGPT records: their conversation, read as instruction tuning reads it
        rest = {k: v for k, v in record.items() if k not in _AS_CHAT[variant]}
        return rl_prompt({**rest, "messages": to_example(record, variant, where).messages}, where, system)
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


def prompt_token_ids(tok, prompt: RLPrompt, where: str = "a prompt", tools: list[dict] | None = None) -> list[int]:
    """The ids the sampler continues, the tools' schemas rendered by the template; a conversation with no template,
    or one its template refuses, is one line naming `where` (the template's refusal a BadExample:
    data.on_bad_example=skip leaves that prompt out)."""
    if not prompt.conversational:
        if tools:
            raise ShardlmError(f"{where}: a text prompt cannot offer tools: the chat template renders their schemas "
                               "and the tool turns. Give prompts as conversations ({\"prompt\": [{\"role\": "
                               "\"user\", \"content\": ...}]}).")
        return list(tok(prompt.prompt)["input_ids"])
    if not getattr(tok, "chat_template", None):
        raise ShardlmError(f"{where}: a conversation needs a chat template and tokenizer "
                           f"'{getattr(tok, 'name_or_path', '')}' has none. Set model.chat_template to chatml, plain "
                           "or a .jinja file.")
    try:
        out = tok.apply_chat_template(prompt.prompt, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, or the template's own raise_exception
        raise BadExample(f"{where}: the chat template refuses this conversation ({str(e).splitlines()[0]}). Fix "
                         "the roles or order of its messages, or use a template that accepts them "
                         "(model.chat_template).") from None
    return list(out["input_ids"])


def completion_for_rewards(text: str, prompt: RLPrompt) -> str | list[dict]:
    """A decoded completion as TRL hands it to the reward functions."""
    return [{"role": "assistant", "content": text}] if prompt.conversational else text


Entry = Callable[[int], tuple[str, RLPrompt]]  # record k -> (where, prompt)


class FieldNames(list):
    """The fields every prompt holds (a list of names), and `partial`: for each field only some prompts hold, how
    many prompts there are, how many lack it and the first that does (its path:line), which a reward that needs
    the field names (a bare list of names cannot say which record to fix)."""

    def __init__(self, names: Iterable[str] = (), partial: dict[str, tuple[int, int, str]] | None = None):
        super().__init__(names)
        self.partial = partial or {}


class PromptRows:
    """Prompts `[start, end)` of a set: each one's rendered ids (`tokens[offsets[k]:offsets[k + 1]]`) and, read
    only when asked for, its `RLPrompt` and where it came from. Sampling and scoring index it as ExampleRows is
    indexed; a held-out share is the same set with another range, so the ids are tokenized once."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, entry: Entry, field_names: list[str], spec: str,
                 start: int = 0, end: int | None = None, meta: dict | None = None):
        self.tokens, self.offsets, self._entry, self.spec = tokens, offsets, entry, spec
        self.field_names = field_names
        self.meta = meta or {}
        self.start, self.end = start, len(offsets) - 1 if end is None else end

    def __len__(self) -> int:
        return max(0, self.end - self.start)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets[self.start:self.end + 1]) if len(self) else np.zeros(0, dtype=np.int64)

    @property
    def max_prompt_tokens(self) -> int:
        return int(self.lengths.max()) if len(self) else 0

    def _k(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(f"prompt {i} of {len(self)}")
        return self.start + i

    def token_ids(self, i: int) -> list[int]:
        k = self._k(i)
        return [int(t) for t in self.tokens[int(self.offsets[k]):int(self.offsets[k + 1])]]

    def prompt(self, i: int) -> RLPrompt:
        return self._entry(self._k(i))[1]

    def where(self, i: int) -> str:
        return self._entry(self._k(i))[0]

    def share(self, start: int, end: int | None = None) -> PromptRows:
        """Prompts `[start, end)` of this split (a held-out tail, a rank's share), the same set underneath."""
        stop = self.end if end is None else min(self.start + end, self.end)
        return PromptRows(self.tokens, self.offsets, self._entry, self.field_names, self.spec,
                          self.start + start, stop, self.meta)

    def in_memory(self) -> PromptRows:
        """The same prompts read whole into memory (nothing left open on a file a dry run removes)."""
        entries = [self._entry(k) for k in range(len(self.offsets) - 1)]
        return PromptRows(np.array(self.tokens), np.array(self.offsets), entries.__getitem__, self.field_names,
                          self.spec, self.start, self.end, self.meta)

    def describe(self) -> str:
        longest = f", the longest {self.max_prompt_tokens:,} tokens" if len(self) else ""
        fields = ", ".join(self.field_names) or "none"
        return f"{self.spec}: {len(self):,} prompt{'s' * (len(self) != 1)}{longest}; fields for the rewards: {fields}"


class FieldCount:
    """The fields of the prompts seen so far: how many hold each (in first-seen order), and the first prompt
    without it. A reward can only use a field every prompt holds; one that only some hold is named in a warning
    (the prompt cache's) and by a reward that needs it, with the first record to fix."""

    def __init__(self) -> None:
        self.n, self.first = 0, ""
        self.held: dict[str, int] = {}
        self.first_without: dict[str, str] = {}

    def add(self, where: str, fields: dict) -> None:
        self.first = self.first or where
        for name in fields:
            if name not in self.held:
                self.held[name] = 0
                if self.n:  # the prompts before this one lack it
                    self.first_without[name] = self.first
            self.held[name] += 1
        for name in self.held.keys() - fields.keys():
            self.first_without.setdefault(name, where)
        self.n += 1

    def meta(self) -> dict:
        return {"fields": [f for f, k in self.held.items() if k == self.n],
                "partial_fields": {f: {"lacking": self.n - k, "first": self.first_without[f]}
                                   for f, k in self.held.items() if k < self.n}}


def field_names(meta: dict, prompts: int) -> FieldNames:
    """FieldCount.meta() (as a prompt cache's meta.json holds it) of `prompts` prompts as FieldNames."""
    return FieldNames(meta["fields"], {f: (prompts, int(p["lacking"]), str(p["first"]))
                                       for f, p in meta.get("partial_fields", {}).items()})


def common_fields(entries: Iterable[tuple[str, RLPrompt]]) -> FieldNames:
    """The fields every prompt holds, in the first one's order (a reward may need only these), and those only
    some hold (`FieldNames.partial`)."""
    count = FieldCount()
    for where, p in entries:
        count.add(where, p.fields)
    return field_names(count.meta(), count.n)


def prompt_rows(records: Iterable[dict], tok, cfg: DataConfig, where: str = "records") -> PromptRows:
    """Records in memory as PromptRows (record n's place is `where:n+1`); a bad record raises BadExample, or with
    data.on_bad_example=skip is left out."""
    entries: list[tuple[str, RLPrompt]] = []
    ids: list[int] = []
    offsets = [0]
    for n, record in enumerate(records):
        place = f"{where}:{n + 1}"
        try:
            p = rl_prompt(record, place, cfg.system_prompt)
            ids += prompt_token_ids(tok, p, place)
        except BadExample:
            if cfg.on_bad_example != "skip":
                raise
            continue
        entries.append((place, p))
        offsets.append(len(ids))
    if not entries:
        raise ShardlmError(f"{where} holds no prompts. Give records such as "
                           '{"prompt": "...", "answer": "..."}.')
    return PromptRows(np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64), entries.__getitem__,
                      common_fields(entries), where)

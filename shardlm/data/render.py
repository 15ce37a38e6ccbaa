"""Examples -> token ids and a target mask: which tokens the loss is taken on.

Text prompt/completion (TRL's rule): the ids of `prompt + completion + EOS`, targets from the common prefix
with the prompt's own ids on. Conversations are rendered by the tokenizer's chat template (transformers'
`apply_chat_template`, so the ids are those it gives) and tokenized with character offsets. Each trained
assistant turn is a character span:

- the answer is where a sentinel put in its place lands in the rendering (exact, whatever the answer says);
- the turn starts where `render(messages[:i], add_generation_prompt=True)` ends, when that is a prefix of the
  whole rendering (templates that render earlier turns differently, such as Mistral's system message in the
  last user turn, start it at the answer), so a header or think block the template writes is trained too;
- it ends after the end-of-turn text the template writes after the answer (`<|im_end|>`, `<|eot_id|>`,
  `<end_of_turn>`, `</s>`, ...), in whole tokens; trailing whitespace is left out.

Any template gives spans this way without knowing its family; one that does not render each answer once, in
order, and unchanged but for trimming, is an error, never a guessed mask. A token is a target when
any of its characters lies in a span (a token that merges prompt and answer text is the answer's).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import cast

import numpy as np

from shardlm import ShardlmError
from shardlm.data.formats import BadExample, Example, Pair


class TemplateError(ShardlmError):
    """The chat template cannot render, or cannot be split into prompt and answer, reliably."""


def _render(tok, messages: list[dict], where: str, generation: bool = False) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, or the template's own raise_exception
        raise BadExample(f"{where}: the chat template refuses this conversation ({str(e).splitlines()[0]}). Fix "
                         "the roles or order of its messages, or use a template that accepts them "
                         "(model.chat_template).") from None


SENTINEL = "\ue000{}\ue001"  # private-use characters: no template trims, escapes or tests for them
SENTINELS = re.compile("\ue000(\\d+)\ue001")


def _end_of_turn(tok, after: str, rendered_last: str) -> int:
    """Characters of `after` (what follows an answer inside the conversation) that end the turn: the longest
    run of whole tokens of `rendered_last` (what the template writes after the answer when it is the last
    message: `<|im_end|>\\n`, `<|end|>\\n<|endoftext|>`, `</s>`) that `after` starts with, trailing space dropped."""
    if not rendered_last:
        return 0
    ends = [e for _, e in tok(rendered_last, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    n = next((e for e in sorted(set(ends), reverse=True) if after.startswith(rendered_last[:e])), 0)
    return len(rendered_last[:n].rstrip())


def assistant_spans(tok, messages: list[dict], first: int, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering and the character spans of the assistant turns from message `first` on.

    Each trained answer is rendered once more as a sentinel: where the sentinels land in that rendering is
    where the answers are (the rendering with the real answers must be the sentinel one with each sentinel
    replaced by its answer, trimmed or not, or the template transforms answers and cannot be split)."""
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
    full = _render(tok, messages, where)
    marked = _render(tok, [{**m, "content": SENTINEL.format(i)} if i in trained else m
                           for i, m in enumerate(messages)], where)
    found = [(int(m.group(1)), m) for m in SENTINELS.finditer(marked)]
    if [i for i, _ in found] != trained:
        raise TemplateError(f"{where}: the chat template does not render each assistant message once, in order, so "
                            "its answers cannot be found. Use another template (model.chat_template) or "
                            "data.train_on_prompt=true.")
    for trim in (False, True):
        rebuilt, answers, at = [], [], 0
        for i, m in found:
            rebuilt.append(marked[at:m.start()])
            start = sum(map(len, rebuilt))
            answer = messages[i]["content"].strip() if trim else messages[i]["content"]
            rebuilt.append(answer)
            answers.append((i, start, start + len(answer), m.end()))
            at = m.end()
        rebuilt.append(marked[at:])
        if "".join(rebuilt) == full:
            break
    else:
        raise TemplateError(f"{where}: the chat template changes the text of assistant answers (not only trimming "
                            "them), so their tokens cannot be found reliably. Use another template "
                            "(model.chat_template) or data.train_on_prompt=true.")
    spans = []
    for i, start, end, marked_end in answers:
        before = _render(tok, messages[:i], where, generation=True)
        alone = _render(tok, [*messages[:i], {**messages[i], "content": SENTINEL.format(i)}], where)
        last = alone[alone.index(SENTINEL.format(i)) + len(SENTINEL.format(i)):]
        turn_start = len(before) if full.startswith(before) and len(before) <= start else start
        spans.append((turn_start, end + _end_of_turn(tok, marked[marked_end:], last)))
    return full, spans


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for i, (a, b) in enumerate(offsets):
        if any(a < e and b > s for s, e in spans) or (a == b and any(s <= a < e for s, e in spans)):
            mask[i] = 1
    return mask


def chat_ids(tok, example: Example, where: str, train_on_prompt: bool) -> tuple[list[int], np.ndarray]:
    if not getattr(tok, "chat_template", None):
        raise ShardlmError(f"{where}: a conversation needs a chat template and tokenizer "
                           f"'{getattr(tok, 'name_or_path', '')}' has none. Set model.chat_template to chatml, plain "
                           "or a .jinja file.")
    if not getattr(tok, "is_fast", False):
        raise ShardlmError(f"tokenizer '{getattr(tok, 'name_or_path', '')}' is a slow (Python) tokenizer: answer "
                           "masks need the character offsets only fast tokenizers give. Use the model's fast "
                           "tokenizer (a folder with tokenizer.json), or data.format=text.")
    full, spans = assistant_spans(tok, example.messages, example.first_trained, where)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if train_on_prompt:
        return ids, np.ones(len(ids), dtype=np.uint8)
    mask = _mask_from_spans(enc["offset_mapping"], spans)
    if not mask.any():
        raise BadExample(f"{where}: no token of the answer survives tokenization. Fix or remove the example.")
    return ids, mask


def completion_ids(tok, example: Example, train_on_prompt: bool) -> tuple[list[int], np.ndarray]:
    """TRL's rule: `prompt + completion` (+ EOS) tokenized whole; the completion starts where its ids stop
    agreeing with the prompt's own."""
    completion = example.completion
    if tok.eos_token and not completion.endswith(tok.eos_token):
        completion += tok.eos_token
    prompt = tok(example.prompt)["input_ids"]
    ids = tok(example.prompt + completion)["input_ids"]
    common = 0
    while common < min(len(prompt), len(ids)) and prompt[common] == ids[common]:
        common += 1
    mask = np.ones(len(ids), dtype=np.uint8)
    if not train_on_prompt:
        mask[:common] = 0
    return list(ids), mask


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_ids(tok, pair: Pair, where: str) -> list[tuple[list[int], np.ndarray]]:
    """[(prompt + chosen ids, their target mask), (prompt + rejected ids, theirs)]: the targets are what is scored.

    Conversations score what instruction tuning trains on the same conversation (chat_ids with the prompt's
    messages untrained): each assistant turn of the answer with its end-of-turn token, whatever the template, and
    not what lies between them (a tool or user turn) nor the whitespace a template writes after an end of turn
    (ChatML's newline after `<|im_end|>`), which no generation emits. TRL's DPOTrainer scores the whole rendering
    after the prompt's instead, newline included: an instruction-tuned model gives that newline -8 to -17 nats,
    which outweighs a short answer's own log-probability in the reference-free objectives' averages (SimPO,
    ORPO); and where a template renders the prompt differently alone (Mistral moves the system message into the
    last user turn) its slice starts inside the prompt. Text pairs follow TRL: EOS appended to each answer, the
    answers start where the prompt's own ids stop agreeing with either side's."""
    if pair.is_chat:
        p = cast(list, pair.prompt)

        def side(answer: list[dict]) -> tuple[list[int], np.ndarray]:
            if answer[-1].get("role") != "assistant":
                raise BadExample(f"{where}: an answer of this pair ends with a '{answer[-1].get('role')}' message; "
                                 "each side must end with the assistant's. Drop the trailing messages.")
            ids, mask = chat_ids(tok, Example(messages=[*p, *answer], first_trained=len(p)), where, False)
            end = int(np.flatnonzero(mask)[-1]) + 1  # the last answer's end of turn: what follows is not scored
            return ids[:end], mask[:end]

        sides = [side(cast(list, pair.chosen)), side(cast(list, pair.rejected))]
        n = min(int(np.flatnonzero(mask)[0]) for _, mask in sides)
        if sides[0][0][:n] != sides[1][0][:n]:
            raise BadExample(f"{where}: the chat template renders the prompt differently before the two answers, so "
                             "they do not share it. Give both answers the same roles and the prompt alone.")
        return sides
    eos = tok.eos_token or ""
    ends = [str(a) if str(a).endswith(eos) else f"{a}{eos}" for a in (pair.chosen, pair.rejected)]
    prompt = list(tok(pair.prompt)["input_ids"])
    chosen, rejected = (list(tok(str(pair.prompt) + a)["input_ids"]) for a in ends)
    n = min(_common(prompt, chosen), _common(prompt, rejected))
    if n >= len(chosen) or n >= len(rejected):
        raise BadExample(f"{where}: an answer of this pair has no tokens after the prompt. Give both answers text.")
    return [(ids, (np.arange(len(ids)) >= n).astype(np.uint8)) for ids in (chosen, rejected)]


def tokenize(tok, example: Example, where: str, train_on_prompt: bool = False) -> tuple[list[int], np.ndarray]:
    """(ids, target mask) of one example; mask[i] = 1 when token i is a target."""
    if example.is_chat:
        return chat_ids(tok, example, where, train_on_prompt)
    return completion_ids(tok, example, train_on_prompt)


def render_examples(tok, examples: Iterable[tuple[str, Example]], train_on_prompt: bool = False):
    """(where, ids, mask) of each example, in order."""
    for where, example in examples:
        ids, mask = tokenize(tok, example, where, train_on_prompt)
        yield where, ids, mask


def show_targets(tok, ids, mask, limit: int = 1200) -> str:
    """An example as text with its trained tokens between ⟦ ⟧ (what `--dry-run` prints)."""
    out: list[str] = []
    run: list[int] = []
    trained = bool(mask[0]) if len(mask) else False
    for i, m in zip(ids, mask, strict=True):
        if bool(m) != trained and run:
            text = tok.decode(run)
            out.append(f"⟦{text}⟧" if trained else text)
            run = []
        trained = bool(m)
        run.append(int(i))
    if run:
        out.append(f"⟦{tok.decode(run)}⟧" if trained else tok.decode(run))
    text = "".join(out)
    return text if len(text) <= limit else text[:limit] + " ..."

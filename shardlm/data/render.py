"""Examples -> token ids and a target mask: which tokens the loss is taken on.

Text prompt/completion (TRL's rule): the ids of `prompt + completion + EOS`, targets from the common prefix
with the prompt's own ids on. Conversations are rendered by the tokenizer's chat template (transformers'
`apply_chat_template`, so the ids are those it gives) and tokenized with character offsets. Each trained
assistant turn is a character span:

- the answer is where a sentinel put in its place lands in the rendering (exact, whatever the answer says);
- the turn starts where `render(messages[:i], add_generation_prompt=True)` ends, when that is a prefix of the
  whole rendering (templates that render earlier turns differently, such as Mistral's system message in the
  last user turn, start it at the answer), so a header or think block the template writes is trained too;
- it ends after the text the template writes to close the turn, in whole tokens: the end-of-turn token
  (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, `</s>`, ...) and the whitespace after it (ChatML's newline), as
  TRL's training templates mark it; with `data.answer_end=end_of_turn` at the end-of-turn token.

Any template gives spans this way without knowing its family; one that does not render each answer once, in
order, and unchanged but for trimming, is an error, never a guessed mask. A token is a target when
any of its characters lies in a span (a token that merges prompt and answer text is the answer's).

A template that marks its answers with `{% generation %}` says itself what is trained: its mask is transformers'
`return_assistant_tokens_mask` as it stands (what TRL's `assistant_only_loss` trains), unless
`data.answer_end=end_of_turn` asks for the spans above.
"""

from __future__ import annotations

import re
from typing import cast

import numpy as np

from shardlm import ShardlmError
from shardlm.data.formats import BadExample, Example, Pair


class TemplateError(ShardlmError):
    """The chat template cannot render, or cannot be split into prompt and answer, reliably."""


GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # TRL's has_generation_markers


def has_generation_markers(tok) -> bool:
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # named variants: the default one renders
        template = template.get("default")
    return isinstance(template, str) and GENERATION.search(template) is not None


def _render(tok, messages: list[dict], where: str, generation: bool = False) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, or the template's own raise_exception
        raise BadExample(f"{where}: the chat template refuses this conversation ({str(e).splitlines()[0]}). Fix "
                         "the roles or order of its messages, or use a template that accepts them "
                         "(model.chat_template).") from None


SENTINEL = "\ue000{}\ue001"  # private-use characters: no template trims, escapes or tests for them
SENTINELS = re.compile("\ue000(\\d+)\ue001")


def _end_of_turn(tok, after: str, rendered_last: str, answer_end: str) -> int:
    """Characters of `after` (what follows an answer inside the conversation) that end the turn: the longest
    run of whole tokens of `rendered_last` (what the template writes after the answer when it is the last
    message: `<|im_end|>\\n`, `<|end|>\\n<|endoftext|>`, `</s>`) that `after` starts with; its trailing
    whitespace dropped with answer_end=end_of_turn (no generation emits what follows the end-of-turn token)."""
    if not rendered_last:
        return 0
    ends = [e for _, e in tok(rendered_last, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    n = next((e for e in sorted(set(ends), reverse=True) if after.startswith(rendered_last[:e])), 0)
    return len(rendered_last[:n].rstrip()) if answer_end == "end_of_turn" else n


def assistant_spans(tok, messages: list[dict], first: int, where: str,
                    answer_end: str = "template") -> tuple[str, list[tuple[int, int]]]:
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
        spans.append((turn_start, end + _end_of_turn(tok, marked[marked_end:], last, answer_end)))
    return full, spans


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for i, (a, b) in enumerate(offsets):
        if any(a < e and b > s for s, e in spans) or (a == b and any(s <= a < e for s, e in spans)):
            mask[i] = 1
    return mask


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def generation_ids(tok, example: Example, where: str) -> tuple[list[int], np.ndarray]:
    """A template with `{% generation %}` markers: transformers' own ids and `assistant_masks` (TRL's
    `assistant_only_loss`). With a prompt (`first_trained`), only what follows it: TRL's completion rule, the ids
    past their common prefix with the prompt's own rendering with the generation prompt."""
    _render(tok, example.messages, where)  # a conversation the template refuses: its one-line error
    out = tok.apply_chat_template(example.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.uint8)
    if example.first_trained:
        prompt = _render(tok, example.messages[:example.first_trained], where, generation=True)
        mask[:_common(list(tok(prompt, add_special_tokens=False)["input_ids"]), ids)] = 0
    if not mask.any():
        raise BadExample(f"{where}: the chat template's {{% generation %}} blocks mark no token of this "
                         f"conversation's answers. Fix the template's markers, or set data.answer_end=end_of_turn "
                         "(shardlm then finds each answer itself).")
    return ids, mask


def chat_ids(tok, example: Example, where: str, train_on_prompt: bool,
             answer_end: str = "template") -> tuple[list[int], np.ndarray]:
    if not getattr(tok, "chat_template", None):
        raise ShardlmError(f"{where}: a conversation needs a chat template and tokenizer "
                           f"'{getattr(tok, 'name_or_path', '')}' has none. Set model.chat_template to chatml, plain "
                           "or a .jinja file.")
    if not getattr(tok, "is_fast", False):
        raise ShardlmError(f"tokenizer '{getattr(tok, 'name_or_path', '')}' is a slow (Python) tokenizer: answer "
                           "masks need the character offsets only fast tokenizers give. Use the model's fast "
                           "tokenizer (a folder with tokenizer.json), or data.format=text.")
    if answer_end == "template" and has_generation_markers(tok) and not train_on_prompt:
        return generation_ids(tok, example, where)
    full, spans = assistant_spans(tok, example.messages, example.first_trained, where, answer_end)
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


def pair_ids(tok, pair: Pair, where: str, answer_end: str = "template") -> list[tuple[list[int], np.ndarray]]:
    """[(prompt + chosen ids, their target mask), (prompt + rejected ids, theirs)]: the targets are what is scored.

    Conversations score what instruction tuning trains on the same conversation (chat_ids with the prompt's
    messages untrained, under the same data.answer_end): each assistant turn of the answer as the template closes
    it, and not what lies between them (a tool or user turn). With answer_end=template that is TRL's DPOTrainer's
    slice on a single answer, ChatML's newline after `<|im_end|>` included (it is trained, so a tuned model
    predicts it); with end_of_turn both stop at the end-of-turn token (no generation emits the newline, and an
    untuned model gives it -8 to -17 nats, which weighs on the reference-free objectives' averages). Where a
    template renders the prompt differently alone (Mistral moves the system message into the last user turn)
    the answers still start at the answer, not inside the prompt as TRL's slice would. Text pairs follow TRL:
    EOS appended to each answer, the answers start where the prompt's own ids stop agreeing with either side's."""
    if pair.is_chat:
        p = cast(list, pair.prompt)

        def side(answer: list[dict]) -> tuple[list[int], np.ndarray]:
            if answer[-1].get("role") != "assistant":
                raise BadExample(f"{where}: an answer of this pair ends with a '{answer[-1].get('role')}' message; "
                                 "each side must end with the assistant's. Drop the trailing messages.")
            ids, mask = chat_ids(tok, Example(messages=[*p, *answer], first_trained=len(p)), where, False, answer_end)
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


def tokenize(tok, example: Example, where: str, train_on_prompt: bool = False,
             answer_end: str = "template") -> tuple[list[int], np.ndarray]:
    """(ids, target mask) of one example; mask[i] = 1 when token i is a target."""
    if example.is_chat:
        return chat_ids(tok, example, where, train_on_prompt, answer_end)
    return completion_ids(tok, example, train_on_prompt)


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

"""`shardlm eval PATH --exact-match N`: answers generated for held-out prompts, scored against the references.

The prompt of a conversation is every message before its last assistant turn, rendered with the chat template's
generation prompt (as `generate --chat` and transformers' pipeline render it); the reference is that turn. A
prompt/completion example's prompt is its prompt text, its reference the completion. Generation is greedy and
stops at the template's end-of-turn token; an answer matches when it equals the reference after trimming
whitespace at both ends. The examples are the validation data's (data.val, or the held-out tail of data.train),
the first N of them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import cast

import torch

from shardlm import ShardlmError
from shardlm.config import DataConfig
from shardlm.data.examples import iter_examples, source_format
from shardlm.data.formats import Example, Pair
from shardlm.data.sources import resolve
from shardlm.inference.generate import generate_batch, pad_id
from shardlm.tokenizer import end_of_turn_id


@dataclass
class Scored:
    prompt: str
    reference: str
    answer: str

    @property
    def exact(self) -> bool:
        return self.answer.strip() == self.reference.strip()


def prompt_and_reference(tok, example: Example) -> tuple[list[int], str]:
    if not example.is_chat:
        return list(tok(example.prompt)["input_ids"]), example.completion
    last = max(i for i, m in enumerate(example.messages) if m["role"] == "assistant")
    ids = tok.apply_chat_template(example.messages[:last], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    return list(ids), example.messages[last]["content"]


def as_example(pair: Pair) -> Example:
    """A preference pair scored as its prompt and the chosen answer."""
    if pair.is_chat:
        prompt, chosen = cast(list, pair.prompt), cast(list, pair.chosen)
        return Example(messages=prompt + chosen, first_trained=len(prompt))
    return Example(prompt=str(pair.prompt), completion=str(pair.chosen))


def held_out_examples(spec: str, split: str, cfg: DataConfig, tail: float | None, n: int) -> list[Example]:
    """The first `n` examples of a source, or of its held-out tail (the last `tail` fraction) as training
    held it out."""
    source = resolve(spec, split, cfg.data_files)
    fmt, variant, where = source_format(source, cfg)
    if fmt == "text":
        raise ShardlmError(f"--exact-match scores answers to prompts; '{spec}' holds text, not prompt/completion or "
                           "chat examples. Point data.val at examples.")
    examples = [e if isinstance(e, Example) else as_example(e)
                for _, _, e in iter_examples(source, fmt, variant, where, cfg, [])]
    if tail is not None:
        examples = examples[int(len(examples) * (1 - tail)):]
    return examples[:n]


def score(model, tok, examples: list[Example], max_new_tokens: int = 64, batch_size: int = 16,
          temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, quiet: bool = False) -> list[Scored]:
    """An answer to each example's prompt: greedy by default, else sampled (seeded)."""
    stop = end_of_turn_id(tok)
    scored = []
    torch.manual_seed(seed)
    for first in range(0, len(examples), batch_size):
        batch = [prompt_and_reference(tok, e) for e in examples[first:first + batch_size]]
        new = generate_batch(model, [ids for ids, _ in batch], max_new_tokens, stop, temperature=temperature,
                             top_p=top_p, pad=pad_id(tok))
        for (ids, reference), [answer] in zip(batch, new, strict=True):
            scored.append(Scored(tok.decode(ids), reference, tok.decode(answer, skip_special_tokens=True)))
        if not quiet:
            print(f"answered {first + len(batch)}/{len(examples)} held-out prompts", file=sys.stderr, flush=True)
    return scored


def summary(scored: list[Scored]) -> dict:
    hits = sum(s.exact for s in scored)
    return {"exact_match": hits / max(len(scored), 1), "exact_match_n": len(scored),
            "examples": [{"reference": s.reference, "answer": s.answer} for s in scored[:5]]}


def answer_quality(scored: list[Scored], temperature: float, top_p: float, seed: int) -> dict:
    """`eval --generation N` on examples: the sampled answers' text metrics next to the references' own,
    ROUGE-L against the references, and exact match (MAUVE compares continuations of text, not answers)."""
    from shardlm.inference.genquality import text_metrics

    answers, references = [s.answer for s in scored], [s.reference for s in scored]
    return {**text_metrics(answers, references), "reference": text_metrics(references),
            "exact_match": sum(s.exact for s in scored) / max(len(scored), 1), "prompts": len(scored),
            "temperature": temperature, "top_p": top_p, "seed": seed, "answers": True}


def describe_answers(g: dict) -> str:
    return "\n".join([
        f"generation: answers to {g['prompts']} held-out prompts (temperature {g['temperature']:g}, top-p "
        f"{g['top_p']:g}, seed {g['seed']})", "                 answers  references",
        *(f"  {name:<14} {g[key]:7.3f}  {g['reference'][key]:7.3f}" for name, key in
          (("distinct-1", "distinct_1"), ("distinct-2", "distinct_2"), ("rep-4", "rep_4"),
           ("self-BLEU", "self_bleu"), ("mean words", "mean_words"))),
        f"  ROUGE-L vs the references {g['rouge_l']:.3f}; exact match {g['exact_match']:.3f}"])

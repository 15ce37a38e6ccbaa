"""Text generation with a KV cache (transformers' `generate`) from a plain, unsharded HF model: batched
prompts (left padding), a sliding window past the model's context, streaming to a terminal.

Text shown to people (`shardlm generate`, the sample at the end of training) is `readable`: each EOS, the
boundary between documents, is the line DOCUMENT_END, other special tokens are left out, and a character cut
off at the end by max_new_tokens is dropped rather than shown as U+FFFD. `--json` output
keeps the exact decoding (EOS as the tokenizer writes it, `<|endoftext|>`): code gets what the tokens are.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.models.hf_config import context_length

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.no_grad()
def generate_batch(hf_model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, eos: int,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, num_samples: int = 1,
                   pad: int | None = None, streamer=None) -> list[list[list[int]]]:
    """For each prompt, the new tokens of each of its samples, cut after the first EOS (unseeded: see
    `generate_tokens`); temperature 0 is greedy decoding, computed once per prompt and repeated.

    Prompts of different lengths are left-padded (`pad`, default EOS) with an attention mask, from which
    `generate` derives each row's position ids, so a row's tokens do not depend on the rest of the batch.
    Past the model's context the window slides, as in nanoGPT: when a row's window fills the context, it
    keeps its last half-context as the prompt and continues with a fresh KV cache, so no position the model
    never trained is used. Each row slides when its own window is full, exactly as it would alone; a round
    ends when the first window in the batch fills, and the others continue from the same window (their
    cache is rebuilt, their tokens are the same). Rows that reach EOS or `max_new_tokens` (or that
    `generate` stopped for another reason) leave the batch.
    """
    from transformers import GenerationMixin

    greedy = temperature <= 0
    copies = 1 if greedy else num_samples
    rows = [list(ids) for ids in prompts for _ in range(copies)]
    if not rows or max_new_tokens <= 0:
        return [[[] for _ in range(num_samples)] for _ in prompts]
    if not isinstance(hf_model, GenerationMixin):  # every causal LM class of transformers is one
        raise ShardlmError(f"{type(hf_model).__name__} cannot generate text: it has no generate() (not a causal LM)")
    embeddings = hf_model.get_input_embeddings()
    vocab = embeddings.num_embeddings if isinstance(embeddings, nn.Embedding) else hf_model.config.vocab_size
    if pad is None or not 0 <= pad < vocab:
        pad = eos  # where the tokenizer has no pad token, or one the model has no embedding for
    device = next(hf_model.parameters()).device
    context = max(2, context_length(hf_model.config) or max(map(len, rows)) + max_new_tokens)
    sampling: dict[str, Any] = {} if greedy else {"temperature": temperature, "top_k": top_k or None, "top_p": top_p}
    starts = [0] * len(rows)
    new: list[list[int]] = [[] for _ in rows]
    active = list(range(len(rows)))
    while active:
        for i in active:
            if len(rows[i]) - starts[i] >= context:
                starts[i] = len(rows[i]) - context // 2
        windows = [rows[i][starts[i]:] for i in active]
        width = max(map(len, windows))
        steps = min(min(max_new_tokens - len(new[i]) for i in active), context - width)
        ids = torch.tensor([[pad] * (width - len(w)) + w for w in windows], device=device)
        mask = torch.tensor([[0] * (width - len(w)) + [1] * len(w) for w in windows], device=device)
        # transformers' annotations of generate's `self` differ by release (a Protocol some mypy runs find no
        # PreTrainedModel satisfies); the model is a GenerationMixin (checked above)
        out = cast(Any, hf_model).generate(ids, attention_mask=mask, max_new_tokens=steps,
                                do_sample=not greedy, pad_token_id=pad, eos_token_id=eos, use_cache=True,
                                streamer=streamer, **sampling)[:, width:].tolist()
        still = []
        for i, tokens in zip(active, out, strict=True):
            tokens = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
            rows[i] += tokens
            new[i] += tokens
            if eos not in tokens and len(tokens) == steps and len(new[i]) < max_new_tokens:
                still.append(i)
        active = still
    grouped = [new[p * copies:(p + 1) * copies] for p in range(len(prompts))]
    return [group * num_samples if greedy else group for group in grouped]


def generate_tokens(hf_model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, eos: int,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                    num_samples: int = 1) -> list[list[int]]:
    """The new tokens of each sample of one prompt, seeded (see `generate_batch`)."""
    torch.manual_seed(seed)
    [samples] = generate_batch(hf_model, [prompt_ids], max_new_tokens, eos, temperature, top_k, top_p, num_samples)
    return samples


def decode_sample(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> tuple[str, str]:
    """(prompt + continuation, continuation): decoded together, so tokens that merge across the boundary
    decode as they would in one text."""
    text = tokenizer.decode(prompt_ids + new_ids, skip_special_tokens=False)
    head = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return text, text[len(head):] if text.startswith(head) else tokenizer.decode(new_ids, skip_special_tokens=False)


DOCUMENT_END = "\n--- end of document ---\n"  # an EOS in readable text


def readable(tokenizer, ids: list[int]) -> str:
    """`ids` decoded for people (see the module docstring): the raw `<|endoftext|>` reads as markup, and a
    U+FFFD at the end is only an incomplete character that the next token would have completed."""
    eos = tokenizer.eos_token_id
    cuts = [i for i, t in enumerate(ids) if t == eos]
    parts = [ids[a + 1:b] for a, b in zip([-1, *cuts], [*cuts, len(ids)], strict=True)]
    text = DOCUMENT_END.join(tokenizer.decode(part, skip_special_tokens=True) for part in parts[:-1])
    last = _complete(tokenizer, parts[-1])
    text += (DOCUMENT_END if cuts else "") + tokenizer.decode(last, skip_special_tokens=True)
    return text.removesuffix("\n") if text.endswith(DOCUMENT_END) else text


def _complete(tokenizer, ids: list[int]) -> list[int]:
    """`ids` without the tokens of an incomplete UTF-8 character at the end (at most 3 bytes, so at most 3
    tokens); a U+FFFD that dropping them does not remove is a real one and stays."""
    if not tokenizer.decode(ids, skip_special_tokens=True).endswith("\ufffd"):
        return ids
    for k in range(1, min(3, len(ids)) + 1):
        if not tokenizer.decode(ids[:-k], skip_special_tokens=True).endswith("\ufffd"):
            return ids[:-k]
    return ids


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer(prompt, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]


def pad_id(tokenizer) -> int:
    """The tokenizer's pad token, or EOS where it has none (GPT-2's has none); padding is left-sided."""
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def text_printer(tokenizer, ids: list[int], eos: int, file: TextIO):
    """A `generate` streamer for one row: prints the prompt at once, then the `readable` text as tokens come
    (an incomplete character at the end waits for its next byte), across the rounds of a sliding window;
    `close()` ends the line. What it prints is what `generate_text` returns, followed by a newline."""
    from transformers.generation.streamers import BaseStreamer

    class TextPrinter(BaseStreamer):
        def __init__(self):
            self.new: list[int] = []
            self.shown, self.prompt_next, self.done = "", True, False
            self._show()

        def put(self, value: torch.Tensor) -> None:
            if self.prompt_next:  # each `generate` call first puts its input window
                self.prompt_next = False
                return
            for token in value.reshape(-1).tolist():
                if not self.done:
                    self.new.append(token)
                    self.done = token == eos
            self._show()

        def end(self) -> None:
            self.prompt_next = True

        def close(self) -> None:
            self._show()
            file.write("\n")
            file.flush()

        def _show(self) -> None:
            text = readable(tokenizer, ids + self.new)
            if text.startswith(self.shown) and len(text) > len(self.shown):
                file.write(text[len(self.shown):])
                file.flush()
                self.shown = text

    return TextPrinter()


@dataclass
class Sample:
    prompt: str
    sample: int
    text: str  # the prompt and its continuation, exactly as decoded
    continuation: str  # exactly as decoded
    new_tokens: int  # EOS included, where the sample ended with one
    shown: str = ""  # `text` for people: `readable`


def iter_samples(hf_model: PreTrainedModel, tokenizer, prompts: list[str], max_new_tokens: int = 100,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 num_samples: int = 1, batch_size: int = 8, stream: TextIO | None = None) -> Iterator[Sample]:
    """The samples of each prompt in order, generated `batch_size` prompts at a time (seeded once).

    With `stream`, a single prompt's single sample is printed there as it is generated."""
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        ids = [prompt_ids(tokenizer, p) for p in batch]
        printer = text_printer(tokenizer, ids[0], eos, stream) \
            if stream is not None and len(prompts) == 1 and num_samples == 1 else None
        results = generate_batch(hf_model, ids, max_new_tokens, eos, temperature, top_k, top_p, num_samples,
                                 pad=pad_id(tokenizer), streamer=printer)
        if printer is not None:
            printer.close()
        for prompt, p_ids, samples in zip(batch, ids, results, strict=True):
            for k, new in enumerate(samples):
                text, continuation = decode_sample(tokenizer, p_ids, new)
                yield Sample(prompt, k, text, continuation, len(new), readable(tokenizer, p_ids + new))


def generate_text(hf_model: PreTrainedModel, tokenizer, prompt: str, max_new_tokens: int = 100,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  num_samples: int = 1) -> list[str]:
    """Samples, prompt included, `readable`: for people, as the sample at the end of training (see `generate_batch`)."""
    return [s.shown for s in iter_samples(hf_model, tokenizer, [prompt], max_new_tokens, temperature, top_k, top_p,
                                         seed, num_samples)]


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line of a UTF-8 file (line ends stripped); blank lines are skipped."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ShardlmError(f"prompt file '{path}' does not exist: give a text file with one prompt per line.")
    if path.is_dir():
        raise ShardlmError(f"prompt file '{path}' is a folder: give a text file with one prompt per line.")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ShardlmError(f"prompt file '{path}' is not UTF-8 text (byte {e.start}): save it as UTF-8.") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ShardlmError(f"prompt file '{path}' holds no prompt (no non-blank line): write one prompt per line.")
    return prompts


def check_options(max_new_tokens: int, temperature: float, top_k: int, top_p: float, num_samples: int,
                  batch_size: int) -> None:
    for name, value, ok, want in (("--max-new-tokens", max_new_tokens, max_new_tokens >= 0, ">= 0"),
                                  ("--temperature", temperature, temperature >= 0, ">= 0 (0 = greedy)"),
                                  ("--top-k", top_k, top_k >= 0, ">= 0 (0 = all tokens)"),
                                  ("--top-p", top_p, 0 < top_p <= 1, "in (0, 1] (1 = off)"),
                                  ("--num-samples", num_samples, num_samples >= 1, ">= 1"),
                                  ("--batch-size", batch_size, batch_size >= 1, ">= 1")):
        if not ok:
            raise ShardlmError(f"{name} must be {want}, got {value}.")


def load_generator(path: str):
    from shardlm.checkpoint.load import load_for_inference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, _cfg, _ckpt = load_for_inference(path, device)
    return model, tokenizer


def generate_command(path: str, prompt: str | None = None, prompt_file: str | None = None,
                     max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                     seed: int = 0, num_samples: int = 1, batch_size: int = 8, as_json: bool = False,
                     out: TextIO | None = None) -> int:
    """`shardlm generate`: each sample's `readable` text (prompt included) on stdout, a single prompt's single
    sample streamed as it is generated; or with `as_json` one line per sample, the text exact:
    {"prompt", "sample", "text" (the continuation), "new_tokens"}. Options are checked before loading."""
    out = sys.stdout if out is None else out
    if prompt is not None and prompt_file is not None:
        raise ShardlmError("give --prompt or --prompt-file, not both.")
    check_options(max_new_tokens, temperature, top_k, top_p, num_samples, batch_size)
    prompts = read_prompts(prompt_file) if prompt_file is not None else ["\n" if prompt is None else prompt]
    model, tokenizer = load_generator(path)
    for s in iter_samples(model, tokenizer, prompts, max_new_tokens, temperature, top_k, top_p, seed, num_samples,
                          batch_size, stream=None if as_json else out):
        if as_json:
            record = {"prompt": s.prompt, "sample": s.sample, "text": s.continuation, "new_tokens": s.new_tokens}
            print(json.dumps(record, ensure_ascii=False), file=out, flush=True)
        elif not (len(prompts) == 1 and num_samples == 1):  # a single sample was streamed
            print(s.shown, file=out, flush=True)
    return 0

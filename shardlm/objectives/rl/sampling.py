"""The generation step of online RL: `group` completions per prompt, as token ids the training forward scores.

`Sampler` is the contract (a Protocol) so that an inference engine (vLLM colocated on the GPU) can replace
`TransformersSampler`, the built-in one: token ids in, token ids out, never text, because a decoded completion
re-tokenized need not give back the sampled ids (BPE round trips differ) and the loss must score what was sampled.

Reproducibility: completion j of a prompt is sampled from a generator of its own, seeded from (seed, the prompt's
key, j); the key is the caller's global index of the prompt (its place in the data order), so the samples do not
depend on which rank holds the prompt, on the batch around it, or on a resume. Each step draws one uniform number
per row and inverts the row's distribution with it, so rows never share a random stream.

`TransformersSampler` runs a transformers causal LM with its KV cache: one forward per prompt (its copies share
the prompt's cache), then one per new token for the rows still running; rows leave the batch at a stop token
(EOS, the chat template's end of turn) or at `max_tokens`. Under FSDP2 it gathers the parameters once per round
(`gathered`), and the model is in eval mode while it samples (no dropout).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from shardlm.objectives.rl.gather import gathered

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    group: int  # completions per prompt
    max_tokens: int  # new tokens per completion at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = all tokens
    stop: tuple[int, ...] = ()  # token ids that end a completion (kept as its last token)
    seed: int = 0


@dataclass
class Rollout:
    """The completions of a round: prompt p's are rows p*group .. (p+1)*group - 1."""
    prompts: list[list[int]]
    completions: list[list[int]]  # each ends with its stop token, unless truncated
    truncated: list[bool]  # cut at max_tokens without a stop token
    group: int
    logps: list[list[float]] = field(default_factory=list)  # each completion token's, from the sampler (`draw`)
    trainable: list[list[int]] = field(default_factory=list)  # per token, 0 for a tool's result; [] = all trained
    tools: dict[str, float] = field(default_factory=dict)  # tool episodes: calls, failed calls, turns (sums)

    def prompt_of(self, row: int) -> list[int]:
        return self.prompts[row // self.group]

    def padded(self, pad: int) -> dict[str, torch.Tensor]:
        """TRL's layout: prompts left-padded, completions right-padded, with their masks (`prompt_ids`,
        `prompt_mask`, `completion_ids`, `completion_mask`, one row per completion)."""
        prompts = [self.prompt_of(i) for i in range(len(self.completions))]
        width = max(map(len, prompts), default=0)
        length = max(map(len, self.completions), default=0)
        return {
            "prompt_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long),
            "prompt_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long),
            "completion_ids": torch.tensor([c + [pad] * (length - len(c)) for c in self.completions],
                                           dtype=torch.long),
            "completion_mask": torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in self.completions],
                                            dtype=torch.long),
        } | ({"tool_mask": torch.tensor([m + [1] * (length - len(m)) for m in self.trainable], dtype=torch.long)}
             if self.trainable else {})


class Sampler(Protocol):
    def sample(self, prompts: Sequence[Sequence[int]], keys: Sequence[int], params: SamplingParams) -> Rollout:
        """`params.group` completions of each prompt; `keys[p]` is prompt p's global index (seeds its samples)."""
        ...


def _mix(x: int) -> int:
    """splitmix64's finalizer: nearby inputs give unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, key: int, sample: int) -> int:
    return _mix(_mix(_mix(seed & MASK64) ^ (key & MASK64)) ^ (sample & MASK64)) & ((1 << 63) - 1)


def pick(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One token per row of `logits` (rows, vocab): the row's `uniforms` value inverts its distribution after
    temperature, top-k and top-p (transformers' rules: top-p keeps the likeliest tokens until their mass reaches
    top_p); temperature 0 is the argmax."""
    return draw(logits, uniforms, temperature, top_k, top_p)[0]


def draw(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int, top_p: float
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`pick`'s tokens and each one's log-probability under the distribution it was drawn from (after temperature,
    top-k and top-p, renormalized: vLLM's `processed_logprobs`, what TRL's importance-sampling correction compares
    with the trainer's); 0 for greedy tokens."""
    if temperature <= 0:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=vocab - 1)
    logps = (probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) / cdf[:, -1]).log()
    return tokens, logps


class TransformersSampler:
    """`Sampler` on a transformers causal LM (the one being trained: `root` is the module FSDP2 shards as its
    root, whose parameters are gathered once per round; `max_rows` bounds the rows decoded at once; `vocab`: the
    tokenizer's ids, where model.vocab_multiple padded the head with ids of no token, which are never drawn)."""

    def __init__(self, model: PreTrainedModel, pad: int, root: nn.Module | None = None, max_rows: int = 64,
                 vocab: int | None = None):
        self.model, self.pad, self.root, self.max_rows = model, pad, root, max(1, max_rows)
        self.vocab = vocab
        forward = inspect.signature(model.forward).parameters
        self.cache_name = "cache" if "cache" in forward else "past_key_values"  # transformers 5's name, or 4's

    @torch.no_grad()
    def sample(self, prompts: Sequence[Sequence[int]], keys: Sequence[int], params: SamplingParams) -> Rollout:
        out = Rollout([list(p) for p in prompts], [], [], params.group)
        per_chunk = max(1, self.max_rows // params.group)  # whole prompts per chunk: their copies share a prefill
        training = self.model.training
        self.model.eval()
        try:
            with gathered(self.root if self.root is not None else self.model):
                for first in range(0, len(prompts), per_chunk):
                    chunk = out.prompts[first:first + per_chunk]
                    completions, logps = self._decode(chunk, keys[first:first + per_chunk], params)
                    out.completions += completions
                    out.logps += logps
        finally:
            self.model.train(training)
        stop = set(params.stop)
        out.truncated = [not c or c[-1] not in stop for c in out.completions]
        return out

    def _decode(self, prompts: list[list[int]], keys: Sequence[int], p: SamplingParams
                ) -> tuple[list[list[int]], list[list[float]]]:
        device = next(self.model.parameters()).device
        gens = [torch.Generator().manual_seed(row_seed(p.seed, k, j)) for k in keys for j in range(p.group)]
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        model: Any = self.model
        first = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        cache = getattr(first, "cache", None) or first.past_key_values  # transformers 5 renamed it `cache`
        cache.batch_repeat_interleave(p.group)
        logits = first.logits[:, -1].repeat_interleave(p.group, dim=0)
        mask = mask.repeat_interleave(p.group, dim=0)
        position = positions[:, -1:].repeat_interleave(p.group, dim=0)
        rows = list(range(len(gens)))  # the rows still running, in cache order
        new: list[list[int]] = [[] for _ in gens]
        new_logps: list[list[float]] = [[] for _ in gens]
        stop = torch.tensor(list(p.stop) or [-1], device=device)
        for step in range(p.max_tokens):
            uniforms = torch.tensor([torch.rand((), generator=gens[r]).item() for r in rows])
            tokens, logps = draw(logits[:, :self.vocab], uniforms, p.temperature, p.top_k, p.top_p)
            for r, t, lp in zip(rows, tokens.tolist(), logps.tolist(), strict=True):
                new[r].append(t)
                new_logps[r].append(lp)
            running = ~torch.isin(tokens, stop)
            if step == p.max_tokens - 1 or not running.any():
                break
            if not running.all():  # finished rows leave the batch (and the cache)
                keep = running.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows = [rows[i] for i in keep.tolist()]
                tokens, mask, position = tokens[keep], mask[keep], position[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position = position + 1
            step_out = model(input_ids=tokens.unsqueeze(1), attention_mask=mask, position_ids=position,
                             use_cache=True, **{self.cache_name: cache})
            logits = step_out.logits[:, -1]
        return new, new_logps

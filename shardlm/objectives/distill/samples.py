"""On-policy distillation (`distill.on_policy`, GKD's λ): the steps that train on the student's own completions.

Which steps: `on_policy_step(seed, step, fraction)` draws one uniform number keyed by (train.seed, the step) and
compares it with the fraction, as GKD draws one per batch; a resumed run, or one on another world size, makes the
same decisions, and no random state is checkpointed.

What such a step trains on: every example of the step's micro-batches keeps its prompt, its tokens before its
first target (the position that predicts the first answer token is the prompt's last), and its answer is replaced
by a completion the student samples from that prompt; the targets are the sampled tokens, up to and including the
end-of-turn token (or EOS) where the completion stopped, -100 elsewhere. A conversation of several turns is cut at
its first answer (GKD samples one answer to a prompt); an example with no target (cut by truncation) is left out:
it scores nothing. A completion is at most `distill.max_new_tokens` long, and shorter where the prompt leaves
fewer positions of `data.seq_len`; it is drawn at `distill.sample_temperature` over the tokenizer's ids.

Layout: the sampled examples are packed again with the data's own packer (best-fit decreasing into rows of
`data.seq_len`, positions restarting per example; with data.packing=false one example per row, right-padded to the
longest), not put back into the rows they came from: a completion longer than the answer it replaces would
not fit its row. A micro-batch's row count may so differ from `train.batch_size`; the loss, a sum over targets
divided by the step's global target count, does not depend on how the examples are laid out.

Sampling is online RL's (objectives.rl.sampling.TransformersSampler: the KV cache, rows leaving at a stop token, the
FSDP2 units gathered once for the whole step's prompts). Each example's generator is seeded from (train.seed, its
key) and the key is the example's place in the data order: its row's global position (the trainer's sampler
position, the same on any world size and after a resume) and its slot in that row, so 2 ranks sample what 1
process samples and a resumed run what the uninterrupted one sampled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from shardlm.data.blocks import IGNORE, Batch
from shardlm.data.packing import best_fit_decreasing
from shardlm.objectives.rl.sampling import SamplingParams, TransformersSampler, row_seed
from shardlm.tokenizer import end_of_turn_id

STEP_STREAM = 0x6F6E2D706F6C6379  # the step decisions' own stream, apart from the samples' (seeded from train.seed)
SLOT_BITS = 20  # an example's key: its row's position x 2^20 + its slot in the row (a row holds < 2^20 examples)


def on_policy_step(seed: int, step: int, fraction: float) -> bool:
    """Whether optimizer step `step` (counted from 0: the trainer's step before it is taken) trains on the
    student's completions: a uniform number keyed by (seed, step) below `fraction`; 0 never, 1 always."""
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    return row_seed(seed ^ STEP_STREAM, step, 0) / float(1 << 63) < fraction


def row_keys(first_position: int, rows: int) -> np.ndarray:
    """The keys of a micro-batch's rows: their global positions in the data order (the trainer's
    `micro_batch_position` for the micro-batch, then one per row)."""
    return np.arange(first_position, first_position + rows, dtype=np.int64)


def example_key(row_key: int, slot: int) -> int:
    return (int(row_key) << SLOT_BITS) | slot


def prompts_of(batch: Batch, keys: np.ndarray) -> tuple[list[list[int]], list[int]]:
    """(prompt ids, key) of each example of `batch` that has a target, in row order then slot order: an example
    begins where its position ids restart at 0; its prompt is what precedes its first target's next token."""
    if batch.positions is None:
        raise ValueError("on-policy distillation samples from examples' prompts; text blocks have none")
    inputs, targets, positions = (t.cpu().numpy() for t in (batch.inputs, batch.targets, batch.positions))
    if len(keys) != len(inputs):
        raise ValueError(f"{len(keys)} keys for a micro-batch of {len(inputs)} rows: give one key per row")
    prompts, out_keys = [], []
    width = inputs.shape[1]
    for r in range(len(inputs)):
        starts = np.flatnonzero(positions[r] == 0)
        for slot, (a, b) in enumerate(zip(starts, [*starts[1:], width], strict=True)):
            scored = np.flatnonzero(targets[r, a:b] != IGNORE)
            if len(scored):
                prompts.append(inputs[r, a:a + int(scored[0]) + 1].tolist())
                out_keys.append(example_key(int(keys[r]), slot))
    return prompts, out_keys


def pack_completions(prompts: Sequence[list[int]], completions: Sequence[list[int]], seq_len: int,
                     packed: bool) -> Batch:
    """Rows of prompt + completion, the completion's tokens the targets: packed best-fit decreasing into rows of
    `seq_len` (`packed`), else one per row right-padded to the longest. Padding is input 0, no target, positions
    restarting (a segment of its own, as the data's rows have it)."""
    lengths = np.array([len(p) + len(c) for p, c in zip(prompts, completions, strict=True)], dtype=np.int64)
    rows = best_fit_decreasing(lengths, seq_len) if packed else [[k] for k in range(len(lengths))]
    width = seq_len if packed else int(lengths.max(initial=1))
    inputs = np.zeros((len(rows), width), dtype=np.int64)
    targets = np.full((len(rows), width), IGNORE, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for k in row:
            p, c, n = prompts[k], completions[k], int(lengths[k])
            inputs[r, at:at + n] = p + c
            targets[r, at + len(p) - 1:at + n - 1] = c
            positions[r, at:at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(width - at)
    return Batch(*(torch.from_numpy(a) for a in (inputs, targets, positions)))


def sampling_params(tokenizer: Any, cfg: Any, max_tokens: int) -> SamplingParams:
    stop = tuple(dict.fromkeys(t for t in (end_of_turn_id(tokenizer), tokenizer.eos_token_id) if t is not None))
    return SamplingParams(group=1, max_tokens=max_tokens, temperature=cfg.distill.sample_temperature, stop=stop,
                          seed=cfg.train.seed)


def step_completions(model: Any, batches: Sequence[Batch], tokenizer: Any, cfg: Any, keys: Sequence[np.ndarray],
                     autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext) -> list[Batch]:
    """`student_completions` of each of a step's micro-batches (`keys[m]`: micro-batch m's row keys), sampled in
    one round: the FSDP2 units are gathered once for the step, not once per micro-batch. `model` is the run's
    CausalLM (the FSDP2 root); `autocast` the run's compute context (plain bf16 without FSDP needs it)."""
    found = [prompts_of(b, k) for b, k in zip(batches, keys, strict=True)]
    prompts = [p for ps, _ in found for p in ps]
    seq_len = cfg.data.seq_len
    caps = [min(cfg.distill.max_new_tokens, seq_len - len(p)) for p in prompts]
    completions: list[list[int]] = []
    if prompts:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        sampler = TransformersSampler(model.hf, pad, root=model, vocab=model.vocab,
                                      max_rows=max(len(ps) for ps, _ in found))
        params = sampling_params(tokenizer, cfg, max(caps))
        with torch.compiler.set_stance("force_eager"), autocast():  # a compiled block would recompile per length
            rollout = sampler.sample(prompts, [k for _, ks in found for k in ks], params)
        # Each row draws from its own generator: cutting at a shorter cap is what sampling with that cap draws
        completions = [c[:cap] for c, cap in zip(rollout.completions, caps, strict=True)]
    out, at = [], 0
    for batch, (ps, _) in zip(batches, found, strict=True):
        if not ps:  # nothing to score: the batch as it is, without targets (the forward keeps collectives matched)
            out.append(batch._replace(targets=torch.full_like(batch.targets, IGNORE)))
            continue
        sampled = pack_completions(ps, completions[at:at + len(ps)], seq_len, cfg.data.packing)
        out.append(sampled.to(batch.inputs.device))
        at += len(ps)
    return out


def student_completions(model: Any, batch: Batch, tokenizer: Any, cfg: Any, keys: np.ndarray,
                        autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext) -> Batch:
    """The micro-batch with each example's answer replaced by a completion sampled from the student (its prompt
    kept, targets = the sampled tokens up to and including the end-of-turn token, -100 elsewhere), sampled with
    the RL sampler's KV cache, FSDP2 units gathered once, seeds keyed by (train.seed, the example's global
    position); `keys` are the rows' global positions in the data order (`row_keys`)."""
    return step_completions(model, [batch], tokenizer, cfg, [keys], autocast)[0]


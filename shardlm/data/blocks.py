"""Packed blocks and a world-size-invariant global order.

Block `i` of a token range is `tokens[i*L : i*L + L + 1]` (inputs and shifted targets). The sampler is an
endless stream of per-epoch permutations, so its whole state is one integer: the global position. A step
consumes `G = world x micro_batch x grad_accum` positions, and micro-step `m` of rank `r` takes
`[pos + (m*world + r)*B, ... + B)`: 2 ranks x 4 blocks train exactly what 1 process x 8 blocks trains, and
a checkpoint's position resumes on any world size.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

IGNORE = -100  # a position that is not a target


class Batch(NamedTuple):
    """A micro-batch: inputs, targets (-100 = not a target) and, for packed examples, position ids that restart
    per example (transformers then keeps attention inside each example); None for text blocks."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    segments: torch.Tensor | None = None  # preference pairs: each position's sequence (2 x pair slot + side), -1 pad
    units: torch.Tensor | None = None  # preference pairs: the pair index of each slot (the reference's rows)

    def map(self, fn) -> Batch:
        return Batch(*(None if t is None else fn(t) for t in self))  # type: ignore[arg-type]

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self.map(torch.Tensor.pin_memory)

    def record_stream(self, stream) -> None:
        for t in self:
            if t is not None:
                t.record_stream(stream)

    def num_targets(self) -> torch.Tensor:
        return (self.targets != IGNORE).sum()


def collate(batches: list[Batch]) -> Batch:
    """Rows of several batches as one (a mixture's sources): right-padded to the longest, position ids made
    for all when any batch has them."""
    width = max(b.inputs.shape[1] for b in batches)
    with_positions = any(b.positions is not None for b in batches)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    parts = []
    for b in batches:
        positions = b.positions
        if with_positions and positions is None:
            positions = torch.arange(b.inputs.shape[1]).expand_as(b.inputs)
        if positions is not None and positions.shape[1] < width:  # the padding is a segment of its own
            positions = torch.cat([positions, torch.arange(width - positions.shape[1]).expand(len(b.inputs), -1)], 1)
        parts.append(Batch(pad(b.inputs, 0), pad(b.targets, IGNORE), positions))
    rows = [p.positions for p in parts if p.positions is not None]
    return Batch(torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts]),
                 torch.cat(rows) if rows else None)


class TokenBlocks:
    def __init__(self, tokens: np.ndarray, seq_len: int, start: int = 0, end: int | None = None):
        self.tokens, self.seq_len, self.start = tokens, seq_len, start
        self.end = len(tokens) if end is None else end
        self.num_blocks = max(0, (self.end - self.start - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_blocks

    def get(self, indices: np.ndarray) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64 tensor."""
        L = self.seq_len
        starts = self.start + np.asarray(indices, dtype=np.int64) * L
        return torch.from_numpy(self.tokens[starts[:, None] + np.arange(L + 1)].astype(np.int64))  # one gather

    def batch(self, indices: np.ndarray) -> Batch:
        tokens = self.get(indices)
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def targets(self, indices: np.ndarray) -> int:
        """Target tokens of these blocks: every position."""
        return len(indices) * self.seq_len

    @property
    def target_tokens(self) -> int:
        return self.num_blocks * self.seq_len


class GlobalSampler:
    def __init__(self, num_blocks: int, seed: int, shuffle: bool = True, stream: tuple[int, ...] = ()):
        """`stream` tells apart the orders of a mixture's sources (shardlm.data.mixture); none for one source."""
        self.num_blocks, self.seed, self.shuffle, self.stream = num_blocks, seed, shuffle, stream
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = (np.random.default_rng([self.seed, *self.stream, epoch]).permutation(self.num_blocks)
                          if self.shuffle else np.arange(self.num_blocks))
        return self._perm

    def indices(self, position: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for k in range(count):
            epoch, offset = divmod(position + k, self.num_blocks)
            out[k] = self._permutation(epoch)[offset]
        return out


def counted(blocks, count: int, seq_len: int) -> str:
    """`count` batch rows of `blocks` in the user's units: text's blocks of seq_len tokens, or rows of examples or
    preference pairs with how many they hold (a pairs file too small for a batch said "blocks of 128 tokens")."""
    group = getattr(blocks, "group", None)
    if group is None:
        return f"{count:,} block{'s' * (count != 1)} of {seq_len} tokens"
    what = "pair" if group == 2 else "example"
    units = int(blocks.row_units.sum())
    return f"{units:,} {what}{'s' * (units != 1)} in {count:,} row{'s' * (count != 1)} of up to {seq_len} tokens"


def micro_batch_position(step_position: int, micro_step: int, rank: int, world: int, batch: int) -> int:
    return step_position + (micro_step * world + rank) * batch


def eval_shares(num_blocks: int, rank: int, world: int, batch: int, max_batches: int) -> list[np.ndarray]:
    """This rank's validation micro-batches: blocks round-robin over ranks, every rank the same number of
    batches (short ones padded with -1, which the evaluator masks out) so collectives stay matched."""
    total = num_blocks if max_batches == 0 else min(num_blocks, max_batches * batch * world)
    mine = np.arange(rank, total, world)
    per_rank = math.ceil(math.ceil(total / world) / batch)
    padded = np.full(per_rank * batch, -1, dtype=np.int64)
    padded[: len(mine)] = mine
    return [padded[i * batch: (i + 1) * batch] for i in range(per_rank)]

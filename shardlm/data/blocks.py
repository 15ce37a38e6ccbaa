"""Packed blocks and a world-size-invariant global order.

Block `i` of a token range is `tokens[i*L : i*L + L + 1]` (inputs and shifted targets). The sampler is an
endless stream of per-epoch permutations, so its whole state is one integer: the global position. A step
consumes `G = world x micro_batch x grad_accum` positions, and micro-step `m` of rank `r` takes
`[pos + (m*world + r)*B, ... + B)`: 2 ranks x 4 blocks train exactly what 1 process x 8 blocks trains, and
a checkpoint's position resumes on any world size.
"""

from __future__ import annotations

import math

import numpy as np
import torch


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

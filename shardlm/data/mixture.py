"""Weighted mixtures (`data.train` a list): several token caches sampled in fixed proportions, the order still
a pure function of the global position.

The blocks of all sources are numbered one after another (`MixtureBlocks`: source `s` from `offsets[s]`). The
sampler cuts the position stream into rounds of `ROUND` positions; in each round source `s` gets exactly
`quota[s]` slots (its weight, rounded by largest remainder), spread evenly over the round with a phase drawn
from (seed, round). The k-th draw of source
`s` is position k of that source's own endless stream of epoch permutations, so a source that runs out starts
its next epoch while the others go on. Everything is a function of the position alone: 2 ranks x 4 blocks draw
what 1 x 8 draws, a checkpoint resumes exactly, and the tokens seen per source are `counts(position) x
seq_len`, with nothing more to save.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from shardlm.data.blocks import Batch, GlobalSampler, TokenBlocks, collate

ROUND = 4096  # positions per round: each source's share is exact to 1/ROUND over every round


def quotas(weights: list[float], round_size: int = ROUND) -> np.ndarray:
    """Slots per round of each source: largest remainder of `weights x round_size`, at least 1 if positive."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * round_size
    quota = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - quota), kind="stable")[: round_size - quota.sum()]:
        quota[i] += 1
    for i in np.flatnonzero((w > 0) & (quota == 0)):  # a tiny positive weight still gets drawn
        quota[np.argmax(quota)] -= 1
        quota[i] = 1
    return quota


class MixtureBlocks:
    """Blocks of several sources as one index space; `order` (optional) maps index -> block of that space."""

    def __init__(self, parts: list, weights: list[float] | None = None,
                 order: np.ndarray | None = None):
        self.parts, self.seq_len, self.order = parts, parts[0].seq_len, order
        self.sizes = [len(p) for p in parts]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.num_blocks = int(self.offsets[-1])
        self.weights = [float(s) for s in self.sizes] if weights is None else [float(w) for w in weights]

    @classmethod
    def interleaved(cls, parts: list) -> MixtureBlocks:
        """Every source spread evenly over the index range, so any prefix (a capped evaluation) holds each
        source in proportion to its blocks."""
        sizes = [len(p) for p in parts]
        keys = np.concatenate([(np.arange(n) + 0.5) / n for n in sizes])
        return cls(parts, order=np.argsort(keys, kind="stable"))

    def __len__(self) -> int:
        return self.num_blocks

    @property
    def sampled_blocks(self) -> int:
        """The blocks of the sources that are sampled at all (weight > 0): what an epoch counts."""
        return sum(n for n, w in zip(self.sizes, self.weights, strict=True) if w > 0)

    def get(self, indices: np.ndarray) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64 tensor, rows in the order of `indices`."""
        idx = np.asarray(indices, dtype=np.int64)
        if self.order is not None:
            idx = self.order[idx]
        source = np.searchsorted(self.offsets, idx, side="right") - 1
        out = torch.empty((len(idx), self.seq_len + 1), dtype=torch.int64)
        for s in np.unique(source):
            mine = source == s
            out[torch.from_numpy(mine)] = self.parts[s].get(idx[mine] - self.offsets[s])
        return out

    def _by_source(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        if self.order is not None:
            idx = self.order[idx]
        return idx, np.searchsorted(self.offsets, idx, side="right") - 1

    def batch(self, indices: np.ndarray) -> Batch:
        """Rows in the order of `indices`; text blocks and example rows side by side (each its own targets)."""
        idx, source = self._by_source(indices)
        if all(isinstance(p, TokenBlocks) for p in self.parts):
            tokens = self.get(indices)
            return Batch(tokens[:, :-1], tokens[:, 1:])
        parts = [self.parts[int(s)].batch(idx[k:k + 1] - self.offsets[int(s)]) for k, s in enumerate(source)]
        return collate(parts)

    def targets(self, indices: np.ndarray) -> int:
        idx, source = self._by_source(indices)
        return sum(self.parts[int(s)].targets(idx[source == s] - self.offsets[s]) for s in np.unique(source))

    @property
    def target_tokens(self) -> int:
        return sum(p.target_tokens for p in self.parts)

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        """The blocks' tokens in one array (what a held-out prompt is drawn from); made on first use."""
        return np.concatenate([p.tokens[p.start:p.end] for p in self.parts])

    @property
    def start(self) -> int:
        return 0

    @property
    def end(self) -> int:
        return len(self.tokens)


class MixtureSampler:
    """Global block indices (into `MixtureBlocks`) for positions; see the module's docstring."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int, round_size: int = ROUND):
        self.sizes, self.seed, self.round_size = sizes, seed, round_size
        self.quota = quotas(weights, round_size)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.sources = [GlobalSampler(n, seed, stream=(1 + s,)) if n else None for s, n in enumerate(sizes)]
        self._round = -1
        self._slots = self._ranks = np.empty(0, dtype=np.int64)

    def _schedule(self, round_index: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of each slot of a round, and how many earlier slots of that round went to the same one.
        Source `s`'s slots sit at `(k + phase_s) / quota_s` of the round (k = 0, 1, ...; the phase drawn from
        (seed, round)): every stretch of positions, a batch too, holds each source within one block of its share."""
        if round_index != self._round:
            phase = np.random.default_rng([self.seed, 0, round_index]).random(len(self.quota))
            keys = np.concatenate([(np.arange(q) + phase[s]) / q for s, q in enumerate(self.quota) if q])
            sources = np.repeat(np.arange(len(self.quota)), self.quota)
            ranks = np.concatenate([np.arange(q) for q in self.quota])
            order = np.argsort(keys, kind="stable")
            self._round, self._slots, self._ranks = round_index, sources[order], ranks[order]
        return self._slots, self._ranks

    def draw(self, position: int) -> tuple[int, int]:
        """(source, how many earlier positions drew that source) of one position."""
        round_index, offset = divmod(position, self.round_size)
        slots, ranks = self._schedule(round_index)
        s = int(slots[offset])
        return s, round_index * int(self.quota[s]) + int(ranks[offset])

    def indices(self, position: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for k in range(count):
            s, n = self.draw(position + k)
            sampler = self.sources[s]
            assert sampler is not None  # a source without blocks has no slots
            out[k] = self.offsets[s] + sampler.indices(n, 1)[0]
        return out

    def counts(self, position: int) -> np.ndarray:
        """Blocks drawn from each source by positions [0, position)."""
        round_index, offset = divmod(position, self.round_size)
        slots, _ = self._schedule(round_index)
        return round_index * self.quota + np.bincount(slots[:offset], minlength=len(self.quota))

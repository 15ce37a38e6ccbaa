"""Examples -> rows of at most `seq_len` tokens: packed whole (best-fit decreasing) or one per row.

A packed row holds several examples back to back; their position ids restart at 0 for each, which is how
transformers' attention (SDPA/eager/flex masks from `find_packed_sequence_indices`, flash-attention varlen on
CUDA) keeps every token inside its own example, and the last token of one example is never trained to predict
the first of the next. Rows are made once from the example lengths, so they are the same on every rank and
world size; the sampler orders rows exactly as it orders text blocks. Best-fit decreasing puts each example,
longest first, into the open row with the least room that still holds it (a segment tree over the room left
finds it in O(log seq_len)): on typical instruction data a few percent of positions are padding.
"""

from __future__ import annotations

import numpy as np
import torch

from shardlm import ShardlmError
from shardlm.data.blocks import IGNORE, Batch
from shardlm.data.examples import ExampleSet


class _RoomTree:
    """Max segment tree over "room left" 0..capacity: which room sizes have an open row (a count per leaf)."""

    def __init__(self, capacity: int):
        self.size = 1 << (capacity + 1).bit_length()
        self.tree = np.zeros(2 * self.size, dtype=np.int64)  # max room index present in the subtree, -1 = none
        self.tree[:] = -1
        self.count = np.zeros(capacity + 1, dtype=np.int64)

    def _set(self, room: int, present: bool) -> None:
        i = self.size + room
        self.tree[i] = room if present else -1
        i //= 2
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i //= 2

    def add(self, room: int) -> None:
        self.count[room] += 1
        if self.count[room] == 1:
            self._set(room, True)

    def remove(self, room: int) -> None:
        self.count[room] -= 1
        if self.count[room] == 0:
            self._set(room, False)

    def smallest_at_least(self, need: int) -> int:
        """The smallest room >= need that some open row has, or -1."""
        if self.tree[1] < need:
            return -1
        i = 1
        while i < self.size:  # descend left whenever the left subtree has a room >= need
            i = 2 * i if self.tree[2 * i] >= need else 2 * i + 1
        return i - self.size


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows (lists of example indices) holding every example of length <= capacity."""
    order = np.argsort(-lengths, kind="stable")
    tree = _RoomTree(capacity)
    rows: list[list[int]] = []
    rows_by_room: dict[int, list[int]] = {}
    for k in order:
        n = int(lengths[k])
        room = tree.smallest_at_least(n)
        if room < 0:
            rows.append([])
            row, room = len(rows) - 1, capacity
        else:
            tree.remove(room)
            row = rows_by_room[room].pop()
        rows[row].append(int(k))
        left = room - n
        if left > 0:
            tree.add(left)
            rows_by_room.setdefault(left, []).append(row)
    return rows


class ExampleRows:
    """Units `[start, end)` of an ExampleSet as rows of at most `seq_len` tokens; `batch(indices)` gives them. A
    unit is an example, or a preference pair: two sequences (prompt + chosen, prompt + rejected) kept in one row,
    so both sides of a pair are in one micro-batch; each sequence then gets at most seq_len / 2 tokens."""

    def __init__(self, examples: ExampleSet, seq_len: int, start: int = 0, end: int | None = None,
                 packing: bool = True, truncation: str = "truncate", name: str = ""):
        self.examples, self.seq_len, self.start, self.packed = examples, seq_len, start, packing
        g = self.group = examples.group
        self.end = len(examples) if end is None else end
        units = np.arange(self.start, self.end)
        cap = seq_len // g
        lengths = examples.lengths.reshape(-1, g)[units]
        long = np.flatnonzero((lengths > cap).any(1))
        what = "pair" if g == 2 else "example"
        if len(long) and truncation == "error":
            limit = f"data.seq_len={seq_len}" + (f" / 2 = {cap} per side" if g == 2 else "")
            raise ShardlmError(f"{name}: {what} {self.start + int(long[0])} has {int(lengths[long[0]].max())} tokens, "
                               f"more than {limit} ({len(long)} such {what}{'s' if len(long) > 1 else ''}). Raise "
                               "data.seq_len, or set data.truncation=truncate or drop.")
        keep = np.ones(len(units), dtype=bool)
        self.truncated = self.dropped = 0
        if truncation == "drop":
            keep[long], self.dropped = False, len(long)
        else:
            self.truncated = len(long)
        targets = examples.targets.reshape(-1, g)[units].copy()
        self.seq_lengths = np.minimum(lengths, cap)
        for k in long:  # truncated: count what is kept
            targets[k] = [self._targets(int(units[k]) * g + j, int(self.seq_lengths[k, j])) for j in range(g)]
        if g == 2:  # a side truncated to nothing of its answer leaves nothing to compare
            empty = keep & (targets == 0).any(1)
            keep &= ~empty
            self.dropped += int(empty.sum())
        self.ids, self.seq_lengths, self.unit_targets = units[keep], self.seq_lengths[keep], targets[keep]
        self.lengths = self.seq_lengths.sum(1)
        self.rows = best_fit_decreasing(self.lengths, seq_len) if packing else [[k] for k in range(len(self.ids))]
        self.row_targets = np.array([self.unit_targets[row].sum() for row in self.rows], dtype=np.int64)
        self.row_units = np.array([len(row) for row in self.rows], dtype=np.int64)
        self.num_blocks = len(self.rows)

    def _targets(self, sequence: int, n: int) -> int:
        a = int(self.examples.offsets[sequence])
        return int(np.asarray(self.examples.labels[a + 1: a + n]).sum())

    def __len__(self) -> int:
        return self.num_blocks

    def targets(self, indices: np.ndarray) -> int:
        return int(self.row_targets[np.asarray(indices, dtype=np.int64)].sum())

    def units(self, indices: np.ndarray) -> int:
        """Examples (or pairs) in these rows: what a preference loss is averaged over."""
        return int(self.row_units[np.asarray(indices, dtype=np.int64)].sum())

    @property
    def positions_used(self) -> int:
        return int(self.lengths.sum())

    @property
    def target_tokens(self) -> int:
        return int(self.row_targets.sum())

    def describe(self) -> str:
        """One line for the run header: what was detected, how it packs, what trains."""
        meta = self.examples.meta
        rows = self.num_blocks * self.seq_len if self.packed else self.positions_used
        what = "pairs" if self.group == 2 else "examples"
        cut = (f", {self.truncated:,} truncated to seq_len" if self.truncated else "") + \
              (f", {self.dropped:,} {what} dropped (longer than seq_len)" if self.dropped else "")
        how = "packed" if self.packed else "one per row"
        return (f"{meta['format']} {what} ({meta['variant']}) from {meta['source']}: {len(self.ids):,} {what} "
                f"{how} into {self.num_blocks:,} rows; {self.target_tokens:,} target tokens "
                f"({self.target_tokens / max(rows, 1):.0%} of positions), padding "
                f"{1 - self.positions_used / max(rows, 1):.1%}{cut}")

    def _row(self, r: int, width: int, slot: int) -> tuple[np.ndarray, ...]:
        """A row's inputs, targets, position ids and sequence ids (`slot` numbers its first unit in the batch)."""
        inputs = np.zeros(width, dtype=np.int64)
        targets = np.full(width, IGNORE, dtype=np.int64)
        positions = np.zeros(width, dtype=np.int64)
        segments = np.full(width, -1, dtype=np.int64)
        at = 0
        for u, k in enumerate(self.rows[r]):
            for j in range(self.group):
                n = int(self.seq_lengths[k, j])
                ids, mask = self.examples.example(int(self.ids[k]) * self.group + j)
                ids, mask = ids[:n], mask[:n]
                inputs[at:at + n] = ids
                targets[at:at + n - 1] = np.where(mask[1:], ids[1:], IGNORE)
                positions[at:at + n] = np.arange(n)
                segments[at:at + n] = (slot + u) * self.group + j
                at += n
        positions[at:] = np.arange(width - at)  # padding: a segment of its own, never a target
        return inputs, targets, positions, segments

    def batch(self, indices: np.ndarray) -> Batch:
        """Rows `indices` (right-padded to the longest when unpacked; packed rows are `seq_len` wide). Pairs also
        carry each position's sequence (2 x pair slot + side) and each slot's pair index."""
        idx = np.asarray(indices, dtype=np.int64)
        width = self.seq_len if self.packed else max((int(self.lengths[self.rows[r]].sum()) for r in idx), default=1)
        slots = np.concatenate([[0], np.cumsum([len(self.rows[r]) for r in idx])]).astype(np.int64)
        rows = [self._row(int(r), width, int(slots[i])) for i, r in enumerate(idx)]
        inputs, targets, positions, segments = (torch.from_numpy(np.stack([row[i] for row in rows])) for i in range(4))
        if self.group == 1:
            return Batch(inputs, targets, positions)
        units = np.concatenate([self.ids[self.rows[r]] for r in idx]) if len(idx) else np.zeros(0, np.int64)
        return Batch(inputs, targets, positions, segments, torch.from_numpy(units.astype(np.int64)))

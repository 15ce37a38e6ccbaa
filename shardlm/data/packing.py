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
    """Examples `[start, end)` of an ExampleSet as rows of at most `seq_len` tokens; `batch(indices)` gives them."""

    def __init__(self, examples: ExampleSet, seq_len: int, start: int = 0, end: int | None = None,
                 packing: bool = True, truncation: str = "truncate", name: str = ""):
        self.examples, self.seq_len, self.start = examples, seq_len, start
        self.end = len(examples) if end is None else end
        lengths = examples.lengths[self.start:self.end]
        long = np.flatnonzero(lengths > seq_len)
        self.truncated = self.dropped = 0
        keep = np.arange(self.start, self.end)
        if len(long) and truncation == "error":
            raise ShardlmError(f"{name}: example {self.start + int(long[0])} has {int(lengths[long[0]])} tokens, more "
                               f"than data.seq_len={seq_len} ({len(long)} such example{'s' if len(long) > 1 else ''})."
                               " Raise data.seq_len, or set data.truncation=truncate or drop.")
        if truncation == "drop":
            keep, self.dropped = keep[lengths <= seq_len], len(long)
        else:
            self.truncated = len(long)
        self.lengths = np.minimum(examples.lengths[keep], seq_len)
        self.ids = keep  # example index of each kept example
        local = best_fit_decreasing(self.lengths, seq_len) if packing else [[k] for k in range(len(keep))]
        self.rows, self.packed = local, packing
        targets = examples.targets[keep]
        for k in np.flatnonzero(examples.lengths[keep] > seq_len):  # truncated: count what is kept
            targets[k] = self._targets(int(k))
        self.row_targets = np.array([targets[row].sum() for row in local], dtype=np.int64)
        self.num_blocks = len(local)

    def _targets(self, k: int) -> int:
        a = int(self.examples.offsets[self.ids[k]])
        return int(np.asarray(self.examples.labels[a + 1: a + int(self.lengths[k])]).sum())

    def __len__(self) -> int:
        return self.num_blocks

    def targets(self, indices: np.ndarray) -> int:
        return int(self.row_targets[np.asarray(indices, dtype=np.int64)].sum())

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
        cut = (f", {self.truncated:,} truncated to seq_len" if self.truncated else "") + \
              (f", {self.dropped:,} longer than seq_len dropped" if self.dropped else "")
        how = "packed" if self.packed else "one per row"
        return (f"{meta['format']} examples ({meta['variant']}) from {meta['source']}: {len(self.ids):,} examples "
                f"{how} into {self.num_blocks:,} rows; {self.target_tokens:,} target tokens "
                f"({self.target_tokens / max(rows, 1):.0%} of positions), padding "
                f"{1 - self.positions_used / max(rows, 1):.1%}{cut}")

    def _row(self, r: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        inputs = np.zeros(width, dtype=np.int64)
        targets = np.full(width, IGNORE, dtype=np.int64)
        positions = np.zeros(width, dtype=np.int64)
        at = 0
        for k in self.rows[r]:
            n = int(self.lengths[k])
            ids, mask = self.examples.example(int(self.ids[k]))
            ids, mask = ids[:n], mask[:n]
            inputs[at:at + n] = ids
            targets[at:at + n - 1] = np.where(mask[1:], ids[1:], IGNORE)
            positions[at:at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(width - at)  # padding: a segment of its own, never a target
        return inputs, targets, positions

    def batch(self, indices: np.ndarray) -> Batch:
        """Rows `indices` (right-padded to the longest when unpacked; packed rows are `seq_len` wide)."""
        idx = np.asarray(indices, dtype=np.int64)
        width = self.seq_len if self.packed else max((int(self.lengths[self.rows[r]].sum()) for r in idx), default=1)
        rows = [self._row(int(r), width) for r in idx]
        return Batch(*(torch.from_numpy(np.stack([row[i] for row in rows])) for i in range(3)))

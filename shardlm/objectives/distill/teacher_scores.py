"""The teacher's top-K log-probabilities of every target, scored once and stored (`distill.teacher_topk=K`).

A teacher too big to hold beside the student during training scores the data once, before the first step, as
the preference reference is scored (shardlm.objectives.preference.pairs): each rank a share of the rows, in rounds that
every rank runs alike (FSDP2's collectives stay matched), each round's scores all-reduced and written by rank 0.
Beside the split's cache folder (the example cache, or the text token cache) lie, per split:

- `teacher-topk-KEY.ids.npy` (targets x K, int32) and `teacher-topk-KEY.logps.npy` (targets x K, float32:
  log-softmax(teacher logits / temperature) over the tokenizer's vocabulary, at those ids), the targets in the
  order the split's rows hold them (row r's are `offsets[r]:offsets[r + 1]`), memory-mapped, never pickled;
- `teacher-topk-KEY.done.npy`: one byte per row, set once the row's scores are on disk (a killed scoring goes
  on from there);
- `teacher-topk-KEY.json`: the header (K, temperature, vocabulary, the teacher's identity, the data's: the cache
  folder, the split's bounds, seq_len, packing and truncation, a hash of every row's target count), whether the
  scoring completed, and the arrays' sizes and checksums.

KEY hashes the header's identity, so another teacher, K, temperature or data reads other files. A row index
always yields the same targets: the rows are fixed by the cache and those settings (packing is a deterministic
best fit), and the hash of the rows' target counts in the key catches anything else. Past the first step a
missing, unfinished or damaged store is an error naming the fix, as is (at any step) a file under this KEY whose
header names other scores.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shardlm import ShardlmError
from shardlm.data import Batch, ExampleRows, TokenBlocks, integrity
from shardlm.models.distill_loss import TopKTeacher
from shardlm.models.loss import IGNORE

FORMAT = 1
CHUNK = 1024  # targets whose (chunk x vocab) logits are reduced to their top K at a time
RESTART = "start over with checkpoint.resume=none (or a new out_dir)"


@dataclass
class _Store:
    offsets: np.ndarray  # [rows + 1]: where each row's targets start in the arrays
    ids: np.ndarray  # [targets, K] int32, memory-mapped
    logps: np.ndarray  # [targets, K] float32, memory-mapped


class TeacherScores:
    """The stored top-K scores of the training and validation rows, read per micro-batch."""

    def __init__(self, stores: dict[str, _Store], device: torch.device, key: dict[str, str]):
        self.stores, self.device, self.key = stores, device, key

    def for_rows(self, split: str, indices: np.ndarray, batch: Batch) -> TopKTeacher:
        """The scores of the targets of rows `indices` of `split`, in the order the micro-batch holds them
        (row by row). Negative indices (validation's padding rows, whose targets are masked) hold none."""
        store = self.stores[split]
        idx = np.asarray(indices, dtype=np.int64)
        spans = [(int(store.offsets[r]), int(store.offsets[r + 1])) for r in idx[idx >= 0]]
        ids = np.concatenate([store.ids[a:b] for a, b in spans]) if spans else np.zeros((0, store.ids.shape[1]))
        logps = np.concatenate([store.logps[a:b] for a, b in spans]) if spans else np.zeros(ids.shape)
        device = batch.targets.device
        return TopKTeacher(torch.from_numpy(ids.astype(np.int64)).to(device),
                           torch.from_numpy(logps.astype(np.float32)).to(device))


@dataclass
class _Paths:
    folder: Path
    key: str

    def file(self, part: str) -> Path:
        return self.folder / f"teacher-topk-{self.key}.{part}"

    header = property(lambda self: self.file("json"))
    ids = property(lambda self: self.file("ids.npy"))
    logps = property(lambda self: self.file("logps.npy"))
    done = property(lambda self: self.file("done.npy"))


@dataclass
class _Scoring:
    """What one split's scoring needs (built by prepare_teacher_topk)."""
    dist: Any
    teacher: torch.nn.Module
    k: int
    temperature: float
    vocab: int
    batch: int
    step: int
    autocast: Callable[[], AbstractContextManager[Any]]


def prepare_teacher_topk(run, teacher, k: int, temperature: float, *, identity: Any = None, step: int = 0,
                         batch: int | None = None,
                         autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
                         ) -> TeacherScores:
    """The top-K scores of the training and validation rows: read from beside their caches, or (before the first
    step, `step` 0) scored by `teacher` and stored there, a killed scoring continued. `identity`: the teacher's
    (shardlm.objectives.distill.teacher's, JSON-able); by default its files' hashes."""
    cfg, dist = run.cfg, run.dist
    vocab = len(run.tokenizer)
    if k > vocab:
        raise ShardlmError(f"distill.teacher_topk={k} is more than the vocabulary's {vocab} tokens: set it to at "
                           f"most {vocab} (all of them: the whole distribution).")
    ident = identity if identity is not None else default_identity(cfg)
    scoring = _Scoring(dist, teacher, k, float(temperature), vocab, batch or cfg.train.batch_size, step, autocast)
    stores, keys = {}, {}
    for split, blocks in (("train", run.train), ("val", run.val)):
        header = _header(blocks, k, temperature, vocab, ident, cfg.parallel.precision)
        paths = _Paths(_folder(blocks, split), _key(header))
        stores[split], keys[split] = _prepare_split(scoring, split, blocks, paths, header), paths.key
    return TeacherScores(stores, dist.device, keys)


def default_identity(cfg) -> Any:
    """The teacher named by `distill.teacher`: its config's and weights' hashes (the name alone when not local)."""
    from shardlm.checkpoint.provenance import base_identity

    ident = base_identity(cfg.distill.teacher)
    return {k: ident.get(k) for k in ("name", "config_sha256", "weights_sha256")}


def _folder(blocks, split: str) -> Path:
    """The cache folder the split's rows are read from: the store lies beside them."""
    folder = None
    if isinstance(blocks, ExampleRows):
        folder = blocks.examples.meta.get("folder")
    elif isinstance(blocks, TokenBlocks):
        folder = getattr(blocks.tokens, "filename", None)
        folder = None if folder is None else Path(folder).parent
    else:
        raise ShardlmError(f"distill.teacher_topk stores the teacher's scores of one data source, and the {split} "
                           "data is a mixture (data.train a list): train on one source, or set "
                           "distill.teacher_topk=0 (the live teacher).")
    if folder is None:
        raise ShardlmError(f"the {split} data has no cache folder to store the teacher's scores beside")
    return Path(folder)


def _offsets(blocks) -> np.ndarray:
    """Where each row's targets start among the split's: examples' answers, or every position of a text block."""
    if isinstance(blocks, ExampleRows):
        counts = blocks.row_targets
    else:
        counts = np.full(len(blocks), blocks.seq_len, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _header(blocks, k: int, temperature: float, vocab: int, identity: Any, precision: str) -> dict:
    offsets = _offsets(blocks)
    data = {"cache": _folder(blocks, "").name, "kind": type(blocks).__name__, "start": int(blocks.start),
            "end": int(blocks.end), "seq_len": int(blocks.seq_len), "rows": len(blocks),
            "targets": int(offsets[-1]), "rows_sha256": hashlib.sha256(offsets.tobytes()).hexdigest()[:16]}
    if isinstance(blocks, ExampleRows):
        data |= {"packing": bool(blocks.packed), "truncated": int(blocks.truncated), "dropped": int(blocks.dropped)}
    header = {"format": FORMAT, "k": int(k), "temperature": float(temperature), "vocab": int(vocab),
              "precision": precision, "teacher": identity, "data": data}
    return json.loads(json.dumps(header, sort_keys=True, default=str))  # as it reads back from the file


def _key(header: dict) -> str:
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()[:16]


def _prepare_split(s: _Scoring, split: str, blocks, paths: _Paths, header: dict) -> _Store:
    state = s.dist.run_on_main(_inspect, paths, header, s.step)
    if state != "complete":
        _score(s, split, blocks, paths, header, fresh=state == "new")
    if not paths.header.is_file():  # written by rank 0: this rank does not see its folder
        raise ShardlmError(f"rank {s.dist.rank} cannot see {paths.header}, which rank 0 wrote: distill.teacher_topk "
                           "needs data.cache_dir on a filesystem that every node shares.")
    return _Store(_offsets(blocks), np.load(paths.ids, mmap_mode="r"), np.load(paths.logps, mmap_mode="r"))


def _inspect(paths: _Paths, header: dict, step: int) -> str:
    """Rank 0's reading of the store: "complete", "partial" (a scoring to go on with) or "new"; an error where
    the run is past its first step and cannot use what it finds, or where the file names other scores."""
    if not paths.header.is_file():
        if step > 0:
            raise _missing(paths, "are missing")
        return "new"
    try:
        saved = json.loads(paths.header.read_text())
        complete, check = bool(saved.pop("complete")), saved.pop("check", None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return _damaged(paths, f"{paths.header} is not a readable header", step)
    if saved != header:
        raise _stale(paths, saved, header)
    if not complete:
        if step > 0:
            raise _missing(paths, "were never completed")
        return "partial" if _arrays_problem(paths, header) is None else "new"
    why = integrity.problem(paths.folder, check, {}) or _arrays_problem(paths, header)
    return "complete" if why is None else _damaged(paths, why, step)


def _arrays_problem(paths: _Paths, header: dict) -> str | None:
    shape = (header["data"]["targets"], header["k"])
    try:
        arrays = [np.load(p, mmap_mode="r") for p in (paths.ids, paths.logps, paths.done)]
    except (OSError, ValueError, EOFError):
        return f"{paths.ids.name} and its companions are not whole .npy files"
    if arrays[0].shape != shape or arrays[1].shape != shape or arrays[2].shape != (header["data"]["rows"],):
        return f"{paths.ids.name} and its companions do not hold ({shape[0]} targets, K={shape[1]}) scores"
    return None


def _damaged(paths: _Paths, why: str, step: int) -> str:
    if step > 0:
        raise ShardlmError(f"{why}: the teacher's stored top-K scores of this run cannot be read back. Delete "
                           f"{paths.folder}/teacher-topk-{paths.key}.* and {RESTART}; they are scored again.")
    print(f"warning: {why}: the teacher's top-K scores are computed again", flush=True)
    return "new"


def _missing(paths: _Paths, what: str) -> ShardlmError:
    return ShardlmError(f"the teacher's stored top-K scores of this run (teacher-topk-{paths.key}.* in "
                        f"{paths.folder}) {what}: the cache was cleared, or distill.teacher, teacher_topk, temperature "
                        "or the data changed since the run started. Resume with the run's own settings, or "
                        f"{RESTART}.")


def _stale(paths: _Paths, saved: dict, header: dict) -> ShardlmError:
    differ = sorted(k for k in header if saved.get(k) != header[k]) or sorted(saved)
    return ShardlmError(f"{paths.header} holds the top-K scores of another {'/'.join(differ)} than this run's: it "
                        f"is not this run's store. Delete {paths.folder}/teacher-topk-{paths.key}.* and rerun.")


def _create(paths: _Paths, header: dict) -> None:
    """Empty arrays and an unfinished header (rank 0), after checking the disk can hold them."""
    targets, k, rows = header["data"]["targets"], header["k"], header["data"]["rows"]
    need = targets * k * 8 + rows
    free = shutil.disk_usage(paths.folder).free
    if need > free:
        raise ShardlmError(f"the teacher's top-{k} scores of {targets:,} targets need {need / 2**30:.1f} GiB in "
                           f"{paths.folder}, which has {free / 2**30:.1f} GiB free: lower distill.teacher_topk or set "
                           "data.cache_dir to a larger disk.")
    for path, dtype, shape in ((paths.ids, np.int32, (targets, k)), (paths.logps, np.float32, (targets, k)),
                               (paths.done, np.uint8, (rows,))):
        np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape).flush()
    _write_header(paths, {**header, "complete": False})


def _write_header(paths: _Paths, content: dict) -> None:
    tmp = paths.header.with_name(f"{paths.header.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(content, sort_keys=True, indent=1))
    tmp.rename(paths.header)


def _score(s: _Scoring, split: str, blocks, paths: _Paths, header: dict, fresh: bool) -> None:
    """Scores the rows not yet done: rounds of `batch` rows per rank, rank 0 writing each round's scores."""
    dist = s.dist
    if fresh:
        dist.run_on_main(_create, paths, header)
    dist.barrier()
    pending = dist.broadcast_object(np.flatnonzero(np.load(paths.done) == 0) if dist.is_main else None)
    offsets = _offsets(blocks)
    todo = int((offsets[pending + 1] - offsets[pending]).sum())
    dist.print(f"teacher: scoring the top {s.k} of {todo:,} targets of the {split} data ({len(pending):,} rows; "
               f"once, stored beside its cache{', continued' if not fresh else ''})")
    out = [np.lib.format.open_memmap(p, mode="r+") for p in (paths.ids, paths.logps, paths.done)] \
        if dist.is_main else None
    head = _gathered_head(s.teacher, s.vocab)
    per_round = s.batch * dist.world_size
    s.teacher.eval()
    for start in range(0, len(pending), per_round):
        rows = pending[start:start + per_round]
        ids, logps = _score_round(s, blocks, rows, offsets, head)
        if out is not None:
            _write_round(out, rows, offsets, ids, logps)
    if dist.is_main:
        check = integrity.record(paths.folder, [paths.ids.name, paths.logps.name])
        _write_header(paths, {**header, "complete": True, "check": check})
    dist.barrier()


def _score_round(s: _Scoring, blocks, rows: np.ndarray, offsets: np.ndarray, head) -> tuple[np.ndarray, ...]:
    """Every rank scores its share of `rows` (padded to `batch` rows: the same forwards on every rank); the
    scores of all of them, summed over ranks into one buffer where each rank wrote only its own rows' slots."""
    dist = s.dist
    counts = offsets[rows + 1] - offsets[rows]
    starts = np.concatenate([[0], np.cumsum(counts)])
    ids = torch.zeros((int(starts[-1]), s.k), dtype=torch.int32, device=dist.device)
    logps = torch.zeros((int(starts[-1]), s.k), dtype=torch.float32, device=dist.device)
    mine = np.arange(dist.rank, len(rows), dist.world_size)
    real = np.zeros(s.batch, dtype=bool)
    real[:len(mine)] = True
    indices = np.zeros(s.batch, dtype=np.int64)
    indices[:len(mine)] = rows[mine]
    batch = blocks.batch(indices).to(dist.device)
    batch = batch._replace(targets=batch.targets.masked_fill(~torch.from_numpy(real).to(dist.device)[:, None], IGNORE))
    with s.autocast():
        got_ids, got_logps = _topk(s.teacher, batch, head, s.vocab, s.k, s.temperature)
    at = 0
    for m in mine:  # this rank's rows, in the order the batch holds their targets
        n = int(counts[m])
        ids[starts[m]:starts[m] + n], logps[starts[m]:starts[m] + n] = got_ids[at:at + n], got_logps[at:at + n]
        at += n
    if at != got_ids.shape[0]:
        raise RuntimeError(f"the teacher scored {got_ids.shape[0]} targets where the rows hold {at}")
    return dist.all_reduce_sum(ids).cpu().numpy(), dist.all_reduce_sum(logps).cpu().numpy()


def _write_round(out: list[np.memmap], rows: np.ndarray, offsets: np.ndarray, ids: np.ndarray,
                 logps: np.ndarray) -> None:
    """Rank 0: the round's scores into the arrays, flushed before the rows are marked done."""
    store_ids, store_logps, done = out
    at = 0
    for r in rows:
        a, b = int(offsets[r]), int(offsets[r + 1])
        store_ids[a:b], store_logps[a:b] = ids[at:at + b - a], logps[at:at + b - a]
        at += b - a
    store_ids.flush()
    store_logps.flush()
    done[rows] = 1
    done.flush()


@torch.no_grad()
def _gathered_head(teacher, vocab: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The teacher's head over the vocabulary as plain tensors (a sharded DTensor gathered once, on every rank),
    or None where the family's logits come from its own forward (shardlm.models.causal_lm's full_logits)."""
    head = teacher.hf.get_output_embeddings()
    if teacher.full_logits or head is None:
        return None, None
    weight, bias = head.weight, getattr(head, "bias", None)
    weight, bias = (None if t is None else (t.full_tensor() if hasattr(t, "full_tensor") else t)[:vocab].detach()
                    for t in (weight, bias))
    return weight, bias


@torch.no_grad()
def _topk(teacher, batch: Batch, head, vocab: int, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32, log-probabilities float32) of the top K of each target's tempered teacher distribution over the
    vocabulary, the targets read row by row: through the gathered head, a chunk of targets at a time, or from the
    logits of a family that transforms them (soft-capping, logit scale) or has no head to take."""
    weight, bias = head
    out = _body(teacher)(batch.inputs, batch.positions)
    keep = (batch.targets.flatten() != IGNORE).nonzero().squeeze(1)
    through_head = weight is not None
    rows = (out.last_hidden_state if through_head else out.logits).flatten(0, 1).index_select(0, keep)
    ids, logps = [], []
    for s in range(0, rows.shape[0], CHUNK):
        z = rows[s:s + CHUNK]
        if through_head:
            z = F.linear(z, weight.to(z.dtype), None if bias is None else bias.to(z.dtype))
        top = (z[:, :vocab].float() / temperature).log_softmax(-1).topk(k, -1)
        ids.append(top.indices.to(torch.int32))
        logps.append(top.values)
    if not ids:
        return torch.zeros((0, k), dtype=torch.int32, device=rows.device), torch.zeros((0, k), device=rows.device)
    return torch.cat(ids), torch.cat(logps)


def _body(teacher) -> Callable:
    """The teacher's body as an FSDP2 forward (its root unit gathered around the call), registered once."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if isinstance(teacher, FSDPModule) and not getattr(teacher, "_shardlm_body_registered", False):
        register_fsdp_forward_method(teacher, "_body")  # type: ignore[arg-type]  # an nn.Module too
        setattr(teacher, "_shardlm_body_registered", True)  # noqa: B010
    return teacher._body

"""Example sources -> a memory-mapped example cache: ids, target mask and where each example starts.

Layout: `CACHE/<key>/tokens.bin` (ids, uint16 or uint32), `labels.bin` (uint8: 1 = a target), `offsets.npy`
(int64, example k is `[offsets[k], offsets[k+1])`), `records.npy` (the source record each example came from,
for errors that name a line) and `meta.json`. The key covers the source, the tokenizer, the chat template and
every option that changes ids or masks, but not `data.seq_len`: one cache serves every context length, and
truncation and packing happen when rows are made (shardlm.data.packing). Built like the token cache: under a
temporary name, renamed when whole, one builder at a time (`cache.build_lock`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlm import ShardlmError
from shardlm.config import DataConfig
from shardlm.data import integrity
from shardlm.data.cache import build_once, read_meta
from shardlm.data.formats import BadExample, Example, Pair, detect, to_example, to_pair, variant_of
from shardlm.data.records import first_record, iter_records
from shardlm.data.render import pair_ids, tokenize
from shardlm.data.sources import Source
from shardlm.tokenizer import fingerprint, template_fingerprint

EXAMPLES_FORMAT = 2  # 2: a conversation pair scores what instruction tuning trains (render.pair_ids)
# 3: conversations whose answers end as the template closes them (data.answer_end=template: a {% generation %} block,
# ChatML's newline after <|im_end|>). Other caches keep 2, whose masks did not change: a run started before
# (and a DPO run's stored reference beside its cache) resumes on its own cache with data.answer_end=end_of_turn.
TEMPLATE_ENDS_FORMAT = 3


@dataclass
class ExampleSet:
    tokens: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    records: np.ndarray
    meta: dict

    def __len__(self) -> int:
        """Units: examples, or preference pairs (two sequences each)."""
        return (len(self.offsets) - 1) // self.group

    @property
    def group(self) -> int:
        return 2 if "pairs" in self.meta else 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @functools.cached_property
    def targets(self) -> np.ndarray:
        """Target tokens of each whole example (its first token is never one: nothing precedes it), in one pass."""
        if len(self.offsets) == 1:
            return np.zeros(0, dtype=np.int64)
        starts = self.offsets[:-1]
        return np.add.reduceat(self.labels, starts, dtype=np.int64) - np.asarray(self.labels[starts], dtype=np.int64)

    def example(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        return np.asarray(self.tokens[a:b], dtype=np.int64), np.asarray(self.labels[a:b], dtype=bool)


def source_format(source: Source, cfg: DataConfig) -> tuple[str, str, str]:
    """(format, variant, where) of a source: `data.format`, or with auto what its first record holds."""
    if cfg.format == "text":
        return "text", "text", source.spec
    first = first_record(source)
    if first is None:
        if cfg.format != "auto":
            raise ShardlmError(f"data.format={cfg.format} but '{source.spec}' is plain text (a document, not "
                               "records). Give .jsonl/.parquet/.csv examples, or set data.format=text.")
        return "text", "text", source.spec
    where, record = first
    if cfg.format == "auto":
        fmt, variant = detect(record)
    else:
        fmt, variant = cfg.format, variant_of(record, cfg.format, where, cfg.text_field)
    return fmt, variant, where


def _conversations(source: Source, variant: str) -> bool:
    """Whether a source's examples are conversations (their masks depend on data.answer_end), from its first."""
    if variant in ("messages", "sharegpt", "alpaca"):
        return True
    first = first_record(source)
    return first is not None and isinstance(first[1].get("chosen", first[1].get("prompt")), list)


def examples_key(source: Source, tok, cfg: DataConfig, variant: str) -> str:
    template_ends = cfg.answer_end == "template" and _conversations(source, variant)
    ident = [TEMPLATE_ENDS_FORMAT if template_ends else EXAMPLES_FORMAT, source.identity(), fingerprint(tok),
             template_fingerprint(tok), variant, cfg.train_on_prompt, cfg.on_bad_example, cfg.system_prompt]
    return "ex-" + hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]


def iter_examples(source: Source, fmt: str, variant: str, first_where: str, cfg: DataConfig,
                  skipped: list[str]) -> Iterator[tuple[int, str, Example | Pair]]:
    """(record number, where, example) of every record; bad ones raise, or with on_bad_example=skip are
    appended to `skipped` (their messages)."""
    for n, (where, record) in enumerate(iter_records(source)):
        try:
            if detect(record)[0] not in (fmt, "text"):
                found = detect(record)[1]
            else:
                found = variant_of(record, fmt, where, cfg.text_field)
            if found != variant:
                raise BadExample(f"{where}: this record is a '{found}' example, but the first record ({first_where}) "
                                 f"is '{variant}': one source holds one format. Convert the records to one format "
                                 "or split them into two sources (a list data.train).")
            yield n, where, to_pair(record, where, cfg.system_prompt) if fmt == "preference" else \
                to_example(record, found, where, cfg.system_prompt)
        except BadExample as e:
            if cfg.on_bad_example != "skip":
                raise
            skipped.append(str(e))


def _write(source: Source, tok, cfg: DataConfig, fmt: str, variant: str, first_where: str, tmp: Path) -> dict:
    dtype = np.uint16 if len(tok) <= np.iinfo(np.uint16).max + 1 else np.uint32
    offsets, records, skipped = [0], [], []  # type: list[int], list[int], list[str]
    targets = identical = unanswered = 0
    with open(tmp / "tokens.bin", "wb") as ids_out, open(tmp / "labels.bin", "wb") as labels_out:
        for n, where, example in iter_examples(source, fmt, variant, first_where, cfg, skipped):
            try:
                sequences = _sequences(tok, example, where, cfg.train_on_prompt, cfg.answer_end)
            except BadExample as e:
                if cfg.on_bad_example != "skip":
                    raise
                skipped.append(str(e))
                continue
            identical += isinstance(example, Pair) and example.identical
            unanswered += isinstance(example, Example) and example.is_chat and \
                example.messages[-1].get("role") != "assistant"
            for ids, mask in sequences:  # a pair is two examples: prompt + chosen, prompt + rejected
                ids_out.write(np.asarray(ids, dtype=dtype).tobytes())
                labels_out.write(mask.astype(np.uint8).tobytes())
                offsets.append(offsets[-1] + len(ids))
                records.append(n)
                targets += int(mask[1:].sum())
    np.save(tmp / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    np.save(tmp / "records.npy", np.asarray(records, dtype=np.int64))
    if len(records) == 0:
        why = f" (all {len(skipped)} were skipped as bad; the first: {skipped[0]})" if skipped else ""
        raise ShardlmError(f"data source '{source.spec}' holds no {fmt} examples{why}. Give examples, or fix them.")
    return {"examples": len(records), "num_tokens": offsets[-1], "targets": targets, "dtype": np.dtype(dtype).name,
            "format": fmt, "variant": variant, "skipped": len(skipped), "first_skipped": skipped[:3],
            **({"pairs": len(records) // 2, "identical_pairs": identical} if fmt == "preference" else {}),
            **({"unanswered": unanswered} if fmt == "chat" else {})}


def _sequences(tok, example: Example | Pair, where: str, train_on_prompt: bool,
               answer_end: str) -> list[tuple[list[int], np.ndarray]]:
    """An example's (ids, target mask); a pair's two: the answers are the targets (`pair_ids`)."""
    if isinstance(example, Pair):
        return pair_ids(tok, example, where, answer_end)
    return [tokenize(tok, example, where, train_on_prompt, answer_end)]


def build_examples(source: Source, tok, cfg: DataConfig, root: Path, log: Callable[[str], None] = print) -> Path:
    """The example cache folder of `source`, built first when none is complete."""
    fmt, variant, first_where = source_format(source, cfg)
    folder = root / examples_key(source, tok, cfg, variant)

    def write(tmp: Path) -> dict:
        log(f"rendering {variant} examples of {source.spec} -> {folder}")
        stats = _write(source, tok, cfg, fmt, variant, first_where, tmp)
        return {**stats, "source": source.spec, "tokenizer": getattr(tok, "name_or_path", ""),
                "text_bytes": sum(p.stat().st_size for p in source.files) if source.files else None}

    folder, meta = build_once(folder, write, log)
    if meta is not None:
        if meta.get("identical_pairs"):
            log(f"warning: {meta['identical_pairs']:,} pair(s) of {source.spec} have the same chosen and rejected "
                "answer: they teach nothing (their DPO loss is constant)")
        if meta.get("unanswered"):
            log(f"warning: {meta['unanswered']:,} conversation(s) of {source.spec} end with a message after the last "
                "assistant answer: that turn is context with no answer to train (end each with the assistant's "
                "answer, or drop the trailing turn)")
        if meta["skipped"]:
            log(f"warning: skipped {meta['skipped']:,} bad example{'s' if meta['skipped'] != 1 else ''} "
                f"(data.on_bad_example=skip); the first: {meta['first_skipped'][0]}")
        log(f"rendered {count_words(meta)} into {meta['num_tokens']:,} tokens ({meta['targets']:,} targets) in "
            f"{meta['seconds']:.1f}s")
    return folder


def count_words(meta: dict) -> str:
    """What an example cache holds, in words: examples, or preference pairs (each two sequences)."""
    if "pairs" in meta:
        return f"{meta['pairs']:,} pair{'s' * (meta['pairs'] != 1)} ({meta['examples']:,} sequences)"
    return f"{meta['examples']:,} example{'s' * (meta['examples'] != 1)}"


def load_examples(folder: Path) -> ExampleSet:
    meta = read_meta(folder)
    n, dtype = meta["num_tokens"], np.dtype(meta["dtype"])
    return ExampleSet(np.memmap(folder / "tokens.bin", dtype=dtype, mode="r", shape=(n,)),
                      np.memmap(folder / "labels.bin", dtype=np.uint8, mode="r", shape=(n,)),
                      np.load(folder / "offsets.npy"), np.load(folder / "records.npy"), {**meta, "folder": str(folder)})


def _check_file(reference: Path) -> Path:
    return reference.with_name(f"{reference.stem}.check.json")


def save_reference(path: Path, values: np.ndarray) -> None:
    """A preference run's stored reference (shardlm.objectives.preference.pairs) beside its example cache, with its size
    and checksum in `NAME.check.json` (read by `reference_problem`); each written under a temporary name."""
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npy")
    np.save(tmp, values)
    check = {"scheme": integrity.SCHEME, "bytes": tmp.stat().st_size, "crc32": integrity.checksum(tmp)}
    tmp.rename(path)
    side = _check_file(path)
    tmp_side = side.with_name(f"{side.name}.tmp{os.getpid()}")
    tmp_side.write_text(json.dumps(check))
    tmp_side.rename(side)


def reference_problem(path: Path) -> str | None:
    """What is wrong with a stored reference, in words, or None: its size and checksum against its record (one
    written before records, or whose record is unreadable, has none) and whether it reads as (pairs, 2) values."""
    try:
        check = json.loads(_check_file(path).read_text())
        files = {path.name: {"bytes": int(check["bytes"]), "crc32": int(check["crc32"])}}
        why = integrity.problem(path.parent, {"scheme": check["scheme"], "files": files}, {})
    except (OSError, ValueError, KeyError, TypeError):
        why = None
    if why is not None:
        return why
    try:
        values = np.load(path)
    except (ValueError, OSError, EOFError):
        return f"{path} is not a whole .npy file"
    return None if values.ndim == 2 and values.shape[1] == 2 else f"{path} does not hold (pairs, 2) values"


def examples_in_memory(source: Source, tok, cfg: DataConfig) -> ExampleSet:
    """The example set built in a temporary folder and read into memory: a dry run writes nothing that stays."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shardlm-dry-") as tmp:
        loaded = load_examples(build_examples(source, tok, cfg, Path(tmp), log=lambda _: None))
        return ExampleSet(np.array(loaded.tokens), np.array(loaded.labels), loaded.offsets, loaded.records,
                          loaded.meta)


def where_of(source: Source, record: int) -> str:
    """`file:line` of record number `record` of a source (read again: only an error needs it)."""
    for n, (where, _) in enumerate(iter_records(source)):
        if n == record:
            return where
    return source.spec

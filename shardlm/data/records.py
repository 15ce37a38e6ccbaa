"""Sources -> a stream of `(where, record)`: whole rows as dicts, for examples (prompt/completion, chat).

Text corpora only need one field of a record (`sources.iter_documents`); an example needs all of it,
nested lists of messages included. `where` is `file:line` for JSON Lines and CSV, `file:row N` for Parquet,
Arrow and Hugging Face datasets, so an error names the place to fix. Memory stays flat: Parquet is read a row
group at a time, Arrow memory-mapped, JSONL and CSV a line at a time.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

from shardlm import ShardlmError
from shardlm.data import readers, tables
from shardlm.data.readers import ReplaceCounter, inner_suffix
from shardlm.data.sources import JSON_TYPES, Source, _json_error, _load_hf, _warn_replaced

Record = tuple[str, dict]


def _jsonl(path: Path) -> Iterator[Record]:
    counter = ReplaceCounter()
    for lineno, line in enumerate(readers.iter_lines(path, counter), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            raise _json_error(path, lineno, line, e, "messages") from None
        if not isinstance(record, dict):
            raise ShardlmError(f"{path}:{lineno}: {JSON_TYPES.get(type(record), type(record).__name__)}, not a JSON "
                               'object: each line must be one example such as {"prompt": "...", "completion": "..."}'
                               ' or {"messages": [...]}.')
        yield f"{path}:{lineno}", record
    _warn_replaced(path, counter.bad)  # read whole: one warning per file, as for text


def _csv(path: Path) -> Iterator[Record]:
    csv.field_size_limit(1 << 30)
    counter = ReplaceCounter()
    reader = csv.DictReader(readers.iter_lines(path, counter))
    try:
        for row in reader:
            yield f"{path}:{reader.line_num}", dict(row)
    except csv.Error as e:
        raise ShardlmError(f"{path}:{reader.line_num}: malformed CSV ({e}). Fix that line, or convert the "
                           "file to .jsonl.") from None
    _warn_replaced(path, counter.bad)


def _parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=tables.ROWS)
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                row += 1
                yield f"{path}:row {row}", record
    except ShardlmError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise ShardlmError(f"data file '{path}' is not a readable Parquet file ({str(e).splitlines()[0]}). "
                           "Re-download or re-write it.") from None


def _arrow(path: Path) -> Iterator[Record]:
    import pyarrow as pa

    row = 0
    try:
        with pa.memory_map(str(path)) as source:
            for batch in pa.ipc.open_stream(source):
                for record in batch.to_pylist():
                    row += 1
                    yield f"{path}:row {row}", record
    except pa.ArrowInvalid as e:
        raise tables.not_a_dataset(path.parent, f"{path.name} is not an Arrow stream: {str(e).splitlines()[0]}") \
            from None


def _hf(source: Source) -> Iterator[Record]:
    repo, config, split = source.hf  # type: ignore[misc]
    try:
        for row, record in enumerate(_load_hf(source, split), 1):
            yield f"{source.spec}:row {row}", dict(record)
    except ShardlmError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
        raise ShardlmError(f"cannot load Hugging Face dataset '{repo}' ({config or 'default'}, split {split}): "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. Check data.data_files, or "
                           "point data.train/data.val at local files.") from None


def is_text_file(path: Path) -> bool:
    """A plain text file: one document, never examples."""
    return inner_suffix(path) not in (".jsonl", ".json", ".csv", ".parquet") and path.suffix.lower() != ".arrow"


def iter_records(source: Source) -> Iterator[Record]:
    """Every record of `source` in order; plain text files hold none (they are documents)."""
    if source.hf:
        yield from _hf(source)
        return
    for path in source.files:
        suffix = inner_suffix(path)
        if path.suffix.lower() == ".arrow":
            yield from _arrow(path)
        elif suffix == ".parquet":
            yield from _parquet(path)
        elif suffix == ".csv":
            yield from _csv(path)
        elif suffix in (".jsonl", ".json"):
            yield from _jsonl(path)


def first_record(source: Source) -> Record | None:
    """The first record, or None for text files (and a source with none)."""
    if not source.hf and all(is_text_file(p) for p in source.files):
        return None
    return next(iter_records(source), None)

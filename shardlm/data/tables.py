"""Columnar sources: Parquet files and folders written by `datasets.Dataset.save_to_disk` (Arrow).

Both are read with pyarrow a record batch at a time, only the text column: a Parquet file row group by
row group, an Arrow dataset memory-mapped, so memory does not grow with the file (a 50 GB Parquet corpus
reads like a 50 MB one). A save_to_disk folder is recognised by its `state.json`, which lists its
`.arrow` files in order; a `DatasetDict` folder (`dataset_dict.json`) gives the split asked for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from shardlm import ShardlmError

ROWS = 1024  # rows per record batch read from Parquet


def _text_values(column, path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa

    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or is_view(column.type)):
        raise ShardlmError(f"{path}: column '{field}' holds {column.type}, not text. Set data.text_field to the "
                           "column that holds the text.")
    for text in column.to_pylist():
        if text:
            yield text


def _missing_column(path: Path, field: str, names: list[str], what: str) -> ShardlmError:
    found = ", ".join(names[:20]) or "none"
    return ShardlmError(f"{path}: {what} has no '{field}' column (columns: {found}). Set data.text_field to the "
                        "column that holds the text.")


def iter_parquet(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise ShardlmError(f"data file '{path}' is not a readable Parquet file ({str(e).splitlines()[0]}). "
                           "Re-download or re-write it.") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise _missing_column(path, field, names, "Parquet file")
    batches = pf.iter_batches(batch_size=ROWS, columns=[field])
    rows = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - a damaged page or row group: pyarrow's OSError, ArrowInvalid, ...
            raise ShardlmError(f"data file '{path}' is corrupt Parquet after row {rows:,} "
                               f"({str(e).splitlines()[0]}). Re-download or re-write it.") from None
        rows += batch.num_rows
        for text in _text_values(batch.column(0), path, field):
            yield text, True


def is_dataset_folder(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def dataset_files(folder: Path, split: str) -> list[Path]:
    """The `.arrow` files of a save_to_disk folder, in order (of split `split` for a DatasetDict)."""
    if (folder / "dataset_dict.json").is_file():
        splits = _read_json(folder / "dataset_dict.json").get("splits", [])
        if split not in splits and len(splits) != 1:
            example = folder / (splits or ["train"])[0]
            raise ShardlmError(f"dataset folder '{folder}' has splits {', '.join(splits) or 'none'}, not '{split}'. "
                               f"Point data.train/data.val at one split's folder, e.g. '{example}'.")
        folder = folder / (split if split in splits else splits[0])
    state = folder / "state.json"
    if not state.is_file():
        raise not_a_dataset(folder, "no state.json")
    try:
        names = [entry["filename"] for entry in _read_json(state)["_data_files"]]
    except (KeyError, TypeError):
        raise not_a_dataset(folder, "its state.json lists no _data_files") from None
    files = [folder / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise not_a_dataset(folder, f"{missing[0]}, listed in its state.json, is missing")
    return files


def not_a_dataset(folder: Path, why: str) -> ShardlmError:
    return ShardlmError(f"folder '{folder}' holds Arrow data but is not a dataset saved by "
                        f"datasets' save_to_disk ({why}). Give the folder save_to_disk wrote, or load the data and "
                        "save it again with Dataset.save_to_disk.")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise not_a_dataset(path.parent, f"{path.name} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise not_a_dataset(path.parent, f"{path.name} is not a JSON object")
    return data


def iter_arrow(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    """One `.arrow` file of a save_to_disk folder (the Arrow IPC stream format), memory-mapped."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            if field not in reader.schema.names:
                raise _missing_column(path, field, reader.schema.names, "Arrow dataset")
            for batch in reader:
                yield from ((text, True) for text in _text_values(batch.column(field), path, field))
    except pa.ArrowInvalid as e:
        raise not_a_dataset(path.parent, f"{path.name} is not an Arrow stream: {str(e).splitlines()[0]}") from None

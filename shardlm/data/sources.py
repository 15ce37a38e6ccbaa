"""Corpus sources -> a stream of `(text, ends_document)` fragments, never the whole corpus in memory.

Accepted: `.txt` (one document), `.csv` with a text column, `.jsonl` with a text field, each also
compressed (`.gz`, `.zst`); `.parquet`; a folder written by `datasets.Dataset.save_to_disk` (Arrow); a
folder of any of those (recursively, in sorted order); `shakespeare` (bundled) or `hf:REPO[/CONFIG][:SPLIT]`
(also `hf:json`, `hf:parquet`, ... with `data.data_files`). Fragments of one document may be cut anywhere
(a `.txt` is read in 1 MiB blocks); the cache cuts them again where the tokens do not change.
Undecodable bytes in text files are replaced (U+FFFD) with one warning per file that counts them (a token
cache keeps it, to say it again when reused); files with NUL bytes are refused as binary.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlm import ShardlmError
from shardlm.data import readers, tables
from shardlm.data.formats import near_miss
from shardlm.data.readers import ReplaceCounter, inner_suffix
from shardlm.hub import hub_reachable, nearest_path

ASSETS = Path(__file__).parent.parent / "assets"
# the chat demo's generated instruction set (assets/chat_tasks/README.md): training, validation, held-out prompts
BUNDLED = {"shakespeare": ASSETS / "tinyshakespeare" / "input.txt", "chat_tasks": ASSETS / "chat_tasks" / "train.jsonl",
           "chat_tasks_val": ASSETS / "chat_tasks" / "val.jsonl",
           "chat_tasks_heldout": ASSETS / "chat_tasks" / "heldout.jsonl",
           "chat_pairs": ASSETS / "chat_tasks" / "pairs_train.jsonl",
           "chat_pairs_val": ASSETS / "chat_tasks" / "pairs_val.jsonl"}
TEXT_SUFFIXES = (".txt", ".csv", ".jsonl", ".json")
SUFFIXES = (*TEXT_SUFFIXES, ".parquet")
NAMES = ".txt/.csv/.jsonl (also .gz/.zst), .parquet"
PACKAGED = ("json", "parquet", "csv", "text", "arrow")  # HF builders that read data.data_files, no Hub needed


@dataclass(frozen=True)
class Source:
    spec: str
    files: tuple[Path, ...] = ()
    hf: tuple[str, str | None, str] | None = None  # (repo, config, split)
    data_files: Any = None  # for hf:json / hf:parquet / ...: a path, glob, list or {split: files}

    def identity(self) -> list:
        """What the token cache key depends on: paths, sizes and modification times, or the HF spec (with
        the local data files' own identity for hf:json and the like)."""
        if self.hf:
            return [*self.hf, json.dumps(self.data_files, sort_keys=True, default=str), *map(_stat, _local(self))]
        return [_stat(p) for p in self.files]


def _stat(p: Path) -> list:
    return [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns]


def _local(source: Source) -> list[Path]:
    files = source.data_files
    if isinstance(files, dict):
        files = files.get(source.hf[2] if source.hf else "train", [])
    patterns = [files] if isinstance(files, str) else list(files or [])
    return sorted(Path(f) for p in patterns for f in glob.glob(str(Path(str(p)).expanduser())))


def parse_hf(spec: str, default_split: str) -> tuple[str, str | None, str]:
    """`hf:wikitext/wikitext-2-raw-v1:train` -> ("wikitext", "wikitext-2-raw-v1", "train").

    Two path parts are read as NAME/CONFIG when the config starts with the name (`wikitext/wikitext-2-…`),
    otherwise as a repo id OWNER/NAME (`Skylion007/openwebtext`); three parts are OWNER/NAME/CONFIG.
    """
    body, _, split = spec[3:].partition(":")
    parts = [p for p in body.split("/") if p]
    if not parts or len(parts) > 3:
        raise ShardlmError(f"'{spec}' is not a Hugging Face dataset spec. Example: hf:wikitext/wikitext-2-raw-v1")
    if len(parts) == 3:
        repo, config = "/".join(parts[:2]), parts[2]
    elif len(parts) == 2 and parts[1].startswith(parts[0]):
        repo, config = parts[0], parts[1]
    else:
        repo, config = "/".join(parts), None
    return repo, config, split or default_split


def resolve(spec: str, default_split: str = "train", data_files: Any = None) -> Source:
    if spec.startswith("hf:"):
        repo, config, split = parse_hf(spec, default_split)
        if repo in PACKAGED and not data_files:
            raise ShardlmError(f"'{spec}' reads local files with the Hugging Face '{repo}' loader: set data.data_files "
                               f"(a path, glob, list or {{split: files}}), or give the files to data.train directly.")
        return Source(spec, hf=(repo, config, split), data_files=data_files if repo in PACKAGED else None)
    path = BUNDLED.get(spec, Path(spec).expanduser())
    if not path.exists():
        raise ShardlmError(f"data path '{spec}' does not exist.{nearest_path(spec, folder=False)} Give a {NAMES} "
                           "file, a folder of them, a "
                           "save_to_disk folder, 'shakespeare' (bundled) or hf:NAME for a Hugging Face dataset.")
    if path.is_dir():
        files = tuple(_folder_files(path, default_split))
        if not files:
            raise ShardlmError(f"folder '{spec}' holds no {NAMES} files. Put text files in it "
                               "or point data.train/data.val at a file.")
    elif _readable(path) or path.suffix == "" or (readers.compression(path) and inner_suffix(path) == ""):
        files = (path,)
    else:
        raise ShardlmError(f"'{spec}' has suffix '{path.suffix}'; shardlm reads {NAMES} files, save_to_disk "
                           "folders (or a folder of those).")
    for f in files:
        _check_readable(f)
    return Source(spec, files=files)


def _readable(path: Path) -> bool:
    suffix = inner_suffix(path)
    return suffix in TEXT_SUFFIXES or (suffix == ".parquet" and readers.compression(path) is None)


def _folder_files(folder: Path, split: str) -> list[Path]:
    """Readable files under `folder` in sorted order; a save_to_disk folder inside gives its .arrow files."""
    if tables.is_dataset_folder(folder):
        return tables.dataset_files(folder, split)
    entries = sorted(folder.rglob("*"))
    datasets = [p for p in entries if p.is_dir() and tables.is_dataset_folder(p)]
    files: list[Path] = []
    for p in entries:
        inside = next((d for d in datasets if d in p.parents or d == p), None)
        if inside is not None:
            files += tables.dataset_files(p, split) if inside == p else []
        elif p.is_file() and _readable(p):
            files.append(p)
        elif p.is_file() and p.suffix.lower() == ".arrow":
            raise tables.not_a_dataset(p.parent, "no state.json beside its .arrow files")
    return files


def _check_readable(path: Path) -> None:
    if path.stat().st_size == 0:
        raise ShardlmError(f"data file '{path}' is empty. Give a file with text, or remove it from the folder.")
    if path.suffix.lower() in (".parquet", ".arrow"):
        return
    head = readers.head_bytes(path)
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise ShardlmError(f"data file '{path}' is UTF-16 text; save it as UTF-8.")
    if b"\0" in head:
        raise ShardlmError(f"data file '{path}' looks binary (it contains NUL bytes); give UTF-8 text "
                           "(.txt, .csv or .jsonl, optionally .gz/.zst), not a binary or UTF-16 file.")


_COLLECTING: list[list[str]] = []  # the lists of `collected_warnings` blocks open now, innermost last


@contextlib.contextmanager
def collected_warnings() -> Iterator[list[str]]:
    """The warnings the reads inside the block print (each also printed as ever): a cache keeps them in its meta.json
    to say them again whenever it is reused (shardlm.data.cache), since its source is not read again then."""
    warnings: list[str] = []
    _COLLECTING.append(warnings)
    try:
        yield warnings
    finally:
        _COLLECTING.remove(warnings)


def _warn_replaced(path: Path, count: int) -> None:
    if count:
        warning = f"warning: {path}: {count} bytes are not valid UTF-8 and were replaced by U+FFFD"
        print(warning, file=sys.stderr)
        for warnings in _COLLECTING:
            warnings.append(warning)


def _iter_txt(path: Path) -> Iterator[tuple[str, bool]]:
    counter = ReplaceCounter()
    for text in readers.iter_text(path, counter):
        yield text, False
    yield "", True
    _warn_replaced(path, counter.bad)


def _iter_csv(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    csv.field_size_limit(1 << 30)
    counter = ReplaceCounter()
    reader = csv.DictReader(readers.iter_lines(path, counter))
    if reader.fieldnames is None or field not in reader.fieldnames:
        found = ", ".join(reader.fieldnames or []) or "none"
        raise ShardlmError(f"{path}: CSV has no '{field}' column (columns found: {found}). "
                           f"Rename the column or set data.text_field.")
    try:
        for row in reader:
            if row.get(field):
                yield row[field], True
    except csv.Error as e:
        raise ShardlmError(f"{path}:{reader.line_num}: malformed CSV ({e}). Fix that line, or convert the "
                           "file to .jsonl.") from None
    _warn_replaced(path, counter.bad)


JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "true/false", type(None): "null"}


def _json_error(path: Path, lineno: int, line: str, e: json.JSONDecodeError, field: str) -> ShardlmError:
    why = ""
    if e.msg.startswith("Invalid control character"):
        why = ": a raw tab or other control character inside a string must be escaped, e.g. as \\t"
    elif e.msg.startswith("Unterminated string"):
        why = ": a record must fit on one line; a raw newline inside a string must be escaped as \\n"
    elif lineno == 1 and (line.strip() in ("[", "{") or line.lstrip().startswith("[")):
        why = ": is this one JSON document? shardlm reads JSON Lines, one object per line"
    return ShardlmError(f"{path}:{lineno}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}{why}). "
                        f'Fix or remove the line: each line must be one JSON object such as {{"{field}": "..."}}.')


def _record_text(path: Path, lineno: int, record: object, field: str) -> str:
    where = f"{path}:{lineno}:"
    if not isinstance(record, dict):
        raise ShardlmError(f"{where} {JSON_TYPES.get(type(record), type(record).__name__)}, not a JSON object: "
                           f'each line must be one object such as {{"{field}": "..."}}.')
    if field not in record:
        found = ", ".join(list(map(str, record))[:10]) or "none"
        hint = near_miss(record)
        raise ShardlmError(f"{where} no '{field}' field in this record (fields found: {found})." + (
            f"{hint} Fix the field's name." if hint else " Set data.text_field to the field that holds the text."))
    text = record[field]
    if not isinstance(text, str):
        raise ShardlmError(f"{where} field '{field}' is {JSON_TYPES.get(type(text), type(text).__name__)}, "
                           "not a string. Give text there, or set data.text_field to the field that holds it.")
    return text


def _iter_jsonl(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    counter = ReplaceCounter()
    for lineno, line in enumerate(readers.iter_lines(path, counter), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.rstrip("\r\n"))  # a newline inside a string then reads as unterminated
        except json.JSONDecodeError as e:
            raise _json_error(path, lineno, line, e, field) from None
        text = _record_text(path, lineno, record, field)
        if text:
            yield text, True
    _warn_replaced(path, counter.bad)


def _load_hf(source: Source, split: str):
    """A streamed dataset; offline, the copy in the local Hugging Face datasets cache (memory-mapped)."""
    import datasets

    repo, config, _ = source.hf  # type: ignore[misc]
    if repo in PACKAGED:  # local files: no Hub involved
        return datasets.load_dataset(repo, config, data_files=source.data_files, split=split, streaming=True)
    if hub_reachable():
        return datasets.load_dataset(repo, config, split=split, streaming=True)
    from huggingface_hub import constants

    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(repo, config, split=split)
    except Exception:  # noqa: BLE001 - whatever datasets raises offline, the cause is the same
        raise ShardlmError(
            f"cannot load Hugging Face dataset '{repo}': the Hugging Face Hub cannot be reached and it is not in "
            "the local HF datasets cache. Download it elsewhere and point data.train/data.val at local files "
            "(.txt/.jsonl/.parquet or a save_to_disk folder).") from None


def _iter_hf(source: Source, field: str, rows_are_documents: bool) -> Iterator[tuple[str, bool]]:
    repo, config, split = source.hf  # type: ignore[misc]
    try:
        for row in _load_hf(source, split):
            if field not in row:
                raise ShardlmError(f"Hugging Face dataset '{repo}' has no '{field}' column (columns: "
                                   f"{', '.join(row)}); set data.text_field.")
            text = row[field] or ""  # a null cell is an empty document
            if not rows_are_documents and text and not text.endswith("\n"):
                text += "\n"  # rows are lines (hf:text strips them): keep the break, as WikiText's rows do
            yield text, rows_are_documents
    except ShardlmError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
        fix = ("Check data.data_files: a path, glob or list (one split, 'train'), or {train: ..., validation: ...} "
               "for several splits" if repo in PACKAGED else
               "Without network access, download it elsewhere and point data.train/data.val at local files")
        raise ShardlmError(
            f"cannot load Hugging Face dataset '{repo}' ({config or 'default'}, split {split}): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. {fix}."
        ) from None
    if not rows_are_documents:
        yield "", True


def iter_documents(source: Source, field: str = "text", rows_are_documents: bool = True):
    if source.hf:
        yield from _iter_hf(source, field, rows_are_documents)
        return
    for path in source.files:
        suffix = inner_suffix(path)
        if path.suffix.lower() == ".arrow":
            yield from tables.iter_arrow(path, field)
        elif suffix == ".parquet":
            yield from tables.iter_parquet(path, field)
        elif suffix == ".csv":
            yield from _iter_csv(path, field)
        elif suffix in (".jsonl", ".json"):
            yield from _iter_jsonl(path, field)
        else:
            yield from _iter_txt(path)

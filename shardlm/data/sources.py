"""Corpus sources -> a stream of `(text, ends_document)` pieces, never the whole corpus in memory.

Accepted: a `.txt` file (one document), a `.csv` with a text column, a `.jsonl` with a text field, a folder
of those (recursively, in sorted order), `shakespeare` (bundled) or `hf:REPO[/CONFIG][:SPLIT]`.
Undecodable bytes in text files are replaced (U+FFFD) with one warning per file that counts them; files
with NUL bytes are refused as binary.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardlm import ShardlmError
from shardlm.hub import hub_reachable

BUNDLED = {"shakespeare": Path(__file__).parent.parent / "assets" / "tinyshakespeare" / "input.txt"}
SUFFIXES = (".txt", ".csv", ".jsonl", ".json")
PIECE_BYTES = 1 << 20  # stream text files in ~1 MiB pieces cut at line ends


@dataclass(frozen=True)
class Source:
    spec: str
    files: tuple[Path, ...] = ()
    hf: tuple[str, str | None, str] | None = None  # (repo, config, split)

    def identity(self) -> list:
        """What the token cache key depends on: paths, sizes and modification times, or the HF spec."""
        if self.hf:
            return list(self.hf)
        return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in self.files]


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


def resolve(spec: str, default_split: str = "train") -> Source:
    if spec.startswith("hf:"):
        return Source(spec, hf=parse_hf(spec, default_split))
    path = BUNDLED.get(spec, Path(spec).expanduser())
    if not path.exists():
        raise ShardlmError(f"data path '{spec}' does not exist. Give a .txt/.csv/.jsonl file, a folder of them, "
                           "'shakespeare' (bundled) or hf:NAME for a Hugging Face dataset.")
    if path.is_dir():
        files = tuple(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES))
        if not files:
            raise ShardlmError(f"folder '{spec}' holds no {'/'.join(SUFFIXES)} files. Put text files in it "
                               "or point data.train/data.val at a file.")
    elif path.suffix.lower() in SUFFIXES or path.suffix == "":
        files = (path,)
    else:
        raise ShardlmError(f"'{spec}' has suffix '{path.suffix}'; shardlm reads {', '.join(SUFFIXES)} files "
                           "(or a folder of them).")
    for f in files:
        _check_readable(f)
    return Source(spec, files=files)


def _check_readable(path: Path) -> None:
    if path.stat().st_size == 0:
        raise ShardlmError(f"data file '{path}' is empty. Give a file with text, or remove it from the folder.")
    with open(path, "rb") as fh:
        head = fh.read(8192)
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise ShardlmError(f"data file '{path}' is UTF-16 text; save it as UTF-8.")
    if b"\0" in head:
        raise ShardlmError(f"data file '{path}' looks binary (it contains NUL bytes); give UTF-8 text "
                           "(.txt, .csv or .jsonl), not a compressed, binary or UTF-16 file.")


def _warn_replaced(path: Path, count: int) -> None:
    if count:
        print(f"warning: {path}: {count} bytes are not valid UTF-8 and were replaced by U+FFFD",
              file=sys.stderr)


def _iter_txt(path: Path) -> Iterator[tuple[str, bool]]:
    bad, piece, size = 0, [], 0
    with open(path, "rb") as fh:
        for line in fh:
            text = line.decode("utf-8", errors="replace")
            if "\ufffd" in text:
                bad += len(line) - len(line.decode("utf-8", errors="ignore").encode())
            piece.append(text)
            size += len(line)
            if size >= PIECE_BYTES:
                yield "".join(piece), False
                piece, size = [], 0
    yield "".join(piece), True
    _warn_replaced(path, bad)


def _iter_csv(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    csv.field_size_limit(1 << 30)
    with open(path, newline="", encoding="utf-8", errors="replace") as fh:
        reader = csv.DictReader(fh)
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
        raise ShardlmError(f"{where} no '{field}' field in this record (fields found: {found}). "
                           "Set data.text_field to the field that holds the text.")
    text = record[field]
    if not isinstance(text, str):
        raise ShardlmError(f"{where} field '{field}' is {JSON_TYPES.get(type(text), type(text).__name__)}, "
                           "not a string. Give text there, or set data.text_field to the field that holds it.")
    return text


def _iter_jsonl(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # a newline inside a string then reads as unterminated
            except json.JSONDecodeError as e:
                raise _json_error(path, lineno, line, e, field) from None
            text = _record_text(path, lineno, record, field)
            if text:
                yield text, True


def _iter_hf(repo: str, config: str | None, split: str, field: str, rows_are_documents: bool):
    if not hub_reachable():
        raise ShardlmError(
            f"cannot load Hugging Face dataset '{repo}': the Hugging Face Hub cannot be reached (streaming needs "
            "it). Download it elsewhere and point data.train/data.val at local .txt/.jsonl files.")
    try:
        import datasets

        stream = datasets.load_dataset(repo, config, split=split, streaming=True)
        for row in stream:
            yield row[field], rows_are_documents
    except ShardlmError:
        raise
    except KeyError:
        raise ShardlmError(f"Hugging Face dataset '{repo}' has no '{field}' column; set data.text_field.") from None
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
        raise ShardlmError(
            f"cannot load Hugging Face dataset '{repo}' ({config or 'default'}, split {split}): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. Without network access, download it "
            "elsewhere and point data.train/data.val at local .txt/.jsonl files."
        ) from None
    if not rows_are_documents:
        yield "", True


def iter_documents(source: Source, field: str = "text", rows_are_documents: bool = True):
    if source.hf:
        yield from _iter_hf(*source.hf, field, rows_are_documents)
        return
    for path in source.files:
        suffix = path.suffix.lower()
        if suffix == ".csv":
            yield from _iter_csv(path, field)
        elif suffix in (".jsonl", ".json"):
            yield from _iter_jsonl(path, field)
        else:
            yield from _iter_txt(path)

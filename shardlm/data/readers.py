"""Bytes and text of one data file, streamed: plain, gzip (.gz) or Zstandard (.zst) files.

Nothing here holds more than a block of the file: compressed files are decompressed block by block
(never a whole member, so a tiny file that expands to gigabytes stays flat), text is decoded
incrementally (a multi-byte character split between blocks survives), and a truncated or corrupt stream
fails with the file and the byte where it broke instead of ending early without a word: `zstandard`'s
stream reader returns a truncated frame's bytes as if it were complete, so the frames are checked here.
"""

from __future__ import annotations

import codecs
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from shardlm import ShardlmError

if TYPE_CHECKING:
    from zlib import _Decompress  # typeshed's name for zlib's decompress object

    from zstandard import ZstdDecompressionObj

BLOCK = 1 << 20  # decompressed bytes per block
RAW_BLOCK = 64 << 10  # compressed bytes read at a time
COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}
FIX = {"gzip": "gzip -t", "zstd": "zstd -t"}
_GZIP_MEMBER = type(zlib.decompressobj())  # zlib's decompress object (no public name)


def compression(path: Path) -> str | None:
    return COMPRESSED.get(path.suffix.lower())


def inner_suffix(path: Path) -> str:
    """`a.jsonl.gz` -> `.jsonl`; `a.csv` -> `.csv`."""
    return Path(path.stem).suffix.lower() if compression(path) else path.suffix.lower()


def _corrupt(path: Path, kind: str, at: int, size: int, why: str) -> ShardlmError:
    return ShardlmError(f"data file '{path}' is corrupt {kind} data near byte {at:,} of {size:,} ({why}). "
                        f"Re-download or re-compress it (`{FIX[kind]} {path.name}` checks a file).")


def _truncated(path: Path, kind: str, size: int, text_bytes: int) -> ShardlmError:
    return ShardlmError(f"data file '{path}' is truncated: its {kind} stream stops inside a compressed frame at "
                        f"byte {size:,} (the end of the file), after {text_bytes:,} bytes of text. Re-download or "
                        f"re-compress it (`{FIX[kind]} {path.name}` checks a file).")


class _Decompressor:
    """One compressed member/frame after another, as zlib's and zstandard's decompress objects both work."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "zstd":
            import zstandard

            self.error: tuple[type[BaseException], ...] = (zstandard.ZstdError,)
            self.new: Callable[[], _Decompress | ZstdDecompressionObj] = zstandard.ZstdDecompressor().decompressobj
        else:
            self.error = (zlib.error,)
            self.new = lambda: zlib.decompressobj(wbits=31)
        self.obj, self.started = self.new(), False

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        while chunk:
            self.started = True
            if isinstance(self.obj, _GZIP_MEMBER):  # i.e. self.kind == "gzip"
                out = self.obj.decompress(chunk, BLOCK)
                rest = self.obj.unconsumed_tail
            else:
                out, rest = self.obj.decompress(chunk), b""
            if out:
                yield out
            if self.obj.eof:
                rest = self.obj.unused_data + rest
                self.obj, self.started = self.new(), False
            chunk = rest


def iter_bytes(path: Path, block: int | None = None) -> Iterator[bytes]:
    """The file's (decompressed) bytes in blocks of `block` (default BLOCK) bytes."""
    block = block or BLOCK
    kind = compression(path)
    size = path.stat().st_size
    with open(path, "rb") as raw:
        if kind is None:
            while chunk := raw.read(block):
                yield chunk
            return
        head = raw.read(4)
        if not head.startswith(MAGIC[kind]):
            raise ShardlmError(f"data file '{path}' is not {kind} data (it does not start with the {kind} magic "
                               f"bytes). Rename it without '{path.suffix}' if it is not compressed, or re-compress it.")
        raw.seek(0)
        dec, done = _Decompressor(kind), 0
        try:
            while chunk := raw.read(RAW_BLOCK):
                for out in dec.feed(chunk):
                    done += len(out)
                    yield out
        except dec.error as e:
            raise _corrupt(path, kind, raw.tell(), size, str(e).split(": ")[-1] or type(e).__name__) from None
        if dec.started:
            raise _truncated(path, kind, size, done)


class ReplaceCounter:
    """Decode errors -> U+FFFD, counting the bytes replaced (one warning per file says how many). One
    error handler is registered for the process; it adds to the counter of the file being decoded."""

    name = "shardlm-replace"
    current: ReplaceCounter | None = None

    def __init__(self):
        self.bad = 0

    @staticmethod
    def _handle(e: UnicodeError) -> tuple[str, int]:
        if ReplaceCounter.current is not None and isinstance(e, UnicodeDecodeError):
            ReplaceCounter.current.bad += e.end - e.start
        return "\ufffd", e.end  # type: ignore[attr-defined]


codecs.register_error(ReplaceCounter.name, ReplaceCounter._handle)


def iter_text(path: Path, counter: ReplaceCounter, block: int | None = None) -> Iterator[str]:
    """The file as UTF-8 text in blocks cut anywhere (never inside a character)."""
    decoder = codecs.getincrementaldecoder("utf-8")(ReplaceCounter.name)
    for chunk in iter_bytes(path, block):
        ReplaceCounter.current = counter
        if text := decoder.decode(chunk):
            yield text
    ReplaceCounter.current = counter
    if text := decoder.decode(b"", final=True):
        yield text


def iter_lines(path: Path, counter: ReplaceCounter) -> Iterator[str]:
    """Lines ending in `\\n` (kept; `\\r\\n` stays whole), as `open(newline="")` gives them. A line longer
    than a block is gathered in parts, not by repeated concatenation."""
    parts: list[str] = []
    for text in iter_text(path, counter):
        lines = text.split("\n")
        if len(lines) == 1:
            parts.append(text)
            continue
        yield "".join([*parts, lines[0]]) + "\n"
        yield from (line + "\n" for line in lines[1:-1])
        parts = [lines[-1]] if lines[-1] else []
    if parts:
        yield "".join(parts)


def head_bytes(path: Path, size: int = 8192) -> bytes:
    """The first `size` (decompressed) bytes: what the binary and UTF-16 checks look at."""
    out = b""
    for chunk in iter_bytes(path, size):
        out += chunk
        if len(out) >= size:
            break
    return out[:size]

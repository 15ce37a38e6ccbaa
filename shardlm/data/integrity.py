"""Cache files checked at open: each file's size and a cheap checksum, recorded at build.

Why: a cache truncated by a full disk or an interrupted copy gave a numpy traceback (`mmap length is greater
than file size`), and one zeroed or overwritten in place trained silently on zeros. Why sampled: every rank
opens its caches at every start, and a full crc32 reads ~1 GiB/s (a 20 GB FineWeb cache: ~20 s per open).
A file up to 16 MiB is summed whole; a larger one by 256 chunks of 64 KiB spread evenly over it, first and last
included (16 MiB read whatever the size: ~23 ms on a 4 GiB file in the page cache, ~70 ms from disk), which catches
a truncated file, one zeroed or rewritten in place, and any damaged stretch longer than the gap between chunks
(size / 255).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

SCHEME = "crc32-sampled-1"
CHUNKS, CHUNK = 256, 64 << 10
WHOLE = CHUNKS * CHUNK  # bytes: a file up to this size is summed whole (no more read than a sampled one)


def checksum(path: Path) -> int:
    """crc32 of the whole file, or of CHUNKS evenly spread chunks of a file larger than WHOLE."""
    size, crc = path.stat().st_size, 0
    with open(path, "rb") as fh:
        if size <= WHOLE:
            while block := fh.read(16 << 20):
                crc = zlib.crc32(block, crc)
            return crc
        for i in range(CHUNKS):
            crc = zlib.crc32(os.pread(fh.fileno(), CHUNK, (size - CHUNK) * i // (CHUNKS - 1)), crc)
    return crc


def record(folder: Path, names: list[str]) -> dict:
    """What `problem` checks later: the scheme, and each named file's size and checksum."""
    return {"scheme": SCHEME, "files": {n: {"bytes": (folder / n).stat().st_size, "crc32": checksum(folder / n)}
                                        for n in names}}


def problem(folder: Path, check: dict | None, sizes: dict[str, int]) -> str | None:
    """The first damaged file of `folder` in words (`FILE is truncated: ...`), or None when all are whole.
    `check` is `record`'s (None for a cache built before it: only `sizes`, the sizes its meta implies, are
    checked); a scheme this version does not know checks sizes only."""
    files = (check or {}).get("files", {})
    expected = {**sizes, **{n: f["bytes"] for n, f in files.items()}}
    for name, size in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if (found := path.stat().st_size) != size:
            return f"{path} is {'truncated' if found < size else 'too long'}: {found:,} bytes, {size:,} written"
    if (check or {}).get("scheme") == SCHEME:
        for name, f in files.items():
            if checksum(folder / name) != f["crc32"]:
                return f"{folder / name} was changed since it was written (its checksum differs: zeroed or " \
                       "overwritten in place)"
    return None

"""Documents -> a memory-mapped token file, built once per (source, tokenizer) and reused.

Layout: `CACHE/<key>/tokens.bin` (uint16 when the vocabulary fits, else uint32) and `meta.json`.
The folder is written under a temporary name and renamed, so a killed build never leaves a cache that
looks complete. Memory stays flat: documents are tokenized in batches and appended to the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from shardlm import ShardlmError, __version__
from shardlm.data.sources import Source, iter_documents
from shardlm.tokenizer import fingerprint

CACHE_FORMAT = 1
BATCH_CHARS = 4 << 20


def cache_root(configured: str | None) -> Path:
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("SHARDLM_CACHE", Path.home() / ".cache" / "shardlm"))


def cache_key(source: Source, tokenizer, text_field: str, rows_are_documents: bool) -> str:
    ident = [CACHE_FORMAT, source.identity(), fingerprint(tokenizer), text_field, rows_are_documents]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def load_tokens(folder: Path) -> np.memmap:
    meta = json.loads((folder / "meta.json").read_text())
    return np.memmap(folder / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["num_tokens"],))


def build_cache(source: Source, tokenizer, root: Path, text_field: str = "text",
                rows_are_documents: bool = True, log=print) -> Path:
    """Return the cache folder for `source`, tokenizing it first if no complete cache exists."""
    folder = root / cache_key(source, tokenizer, text_field, rows_are_documents)
    if (folder / "meta.json").is_file():
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ShardlmError(f"cannot create token cache folder '{root}': {e.strerror}. Set data.cache_dir.") from None
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    eos = tokenizer.eos_token_id
    tmp = Path(f"{folder}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    start, count, docs = time.time(), 0, 0
    log(f"tokenizing {source.spec} -> {folder}")
    try:
        with open(tmp / "tokens.bin", "wb") as out:
            texts, ends, chars = [], [], 0

            def flush() -> int:
                written = 0
                for ids, end in zip(_encode(tokenizer, texts), ends, strict=True):
                    if end:
                        ids = [*ids, eos]
                    arr = np.asarray(ids, dtype=np.int64)
                    if arr.size and arr.max() >= vocab:
                        raise ShardlmError(f"tokenizer produced id {arr.max()} >= its vocabulary size {vocab}.")
                    out.write(arr.astype(dtype).tobytes())
                    written += arr.size
                texts.clear()
                ends.clear()
                return written

            for text, end in iter_documents(source, text_field, rows_are_documents):
                texts.append(text)
                ends.append(end)
                docs += end
                chars += len(text)
                if chars >= BATCH_CHARS:
                    count += flush()
                    chars = 0
            count += flush()
        if count <= docs:  # nothing but EOS tokens
            raise ShardlmError(f"data source '{source.spec}' holds no text: no record has a non-empty "
                               f"'{text_field}'. Give data with text, or set data.text_field to the column or field "
                               "that holds it.")
        meta = {"num_tokens": count, "dtype": np.dtype(dtype).name, "documents": docs, "source": source.spec,
                "tokenizer": getattr(tokenizer, "name_or_path", ""), "vocab_size": vocab,
                "shardlm_version": __version__}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same cache first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"tokenized {docs} documents into {count:,} tokens in {time.time() - start:.1f}s")
    return folder

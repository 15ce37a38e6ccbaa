"""Documents -> a memory-mapped token file, built once per (source, tokenizer) and reused.

Layout: `CACHE/<key>/tokens.bin` (uint16 when the vocabulary fits, else uint32) and `meta.json`.
The folder is written under a temporary name and renamed, so a killed build never leaves a cache that
looks complete; a lock file beside it makes any other process that wants the same cache (another rank,
another job, `shardlm prepare` on a login node) wait for this build instead of repeating it. meta.json
records each file's size and a cheap checksum (`integrity.py`): a cache damaged since (truncated, zeroed)
is built again, or refused in one line where it is opened. It also keeps the warnings its build printed (bytes
that were not UTF-8, replaced): a run that reuses the cache prints them again, once, through its log.
Memory stays flat: documents are cut into token-neutral pieces (`pieces.py`), tokenized in batches by the
Rust tokenizer on every core, and appended to the file in order, so the bytes written do not depend on the
number of cores.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from shardlm import ShardlmError, __version__
from shardlm.data import integrity
from shardlm.data.fastbpe import tiktoken_encoder
from shardlm.data.pieces import PIECE_CHARS, Encode, cut_documents
from shardlm.data.sources import Source, collected_warnings, iter_documents
from shardlm.tokenizer import fingerprint

CACHE_FORMAT = 1
BATCH_CHARS = 4 << 20  # characters per batch handed to the tokenizer: ~16 pieces run in parallel


def cache_root(configured: str | None) -> Path:
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("SHARDLM_CACHE", Path.home() / ".cache" / "shardlm"))


def cache_key(source: Source, tokenizer, text_field: str, rows_are_documents: bool) -> str:
    ident = [CACHE_FORMAT, source.identity(), fingerprint(tokenizer), text_field, rows_are_documents]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]


_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def encoder(tokenizer) -> Encode:
    """`make_encoder(tokenizer)`, made once per tokenizer: checking the tiktoken route takes ~1 s."""
    route = os.environ.get("SHARDLM_TIKTOKEN", "1")
    try:
        made = _ENCODERS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no memo
        return make_encoder(tokenizer)
    if route not in made:
        made[route] = make_encoder(tokenizer)
    return made[route]


def make_encoder(tokenizer) -> Encode:
    """Batch -> ids, without special tokens. The Rust backend's `encode_batch_fast` skips the character
    offsets nobody here reads: the same ids at about twice the speed of `tokenizer(texts)`; tiktoken, where
    it provably gives the same ids (byte-level BPE such as GPT-2's, `fastbpe.py`), is ~6x faster still."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
    fast = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    return tiktoken_encoder(tokenizer, encode) or encode


@contextlib.contextmanager
def all_cores() -> Iterator[None]:
    """The tokenizers library's own thread pool on, for this build only: `shardlm` turns it off elsewhere
    (TOKENIZERS_PARALLELISM=false) because a process that forks after using it gets a warning per child.
    RAYON_NUM_THREADS caps the threads."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


@contextlib.contextmanager
def build_lock(folder: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Exclusive right to build `folder`; whoever waits finds it complete when the lock is theirs. The lock
    file goes when the build ends, so the cache folder holds no litter."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still keeps the cache whole
        yield
        return
    lock = Path(f"{folder}.lock")
    with open(lock, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log(f"waiting for another process that is building {folder}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:  # still holding it: a process that opened it before finds meta.json (or builds) after
            lock.unlink(missing_ok=True)


def read_meta(folder: Path) -> dict:
    """A cache's meta.json, checked whole: the files it records are as they were written (`damage`), else a
    one-line error naming the file and the fix."""
    if (why := damage(folder)) is not None:
        raise ShardlmError(f"{why}. Delete {folder} and rerun: the cache is built again from its source.")
    return json.loads((folder / "meta.json").read_text())


def load_tokens(folder: Path) -> np.memmap:
    meta = read_meta(folder)
    return np.memmap(folder / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["num_tokens"],))


def damage(folder: Path) -> str | None:
    """What is wrong with a cache folder that has a meta.json, in words, or None. A cache built before meta.json
    recorded checksums has the sizes its meta implies checked, and its .npy files read."""
    meta_file = folder / "meta.json"
    try:
        text = meta_file.read_bytes()
    except OSError:
        return f"{meta_file} is missing"
    try:
        meta = json.loads(text)
        n, itemsize = int(meta["num_tokens"]), np.dtype(meta["dtype"]).itemsize
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"{meta_file} is not whole ({len(text):,} bytes that do not read as the cache's record)"
    examples = folder.name.startswith("ex-")
    sizes = {"tokens.bin": n * itemsize, **({"labels.bin": n} if examples else {})}
    why = integrity.problem(folder, meta.get("check"), sizes)
    if why is not None or "check" in meta:  # a cache with a record is checked by it
        return why
    for name in ("offsets.npy", "records.npy") if examples else ():
        try:
            np.load(folder / name, mmap_mode="r")
        except (ValueError, OSError, EOFError):
            return f"{folder / name} is not a whole .npy file"
    return None


def build_once(folder: Path, write: Callable[[Path], dict], log: Callable[[str], None]) -> tuple[Path, dict | None]:
    """`folder`, made by `write(tmp)` (which fills `tmp` and returns its meta) unless complete and intact already:
    under a temporary name renamed when whole, one builder at a time (`build_lock`). A damaged folder is built
    again, with a warning. The meta of a build done here, None when the folder was complete."""
    if (folder / "meta.json").is_file() and damage(folder) is None:
        return folder, None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ShardlmError(f"cannot create token cache folder '{folder.parent}': {e.strerror}. Set data.cache_dir.") \
            from None
    with build_lock(folder, log):
        if (folder / "meta.json").is_file():
            if (why := damage(folder)) is None:
                return folder, None
            log(f"warning: {why}: building the cache again from its source")
        tmp = Path(f"{folder}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        start = time.time()
        try:
            meta = {**write(tmp), "seconds": round(time.time() - start, 3), "shardlm_version": __version__}
            meta["check"] = integrity.record(tmp, sorted(p.name for p in tmp.iterdir()))
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            _commit(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder, meta


def _commit(tmp: Path, folder: Path) -> None:
    """`tmp` becomes `folder`. A damaged folder it replaces is moved aside first, and what it held that a build
    does not write (a preference run's stored reference, shardlm.objectives.preference.pairs) is carried over."""
    aside = Path(f"{folder}.damaged{os.getpid()}")
    if folder.exists():
        folder.rename(aside)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished the same cache first (a file system without locks)
        shutil.rmtree(tmp, ignore_errors=True)
    if aside.exists():
        for extra in aside.iterdir():
            if not (folder / extra.name).exists():
                extra.rename(folder / extra.name)
        shutil.rmtree(aside, ignore_errors=True)


def build_cache(source: Source, tokenizer, root: Path, text_field: str = "text",
                rows_are_documents: bool = True, log=print) -> Path:
    """Return the cache folder for `source`, tokenizing it first if no complete cache exists."""
    folder = root / cache_key(source, tokenizer, text_field, rows_are_documents)

    def write(tmp: Path) -> dict:
        log(f"tokenizing {source.spec} -> {folder}")
        with open(tmp / "tokens.bin", "wb") as out, all_cores(), collected_warnings() as warnings:
            stats = _write_tokens(source, tokenizer, out, text_field, rows_are_documents)
        _check_text(stats["num_tokens"], stats["documents"], source, text_field)
        return {**stats, "source": source.spec, "tokenizer": getattr(tokenizer, "name_or_path", ""),
                "vocab_size": len(tokenizer), **({"warnings": warnings} if warnings else {})}

    folder, meta = build_once(folder, write, log)
    if meta is not None:
        docs, seconds = meta["documents"], meta["seconds"]
        log(f"tokenized {docs:,} document{'s' if docs != 1 else ''} into {meta['num_tokens']:,} tokens in "
            f"{seconds:.1f}s ({meta['text_bytes'] / 1e6 / max(seconds, 1e-9):.1f} MB/s)")
    else:  # reused: what its build warned of (bytes replaced) still holds for the tokens read from it
        for warning in json.loads((folder / "meta.json").read_text()).get("warnings", []):
            log(warning)
    return folder


def _batches(pieces: Iterator[tuple[str, bool]]) -> Iterator[tuple[list[str], list[bool]]]:
    texts: list[str] = []
    ends: list[bool] = []
    chars = 0
    for text, end in pieces:
        texts.append(text)
        ends.append(end)
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield texts, ends
            texts, ends, chars = [], [], 0
    if texts:
        yield texts, ends


def _token_batches(source: Source, tokenizer, text_field: str,
                   rows_are_documents: bool) -> Iterator[tuple[np.ndarray, int, int]]:
    """(ids with an EOS after each document, documents ended, text bytes) per batch of pieces, in order."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    encode = encoder(tokenizer)
    fragments = iter_documents(source, text_field, rows_are_documents)
    for texts, ends in _batches(cut_documents(fragments, encode, PIECE_CHARS, source.spec)):
        flat: list[int] = []
        for ids, end in zip(encode(texts), ends, strict=True):
            flat.extend(ids)
            if end:
                flat.append(eos)
        arr = np.array(flat, dtype=np.int64)
        if arr.size and arr.max() >= vocab:
            raise ShardlmError(f"tokenizer produced id {arr.max()} >= its vocabulary size {vocab}.")
        yield arr, sum(ends), sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def _write_tokens(source: Source, tokenizer, out, text_field: str, rows_are_documents: bool) -> dict:
    """Tokenize every piece in order and append the ids (EOS after each document) to `out`."""
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    count = docs = text_bytes = 0
    for arr, ended, size in _token_batches(source, tokenizer, text_field, rows_are_documents):
        out.write(arr.astype(dtype).tobytes())
        count, docs, text_bytes = count + arr.size, docs + ended, text_bytes + size
    return {"num_tokens": count, "dtype": np.dtype(dtype).name, "documents": docs, "text_bytes": text_bytes}


def _check_text(num_tokens: int, documents: int, source: Source, text_field: str) -> None:
    if num_tokens <= documents:  # nothing but EOS tokens
        raise ShardlmError(f"data source '{source.spec}' holds no text: no record has a non-empty "
                           f"'{text_field}'. Give data with text, or set data.text_field to the column or field "
                           "that holds it.")


def count_tokens(source: Source, tokenizer, root: Path, text_field: str = "text", rows_are_documents: bool = True,
                 enough: int | None = None) -> tuple[int, bool]:
    """(tokens, exact) of what `build_cache` would hold, writing nothing: a dry run's check of the block counts.
    A built cache answers at once; otherwise the source is tokenized in memory, stopping once `enough` tokens
    are counted (exact False: at least that many), so a large corpus costs a dry run seconds, not its build."""
    folder = root / cache_key(source, tokenizer, text_field, rows_are_documents)
    if (folder / "meta.json").is_file() and damage(folder) is None:  # a damaged one: counted here, rebuilt by the run
        return json.loads((folder / "meta.json").read_text())["num_tokens"], True
    count = docs = 0
    with all_cores():
        batches = _token_batches(source, tokenizer, text_field, rows_are_documents)
        batch = next(batches, None)
        while batch is not None:
            count, docs = count + batch[0].size, docs + batch[1]
            batch = next(batches, None)  # read ahead: a source that ends here is counted exactly
            if batch is not None and enough is not None and count >= enough and count > docs:
                return count, False
    _check_text(count, docs, source, text_field)
    return count, True

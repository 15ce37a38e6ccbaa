"""`shardlm prepare`: builds the caches a run uses, reports them, never builds one cache twice, and a corrupt
file fails in one line (exit 2) keeping the caches built before."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from shardlm.cli import cmd_prepare, parse_args
from shardlm.data import cache
from shardlm.data.cache import build_cache, build_lock, cache_key, load_tokens
from shardlm.data.sources import resolve
from shardlm.tokenizer import byte_tokenizer, load_tokenizer


def test_prepare_builds_train_and_val_then_reuses_them(tmp_path, capsys):
    (tmp_path / "train.txt").write_text("hello world " * 200)
    (tmp_path / "val.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    argv = ["prepare", f"data.train={tmp_path / 'train.txt'}", f"data.val={tmp_path / 'val.jsonl'}",
            f"data.cache_dir={tmp_path / 'cache'}", "model.tokenizer=bytes"]
    assert cmd_prepare(parse_args(argv)) == 0
    out = capsys.readouterr().out
    assert "train: " in out and "1 document, 2,401 tokens, 0.0 MB, in " in out and " MB/s)" in out
    assert "val: " in out and "2 documents, 4 tokens" in out
    folders = [line.split("cache: ")[1] for line in out.splitlines() if "cache: " in line]
    assert len(folders) == 2 and all((tmp_path / "cache").glob("*/meta.json"))
    assert cmd_prepare(parse_args(argv)) == 0  # a run (or a second prepare) finds them built
    again = capsys.readouterr().out
    assert again.count("built earlier") == 2 and "tokenizing" not in again


def test_cache_bytes_do_not_depend_on_batching(tmp_path, monkeypatch):
    """Pieces are written in order: how text is batched (and so spread over cores) changes nothing."""
    text = "Some words, and more words.\n\n  Indented line. " * 300
    (tmp_path / "a.txt").write_text(text)
    tok = load_tokenizer("gpt2")
    digests = []
    for batch, piece in ((1 << 20, 1 << 20), (300, 100), (4096, 1000)):
        monkeypatch.setattr(cache, "BATCH_CHARS", batch)
        monkeypatch.setattr(cache, "PIECE_CHARS", piece)
        folder = build_cache(resolve(str(tmp_path / "a.txt")), tok, tmp_path / f"c{batch}", log=lambda *_: None)
        digests.append((folder / "tokens.bin").read_bytes())
    assert digests[0] == digests[1] == digests[2]
    assert list(load_tokens(folder)) == [*tok(text)["input_ids"], tok.eos_token_id]


def test_a_second_builder_waits_for_the_first_instead_of_building_again(tmp_path):
    (tmp_path / "a.txt").write_text("shared corpus")
    tok, root, logs = byte_tokenizer(), tmp_path / "cache", []
    source = resolve(str(tmp_path / "a.txt"))
    folder = root / cache_key(source, tok, "text", True)
    root.mkdir()
    with build_lock(folder, logs.append):  # another rank (or job) is building this cache
        waiter = threading.Thread(target=lambda: build_cache(source, tok, root, log=logs.append))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and any("waiting for another process" in m for m in logs)
        built = build_cache(source, tok, tmp_path / "elsewhere", log=logs.append)  # the holder builds it ...
        shutil.copytree(built, folder)  # ... and it appears whole, as build_once's rename makes it
    waiter.join(10)
    assert sum(m.startswith("tokenizing") for m in logs) == 1 and not list(root.glob("*.lock"))


def test_prepare_of_a_corrupt_file_exits_2_in_one_line_and_keeps_the_cache(tmp_path, capsys):
    """`shardlm prepare`'s own entry point (main(), in-process: the same path as the command line)."""
    import gzip
    import random

    from shardlm.cli import main

    (tmp_path / "good.txt").write_text("good text " * 50)
    args = ["prepare", "model.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(SystemExit) as done:
        main([*args, f"data.train={tmp_path / 'good.txt'}"])
    assert done.value.code == 0
    before = {p: p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    text = "".join(random.Random(0).choices("abc de\n", k=20_000)).encode()
    (tmp_path / "bad.txt.gz").write_bytes(gzip.compress(text)[:2000])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main([*args, f"data.train={tmp_path / 'bad.txt.gz'}"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: data file") and "bad.txt.gz' is truncated" in err
    assert {p: p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file()} == before

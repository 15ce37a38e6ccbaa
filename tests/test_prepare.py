"""`shardlm prepare`: builds the caches a run uses, reports them, and never builds one cache twice."""

from __future__ import annotations

import threading
import time

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
        cache._build(source, tok, folder, "text", True, logs.append)  # the holder builds it
    waiter.join(10)
    assert sum(m.startswith("tokenizing") for m in logs) == 1 and not list(root.glob("*.lock"))

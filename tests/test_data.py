import json

import numpy as np
import pytest
import torch

from shardlm import ShardlmError
from shardlm.data import GlobalSampler, eval_shares, micro_batch_position
from shardlm.data.cache import build_cache, load_tokens
from shardlm.data.sources import parse_hf, resolve
from shardlm.tokenizer import byte_tokenizer, load_tokenizer

EOS = 256


def tokens_of(path, tmp_path, tok=None, **kw):
    tok = tok or byte_tokenizer()
    folder = build_cache(resolve(str(path)), tok, tmp_path / "cache", log=lambda *_: None, **kw)
    return list(load_tokens(folder))


def test_txt_is_one_document(tmp_path):
    (tmp_path / "a.txt").write_text("ab\ncd\n")
    assert tokens_of(tmp_path / "a.txt", tmp_path) == [*b"ab\ncd\n", EOS]


def test_csv_keeps_embedded_newlines(tmp_path):
    (tmp_path / "a.csv").write_text('id,text\n1,"line one\nline two"\n2,second\n')
    assert tokens_of(tmp_path / "a.csv", tmp_path) == [*b"line one\nline two", EOS, *b"second", EOS]


def test_jsonl_documents(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "x\ny"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    assert tokens_of(tmp_path / "a.jsonl", tmp_path) == [*b"x\ny", EOS, *b"z", EOS]


def test_folder_reads_files_in_sorted_order(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("B")
    (tmp_path / "d" / "a.jsonl").write_text('{"text": "A"}\n')
    (tmp_path / "d" / "sub" / "c.csv").write_text("text\nC\n")
    (tmp_path / "d" / "ignored.bin").write_bytes(b"\0\1")
    assert tokens_of(tmp_path / "d", tmp_path) == [ord("A"), EOS, ord("B"), EOS, ord("C"), EOS]


def test_gpt2_tokens_match_tokenizer(tmp_path):
    tok = load_tokenizer("gpt2")
    (tmp_path / "a.txt").write_text("Hello world, this is shardlm.")
    assert tokens_of(tmp_path / "a.txt", tmp_path, tok) == [*tok("Hello world, this is shardlm.")["input_ids"], 50256]


def test_cache_is_reused_and_keyed_by_content(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    logs = []
    tok = byte_tokenizer()
    first = build_cache(resolve(str(tmp_path / "a.txt")), tok, tmp_path / "c", log=logs.append)
    second = build_cache(resolve(str(tmp_path / "a.txt")), tok, tmp_path / "c", log=logs.append)
    assert first == second and sum("tokenizing" in m for m in logs) == 1
    assert load_tokens(first).dtype == np.uint16
    (tmp_path / "a.txt").write_text("hello again")  # a changed file gets a new cache
    third = build_cache(resolve(str(tmp_path / "a.txt")), tok, tmp_path / "c", log=logs.append)
    assert third != first and sum("tokenizing" in m for m in logs) == 2


def test_invalid_utf8_is_replaced_and_counted(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes(b"ok \xff\xfe end")
    toks = tokens_of(tmp_path / "a.txt", tmp_path)
    assert bytes(toks[:3]) == b"ok " and "2 bytes are not valid UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("name, content, message", [
    ("a.txt", b"", "a.txt' is empty. Give a file with text"),
    ("a.txt", b"\x00\x01\x02binary", "looks binary"),
    ("a.txt", "hi".encode("utf-16"), "a.txt' is UTF-16 text; save it as UTF-8"),
    ("a.csv", b"title,body\nx,y\n", "no 'text' column (columns found: title, body)"),
    ("a.csv", b"text\n\n", "a.csv' holds no text: no record has a non-empty 'text'. Give data"),
    ("a.jsonl", b'{"text": "ok"}\n{"text": broken\n', "a.jsonl:2: not valid JSON (Expecting value at column 10). Fix"),
    ("a.jsonl", b'{"text": "a\tb"}\n', "a.jsonl:1: not valid JSON (Invalid control character at column 12: a raw tab"),
    ("a.jsonl", b'{"text": "a\nb"}\n', "(Unterminated string starting at column 10: a record must fit on one line"),
    ("a.json", b'[\n {"text": "a"}\n]\n', "a.json:1: not valid JSON (Expecting value at column 2: is this one JSON"),
    ("a.jsonl", b'"just text"\n', 'a.jsonl:1: a string, not a JSON object: each line must be one object such as'),
    ("a.jsonl", b'{"body": "ok"}\n', "a.jsonl:1: no 'text' field in this record (fields found: body). Set data"),
    ("a.jsonl", b'{"text": 3}\n', "a.jsonl:1: field 'text' is a number, not a string"),
    ("a.parquet", b"PAR1", "suffix '.parquet'"),
])
def test_bad_files_give_clear_errors(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ShardlmError, match=None) as err:
        tokens_of(tmp_path / name, tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_corpus_shorter_than_one_block_names_the_data_and_the_fix(tmp_path):
    from shardlm.config import DataConfig
    from shardlm.data import prepare_data
    from shardlm.dist import Dist, detect_launch

    (tmp_path / "a.txt").write_text("hi")
    cfg = DataConfig(train=str(tmp_path / "a.txt"), cache_dir=str(tmp_path / "cache"))
    one_process = Dist(detect_launch(launcher="single"), torch.device("cpu"))
    with pytest.raises(ShardlmError, match=r"training data '.*a.txt' \(less the 10% held out for validation\) has "
                                           r"2 tokens.*smaller data.seq_len, or a smaller data.val_fraction"):
        prepare_data(cfg, byte_tokenizer(), one_process)


def test_missing_path_or_empty_folder(tmp_path):
    with pytest.raises(ShardlmError, match="does not exist"):
        resolve(str(tmp_path / "nope.txt"))
    (tmp_path / "d").mkdir()
    with pytest.raises(ShardlmError, match="holds no .txt/.csv/.jsonl/.json files. Put text files in it"):
        resolve(str(tmp_path / "d"))


def test_hf_spec_parsing():
    assert parse_hf("hf:wikitext/wikitext-2-raw-v1", "train") == ("wikitext", "wikitext-2-raw-v1", "train")
    assert parse_hf("hf:Skylion007/openwebtext", "train") == ("Skylion007/openwebtext", None, "train")
    assert parse_hf("hf:Salesforce/wikitext/wikitext-103-raw-v1:test", "train") == \
        ("Salesforce/wikitext", "wikitext-103-raw-v1", "test")


@pytest.mark.parametrize("world, batch, accum", [(1, 8, 1), (2, 4, 1), (4, 2, 1), (1, 2, 4), (2, 2, 2)])
def test_global_batch_is_world_size_invariant(world, batch, accum):
    sampler = GlobalSampler(100, seed=3)
    reference = [set(sampler.indices(step * 8, 8)) for step in range(30)]  # 1 process x 8 blocks
    for step in range(30):
        shares = [set(sampler.indices(micro_batch_position(step * 8, m, r, world, batch), batch))
                  for r in range(world) for m in range(accum)]
        assert set().union(*shares) == reference[step]
        assert sum(map(len, shares)) == 8  # disjoint


def test_epochs_are_permutations():
    sampler = GlobalSampler(10, seed=0)
    assert sorted(sampler.indices(0, 10)) == list(range(10))
    assert sorted(sampler.indices(10, 10)) == list(range(10))
    assert list(sampler.indices(0, 10)) != list(sampler.indices(10, 10))


def test_eval_shares_cover_every_block_once():
    for world in (1, 2, 3):
        shares = [np.concatenate(eval_shares(11, r, world, 2, 0)) for r in range(world)]
        assert len({len(s) for s in shares}) == 1  # same number of batches on every rank
        real = np.concatenate(shares)
        assert sorted(real[real >= 0]) == list(range(11))

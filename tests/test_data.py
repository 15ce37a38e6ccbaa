import json

import numpy as np
import pytest
import torch

from shardlm import ShardlmError
from shardlm.data import GlobalSampler, eval_shares, micro_batch_position
from shardlm.data.cache import build_cache, load_tokens
from shardlm.data.sources import iter_documents, parse_hf, resolve
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
    ("a.jsonl", b'{"prompt": "p", "choosen": "a", "rejected": "b"}\n', "(fields found: prompt, choosen, rejected). It "
     "has 'rejected' of a preference example, which needs 'chosen' and 'rejected': 'chosen' is missing (is 'choosen' "
     "a misspelling?). Fix the field's name."),
    ("a.jsonl", b'{"text": 3}\n', "a.jsonl:1: field 'text' is a number, not a string"),
    ("a.parquet", b"PAR1", "a.parquet' is not a readable Parquet file (Parquet file size is 4 bytes"),
    ("a.pdf", b"%PDF", "suffix '.pdf'; shardlm reads .txt/.csv/.jsonl (also .gz/.zst), .parquet files"),
])
def test_bad_files_give_clear_errors(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ShardlmError, match=None) as err:
        tokens_of(tmp_path / name, tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_corpus_shorter_than_one_block_names_the_data_and_the_fix(tmp_path):
    from shardlm.config import DataConfig
    from shardlm.data import prepare_data
    from shardlm.distributed.process_group import Dist, detect_launch

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
    with pytest.raises(ShardlmError, match="holds no .txt/.csv/.jsonl .also .gz/.zst., .parquet files. Put text"):
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


# --- long documents: token-neutral cuts, flat memory ---------------------------------------------------------

AWKWARD = ["word", "bc", " ", "  ", "   ", "\n", "\n\n", " \n ", "\n  ", "\t", "é", "日本語", "、", "。", "🙂", ",",
           "'s", "123", "--", " The", "ünïcödé"]


def awkward_text(n: int, seed: int = 0) -> str:
    """Real text with runs of spaces and newlines, multi-byte characters and contractions mixed in."""
    import random

    from helpers import SHAKESPEARE

    rng = random.Random(seed)
    prose = SHAKESPEARE.read_text()[:n]
    return "".join(rng.choice(AWKWARD) + prose[i:i + rng.randint(0, 40)] for i in range(0, n, 40))


@pytest.mark.parametrize("name, tiktoken", [("gpt2", "1"), ("gpt2", "0"), ("bytes", "1")])
def test_cut_pieces_give_the_tokens_of_the_whole_text(name, tiktoken, monkeypatch):
    import random

    from shardlm.data.cache import encoder
    from shardlm.data.pieces import cut_documents

    monkeypatch.setenv("SHARDLM_TIKTOKEN", tiktoken)  # GPT-2 through tiktoken, and through tokenizers
    tok = load_tokenizer(name)
    encode = encoder(tok)
    text = awkward_text(30000)
    rng = random.Random(1)
    cuts = sorted(rng.sample(range(1, len(text)), 300))  # fragments cut anywhere, as the readers give them
    fragments = [(text[a:b], False) for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)] + [("", True)]
    pieces = list(cut_documents(iter(fragments), encode, size=200))
    assert "".join(p for p, _ in pieces) == text and len(pieces) > 50
    assert max(len(p) for p, _ in pieces) <= 200 and [e for _, e in pieces].count(True) == 1
    whole = tok(text, add_special_tokens=False)["input_ids"]
    assert [i for ids in encode([p for p, _ in pieces]) for i in ids] == whole
    in_one = list(cut_documents(iter([(text, True)]), encode, size=200))  # one fragment of many pieces
    assert in_one == pieces


def test_txt_read_in_blocks_splitting_characters_tokenizes_as_a_whole(tmp_path, monkeypatch):
    from shardlm.data import cache, readers

    monkeypatch.setattr(readers, "BLOCK", 7)  # most blocks end inside a multi-byte character
    monkeypatch.setattr(cache, "PIECE_CHARS", 500)
    text = awkward_text(5000, seed=2)
    (tmp_path / "a.txt").write_text(text)
    tok = load_tokenizer("gpt2")
    assert tokens_of(tmp_path / "a.txt", tmp_path, tok) == [*tok(text)["input_ids"], 50256]


def test_a_word_longer_than_a_piece_is_cut_with_a_warning(capsys):
    from shardlm.data.cache import encoder
    from shardlm.data.pieces import cut_documents

    pieces = list(cut_documents(iter([("a" * 1000, True)]), encoder(byte_tokenizer()), size=300, name="w.txt"))
    assert [len(p) for p, _ in pieces] == [300, 300, 300, 100]
    assert "w.txt: a run of 300 characters with no word boundary" in capsys.readouterr().err


def _peak_rss_mb_of(fn) -> float:
    """Peak RSS (MB) of this process while `fn` runs: Linux resets the high-water mark on request."""
    from pathlib import Path

    Path("/proc/self/clear_refs").write_text("5")
    fn()
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


@pytest.mark.skipif(not __import__("os").access("/proc/self/clear_refs", __import__("os").W_OK), reason="Linux")
def test_rss_stays_flat_as_one_document_grows_10x(tmp_path, monkeypatch):
    """One 0.2 MB and one 2 MB document without a newline, in 16 KB pieces and 64 KB batches (the defaults
    are 256 KB and 4 MB, which a test cannot outgrow quickly). Whole, GPT-2's HF tokenizer takes ~230 MB
    more for the second (measured); in pieces the peak does not move."""
    from helpers import SHAKESPEARE
    from shardlm.data import cache

    monkeypatch.setattr(cache, "PIECE_CHARS", 16 << 10)
    monkeypatch.setattr(cache, "BATCH_CHARS", 64 << 10)
    monkeypatch.setenv("SHARDLM_TIKTOKEN", "0")  # the tokenizers library: the one whose memory grows with text
    tok = load_tokenizer("gpt2")
    line = SHAKESPEARE.read_text()[:200_000].replace("\n", " ")
    peaks = []
    for times in (1, 10):
        (tmp_path / f"{times}.txt").write_text(line * times)
        source = resolve(str(tmp_path / f"{times}.txt"))
        peaks.append(_peak_rss_mb_of(lambda: build_cache(source, tok, tmp_path / "c", log=lambda *_: None)))  # noqa: B023
    assert peaks[1] - peaks[0] < 20, f"peak RSS {peaks[0]:.0f} MB at 1x, {peaks[1]:.0f} MB at 10x"


def test_tiktoken_gives_the_hf_tokenizers_ids_or_is_not_used(monkeypatch):
    from shardlm.data.cache import encoder
    from shardlm.data.fastbpe import tiktoken_encoder

    tok = load_tokenizer("gpt2")
    monkeypatch.setenv("SHARDLM_TIKTOKEN", "0")
    hf = encoder(tok)
    monkeypatch.setenv("SHARDLM_TIKTOKEN", "1")
    fast = tiktoken_encoder(tok, hf)
    texts = [awkward_text(20000, seed=3), "an added token <|endoftext|> in the text", ""]
    assert fast is not None and fast(texts) == hf(texts) == [tok(t)["input_ids"] for t in texts]
    assert tiktoken_encoder(byte_tokenizer(), encoder(byte_tokenizer())) is None  # not the shape it handles


# --- formats: Parquet, save_to_disk (Arrow), compressed files, hf:json ----------------------------------------

DOCS = ["first document", "second\nwith a newline", "third: ünïcödé 🙂"]


def expected_bytes(docs=DOCS) -> list[int]:
    return [t for d in docs for t in (*d.encode(), EOS)]


def test_parquet_is_read_row_group_by_row_group(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": [1, 2, 3, 4], "body": [DOCS[0], None, DOCS[1], DOCS[2]]})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    assert pq.ParquetFile(tmp_path / "a.parquet").num_row_groups == 2
    assert tokens_of(tmp_path / "a.parquet", tmp_path, text_field="body") == expected_bytes()


def test_save_to_disk_folders_dataset_and_dataset_dict(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_dict({"text": DOCS}).save_to_disk(tmp_path / "ds")
    assert tokens_of(tmp_path / "ds", tmp_path) == expected_bytes()
    DatasetDict({"train": Dataset.from_dict({"text": DOCS[:2]}),
                 "validation": Dataset.from_dict({"text": DOCS[2:]})}).save_to_disk(tmp_path / "dd")
    tok = byte_tokenizer()
    val = build_cache(resolve(str(tmp_path / "dd"), "validation"), tok, tmp_path / "c", log=lambda *_: None)
    assert list(load_tokens(val)) == expected_bytes(DOCS[2:])
    assert tokens_of(tmp_path / "dd", tmp_path) == expected_bytes(DOCS[:2])


def write_compressed(path, data: bytes) -> None:
    import gzip

    import zstandard

    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else zstandard.ZstdCompressor().compress(data))


@pytest.mark.parametrize("name", ["a.txt.gz", "a.txt.zst", "a.jsonl.gz", "a.csv.zst"])
def test_compressed_files_stream_like_plain_ones(tmp_path, name):
    docs = DOCS if ".txt" not in name else ["\n\n".join(DOCS)]
    if ".jsonl" in name:
        data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    elif ".csv" in name:
        data = ("text\n" + "".join('"' + d + '"\n' for d in docs)).encode()
    else:
        data = docs[0].encode()
    write_compressed(tmp_path / name, data)
    assert tokens_of(tmp_path / name, tmp_path) == expected_bytes(docs)


def test_folder_of_mixed_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    (tmp_path / "d").mkdir()
    write_compressed(tmp_path / "d" / "a.txt.gz", b"A")
    pq.write_table(pa.table({"text": ["B"]}), tmp_path / "d" / "b.parquet")
    Dataset.from_dict({"text": ["C"]}).save_to_disk(tmp_path / "d" / "c")  # its .json files are not documents
    write_compressed(tmp_path / "d" / "d.jsonl.zst", b'{"text": "D"}\n')
    assert tokens_of(tmp_path / "d", tmp_path) == [ord("A"), EOS, ord("B"), EOS, ord("C"), EOS, ord("D"), EOS]


def test_hf_json_with_data_files(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    files = {"train": str(tmp_path / "a.jsonl"), "validation": str(tmp_path / "a.jsonl")}
    tok = byte_tokenizer()
    folder = build_cache(resolve("hf:json", "validation", files), tok, tmp_path / "c", log=lambda *_: None)
    assert list(load_tokens(folder)) == expected_bytes()
    with pytest.raises(ShardlmError, match="'hf:json' reads local files .*set data.data_files"):
        resolve("hf:json")
    with pytest.raises(ShardlmError, match=r"Bad split: validation.*Check data.data_files.*\{train: \.\.\., valid"):
        list(iter_documents(resolve("hf:json", "validation", str(tmp_path / "a.jsonl"))))
    (tmp_path / "lines.txt").write_text("one\ntwo\n")  # hf:text rows are lines without their newline
    pieces = list(iter_documents(resolve("hf:text", "train", str(tmp_path / "lines.txt")), rows_are_documents=False))
    assert "".join(text for text, _ in pieces) == "one\ntwo\n"


def test_hf_dataset_downloaded_earlier_loads_offline_from_the_hf_cache(tmp_path, monkeypatch):
    """A hub dataset in the local HF datasets cache (the layout a download leaves) is read with no network."""
    import shutil
    from pathlib import Path

    import datasets
    from huggingface_hub import constants

    from shardlm.hub import hub_reachable

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    built = datasets.load_dataset("json", data_files=str(tmp_path / "a.jsonl"), split="train",
                                  cache_dir=str(tmp_path / "hf"))
    src = Path(built.cache_files[0]["filename"]).parent
    dst = tmp_path / "hf" / "some-org___tiny" / "default" / "0.0.0" / src.name
    shutil.copytree(src, dst)
    for f in dst.glob("json-*"):
        f.rename(dst / f.name.replace("json-", "tiny-"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    hub_reachable.cache_clear()
    try:
        assert tokens_of("hf:some-org/tiny", tmp_path) == expected_bytes()
        with pytest.raises(ShardlmError, match="Hub cannot be reached and it is not in the local HF datasets cache"):
            tokens_of("hf:some-org/missing", tmp_path)
    finally:
        hub_reachable.cache_clear()


def test_count_tokens_writes_nothing_and_stops_once_there_are_enough(tmp_path, monkeypatch):
    """A dry run's count: a built cache's own number, else the source tokenized in memory; past `enough`
    tokens the rest of a large corpus is left unread (exact False), and nothing is ever written."""
    from shardlm.data import cache
    from shardlm.data.cache import count_tokens

    monkeypatch.setattr(cache, "BATCH_CHARS", 100)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": "y" * 49}) + "\n" for _ in range(100)))
    source, root = resolve(str(tmp_path / "a.jsonl")), tmp_path / "cache"
    assert count_tokens(source, byte_tokenizer(), root) == (5000, True)
    assert count_tokens(source, byte_tokenizer(), root, enough=4990) == (5000, True)  # reached in the last batch
    counted, exact = count_tokens(source, byte_tokenizer(), root, enough=1000)
    assert 1000 <= counted < 1200 and not exact and not root.exists()
    (tmp_path / "empty.csv").write_text('text\n""\n')
    with pytest.raises(ShardlmError, match="holds no text"):
        count_tokens(resolve(str(tmp_path / "empty.csv")), byte_tokenizer(), root)
    build_cache(source, byte_tokenizer(), root, log=lambda *_: None)
    assert count_tokens(source, byte_tokenizer(), root, enough=10) == (5000, True)


def test_the_counting_loader_gives_prepare_data_the_runs_blocks(tmp_path):
    from shardlm.config import load_config
    from shardlm.data import counting_loader, prepare_data
    from shardlm.distributed.process_group import Dist, LaunchInfo

    (tmp_path / "a.txt").write_text("abc " * 1000)
    cfg = load_config(None, [f"data.train={tmp_path / 'a.txt'}", "data.seq_len=32",
                             f"data.cache_dir={tmp_path / 'cache'}"]).data
    exact: list[bool] = []
    train, val = prepare_data(cfg, byte_tokenizer(), None, counting_loader(10**9, exact))
    assert exact == [True] and not (tmp_path / "cache").exists()
    run_train, run_val = prepare_data(cfg, byte_tokenizer(), Dist(LaunchInfo("single"), torch.device("cpu")))
    assert (len(train), len(val)) == (len(run_train), len(run_val)) == (112, 12)


# --- bad data files: one line naming the file and the fix; earlier caches untouched ---------------------------
def _data_error(path, tmp_path, **kw) -> str:
    from shardlm.data.cache import build_cache
    from shardlm.data.sources import resolve

    with pytest.raises(ShardlmError) as err:
        build_cache(resolve(str(path), "train"), byte_tokenizer(), tmp_path / "cache", log=lambda *_: None, **kw)
    assert "\n" not in str(err.value)
    return str(err.value)


def _gzip_and_zstd(tmp_path, name: str, data: bytes) -> tuple:
    import gzip

    import zstandard

    gz, zst = gzip.compress(data), zstandard.ZstdCompressor().compress(data)
    return (tmp_path / f"{name}.gz", gz), (tmp_path / f"{name}.zst", zst)


def test_truncated_and_corrupt_compressed_files_name_the_file_and_the_byte(tmp_path):
    import random

    data = "".join(random.Random(0).choices("abc de\n", k=20_000)).encode()
    (gz, gz_bytes), (zst, zst_bytes) = _gzip_and_zstd(tmp_path, "c.txt", data)
    gz.write_bytes(gz_bytes[: len(gz_bytes) // 2])
    zst.write_bytes(zst_bytes[: len(zst_bytes) // 2])
    message = _data_error(gz, tmp_path)
    assert f"c.txt.gz' is truncated: its gzip stream stops inside a compressed frame at byte {len(gz_bytes) // 2:,}" \
           in message and "Re-download or re-compress it (`gzip -t c.txt.gz` checks a file)" in message
    assert "c.txt.zst' is truncated: its zstd stream stops" in _data_error(zst, tmp_path)
    gz.write_bytes(gz_bytes[:-8] + bytes(8))  # CRC and length zeroed
    assert "c.txt.gz' is corrupt gzip data near byte" in _data_error(gz, tmp_path)
    zst.write_bytes(zst_bytes[:4] + b"\xff" * 8 + zst_bytes[12:])  # frame header garbled
    assert "c.txt.zst' is corrupt zstd data near byte" in _data_error(zst, tmp_path)
    (tmp_path / "plain.jsonl.gz").write_text('{"text": "not compressed"}\n')
    assert "plain.jsonl.gz' is not gzip data" in _data_error(tmp_path / "plain.jsonl.gz", tmp_path)


def test_parquet_without_the_text_column_lists_its_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1], "body": ["x"]}), tmp_path / "a.parquet")
    assert "a.parquet: Parquet file has no 'text' column (columns: id, body). Set data.text_field" in \
        _data_error(tmp_path / "a.parquet", tmp_path)
    assert "column 'id' holds int64, not text" in _data_error(tmp_path / "a.parquet", tmp_path, text_field="id")
    from shardlm.config import load_config
    from shardlm.preflight.dryrun import dry_run

    with pytest.raises(ShardlmError, match="has no 'text' column"):  # `train --dry-run` reads the first records
        dry_run(load_config(None, [f"data.train={tmp_path / 'a.parquet'}", "model.tokenizer=bytes"]), 1)
    import random

    rng = random.Random(0)
    pq.write_table(pa.table({"text": ["".join(rng.choices("abcdefgh ", k=100)) for _ in range(500)]}),
                   tmp_path / "b.parquet", row_group_size=100)
    damaged = bytearray((tmp_path / "b.parquet").read_bytes())
    damaged[len(damaged) // 2: len(damaged) // 2 + 2000] = bytes(2000)
    (tmp_path / "b.parquet").write_bytes(bytes(damaged))
    assert "b.parquet' is corrupt Parquet after row " in _data_error(tmp_path / "b.parquet", tmp_path)


def test_arrow_folder_that_is_not_a_dataset(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"text": ["x"]}).save_to_disk(tmp_path / "ds")
    (tmp_path / "ds" / "state.json").unlink()
    assert "folder '" in (msg := _data_error(tmp_path / "ds", tmp_path)) and \
        "ds' holds Arrow data but is not a dataset saved by datasets' save_to_disk (no state.json beside its " \
        ".arrow files). Give the folder save_to_disk wrote" in msg
    (tmp_path / "ds" / "state.json").write_text('{"_data_files": [{"filename": "gone.arrow"}]}')
    assert "(gone.arrow, listed in its state.json, is missing)" in _data_error(tmp_path / "ds", tmp_path)
    (tmp_path / "ds" / "state.json").write_text("{not json")
    assert "(state.json is not readable JSON" in _data_error(tmp_path / "ds", tmp_path)


def test_a_mistyped_data_path_names_the_file_beside_it(tmp_path, monkeypatch):
    from shardlm.data.sources import resolve

    (tmp_path / "speeches.csv").write_text("text\nhello\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ShardlmError, match=r"data path 'speechs.csv' does not exist. Did you mean 'speeches.csv'\?"):
        resolve("speechs.csv", "train", None)


# ---- cache integrity: sizes and checksums recorded at build, checked at open ----

def damage(path, how: str) -> None:
    """A cache file truncated (a full disk, a copy cut short) or zeroed in place (same size)."""
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2] if how == "truncated" else b"\0" * size)


def refused_then_rebuilt(folder, name: str, how: str, load, build) -> None:
    """Opening the damaged cache is one line naming the file and the fix; building it again gives the same data
    back, with a warning, and keeps what the folder held beside the cache (a stored reference)."""
    from shardlm.data.examples import reference_problem, save_reference

    save_reference(folder / "reference-k.npy", np.ones((3, 2)))
    whole = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "meta.json"}
    damage(folder / name, how)
    with pytest.raises(ShardlmError) as err:
        load(folder)
    msg = str(err.value)
    assert str(folder / name) in msg and f"Delete {folder} and rerun" in msg and "\n" not in msg, msg
    logs: list[str] = []
    assert build(logs.append) == folder
    assert logs[0].startswith(f"warning: {folder / name} "), logs
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "meta.json"} == whole
    assert reference_problem(folder / "reference-k.npy") is None and load(folder) is not None
    assert not list(folder.parent.glob("*.damaged*"))


@pytest.mark.parametrize("name, how", [("tokens.bin", "truncated"), ("tokens.bin", "zeroed"),
                                       ("meta.json", "truncated")])
def test_a_damaged_text_cache_is_refused_at_open_and_built_again(tmp_path, name, how):
    (tmp_path / "a.txt").write_text("to be or not to be " * 200)
    source, tok = resolve(str(tmp_path / "a.txt")), byte_tokenizer()

    def build(log):
        return build_cache(source, tok, tmp_path / "cache", log=log)

    refused_then_rebuilt(build(lambda _: None), name, how, load_tokens, build)


@pytest.mark.parametrize("name, how", [("labels.bin", "zeroed"), ("offsets.npy", "truncated"),
                                       ("records.npy", "zeroed"), ("meta.json", "zeroed")])
def test_a_damaged_example_cache_is_refused_at_open_and_built_again(tmp_path, name, how):
    from shardlm.config import DataConfig
    from shardlm.data.examples import build_examples, load_examples

    rows = [{"prompt": f"add {i} and {i}", "completion": f" {2 * i}"} for i in range(40)]
    (tmp_path / "ex.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source, tok = resolve(str(tmp_path / "ex.jsonl")), byte_tokenizer()

    def build(log):
        return build_examples(source, tok, DataConfig(), tmp_path / "cache", log=log)

    refused_then_rebuilt(build(lambda _: None), name, how, load_examples, build)


def test_a_cache_built_before_checksums_opens_and_its_sizes_are_still_checked(tmp_path):
    (tmp_path / "a.txt").write_text("to be or not to be " * 200)
    folder = build_cache(resolve(str(tmp_path / "a.txt")), byte_tokenizer(), tmp_path / "cache", log=print)
    meta = json.loads((folder / "meta.json").read_text())
    del meta["check"]
    (folder / "meta.json").write_text(json.dumps(meta))
    assert len(load_tokens(folder)) == meta["num_tokens"]
    damage(folder / "tokens.bin", "truncated")
    with pytest.raises(ShardlmError, match=r"tokens.bin is truncated: 3,801 bytes, 7,602 written\. Delete "):
        load_tokens(folder)


def test_a_stored_reference_truncated_or_zeroed_is_named(tmp_path):
    from shardlm.data.examples import reference_problem, save_reference

    path = tmp_path / "reference-k.npy"
    for how, words in (("truncated", "is truncated"), ("zeroed", "was changed since it was written")):
        save_reference(path, np.arange(8.0).reshape(4, 2))
        assert reference_problem(path) is None
        damage(path, how)
        assert reference_problem(path).startswith(f"{path} {words}")
    path.with_name("reference-k.check.json").unlink()  # written before the record: numpy's reading checks it
    assert reference_problem(path) == f"{path} is not a whole .npy file"


def test_a_large_file_is_summed_by_chunks_spread_over_it_first_and_last_included(tmp_path, monkeypatch):
    from shardlm.data import integrity

    monkeypatch.setattr(integrity, "CHUNKS", 4)
    monkeypatch.setattr(integrity, "CHUNK", 16)
    monkeypatch.setattr(integrity, "WHOLE", 64)  # 1,024 bytes: chunks at 0, 336, 672 and 1,008
    path, data = tmp_path / "tokens.bin", bytes(range(256)) * 4
    path.write_bytes(data)
    whole = integrity.checksum(path)
    for at, seen in ((0, True), (340, True), (1023, True), (300, False)):  # 300: between chunks, not read
        path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
        assert (integrity.checksum(path) != whole) == seen, at


def test_counts_are_said_in_the_datas_own_units(tmp_path):
    """A pairs file too small for a batch is counted in pairs and rows, not 'blocks of 128 tokens'; one pair is
    'pair'."""
    from shardlm.config import DataConfig, load_config
    from shardlm.data import ExampleRows, TokenBlocks
    from shardlm.data.blocks import counted
    from shardlm.data.examples import build_examples, load_examples
    from shardlm.observe.metrics import describe_val
    from shardlm.training.checks import count_steps

    rows = [{"prompt": f"say {i}", "chosen": f" {i}", "rejected": f" {i + 1}"} for i in range(3)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs: list[str] = []
    pairs = load_examples(build_examples(resolve(str(tmp_path / "pairs.jsonl")), byte_tokenizer(), DataConfig(),
                                         tmp_path / "cache", log=logs.append))
    assert logs[-1].startswith("rendered 3 pairs (6 sequences) into "), logs
    split = ExampleRows(pairs, 128, 0, None, False, "truncate", "pairs.jsonl")
    assert counted(split, len(split), 128) == "3 pairs in 3 rows of up to 128 tokens"
    with pytest.raises(ShardlmError, match=r"^the training data has 3 pairs in 3 rows of up to 128 tokens, fewer "
                                           r"than one global batch of 8 \(= 1 device x train.batch_size=8 x .*"
                                           r"Use more data or lower train.batch_size\.$"):
        count_steps(load_config(None, ["train.batch_size=8", "data.seq_len=128"]), split, 1)
    assert counted(TokenBlocks(np.zeros(300, dtype=np.uint16), 128), 2, 128) == "2 blocks of 128 tokens"
    one = {"loss": 0.69, "rewards/accuracy": 1.0, "rewards/margin": 0.1, "rewards/chosen": 0.1,
           "rewards/rejected": 0.0, "pairs": 1, "tokens": 9}
    assert "on 1 pair, all 9 held-out tokens" in describe_val(one, 9, 0)

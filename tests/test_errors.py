"""Bad input: one clear message naming the problem and the fix, exit code 2, no traceback, nothing lost.
The catalogue lives in docs/errors.md; data and config cases are also in test_data.py / test_config.py."""


import pytest
import torch

from helpers import byte_gpt2_config, shardlm_cli, tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.distributed.parallelize import plan
from shardlm.models.causal_lm import model_config
from shardlm.tokenizer import byte_tokenizer, load_tokenizer

CPU = torch.device("cpu")


@pytest.mark.parametrize("overrides, world, local, message", [
    (["parallel.precision=fp16"], 1, 1, "fp16 needs a GPU"),
    (["parallel.sharding=hybrid_full", "parallel.shard_size=2"], 3, 3, "2 does not divide 3 ranks"),
    (["parallel.sharding=hybrid_grad"], 6, 4, "4 does not divide 6 ranks"),
    (["model.attention=flex_attention"], 1, 1, "flex_attention trains on CUDA GPUs only"),
])
def test_infeasible_parallel_plans(overrides, world, local, message):
    with pytest.raises(ShardlmError, match=message):
        plan(load_config(None, overrides), world, local, CPU)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.precision=fp16"], 1, "precision=fp16 is not supported on XLA.*parallel.precision=bf16"),
    (["parallel.compile=model"], 1, "compile=model is not supported on XLA.*compiles every step's graph itself"),
    (["parallel.sharding=hybrid_grad"], 1, "sharding=hybrid_grad is not supported on XLA.*hybrid_full"),
    ([], 2, "with 2 launched processes.*without a launcher"),
])
def test_what_xla_cannot_do_is_refused_before_any_work(overrides, world, message):
    with pytest.raises(ShardlmError, match=message):  # config values only: no torch_xla needed
        plan(load_config(None, overrides), world, world, torch.device("xla"))


@pytest.mark.skipif(__import__("importlib").util.find_spec("torch_xla") is not None, reason="torch_xla is installed")
def test_xla_without_torch_xla_says_how_to_install(corpus, cache_dir, tmp_path):
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"parallel.device": "xla"})], check=False)
    assert proc.returncode == 2 and "torch_xla is not installed" in proc.stderr and "make test-xla" in proc.stderr
    assert not tmp_path.joinpath("metrics.jsonl").exists()


def test_tokenizer_larger_than_model_vocab(tmp_path):
    byte_gpt2_config(n_positions=1024).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.name={tmp_path}", "model.tokenizer=gpt2"])
    with pytest.raises(ShardlmError, match="50257 tokens but the model's vocabulary holds 257"):
        model_config(cfg, load_tokenizer("gpt2"))


def test_seq_len_beyond_pretrained_positions(tmp_path):
    byte_gpt2_config().save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.name={tmp_path}", "data.seq_len=128"])
    with pytest.raises(ShardlmError, match="data.seq_len=128 exceeds the model's 64 positions"):
        model_config(cfg, byte_tokenizer())


@pytest.fixture
def hub_unreachable(monkeypatch, tmp_path):
    """The Hub's endpoint is a closed local port and the HF cache an empty folder, on any machine."""
    from huggingface_hub import constants

    from shardlm.hub import hub_reachable

    for var in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    hub_reachable.cache_clear()
    yield tmp_path / "hf-cache"
    hub_reachable.cache_clear()


def test_unreachable_model_name_says_offline_and_local_folder(hub_unreachable):
    cfg = load_config(None, ["model.name=no-such-org/no-such-model-xyz"])
    with pytest.raises(ShardlmError, match="Hub cannot be reached and it is not in the local HF cache.*local folder"):
        model_config(cfg, byte_tokenizer())


def test_unreachable_hub_tokenizer_and_dataset(hub_unreachable):
    from shardlm.data.sources import Source, iter_documents

    with pytest.raises(ShardlmError, match="tokenizer 'no-org/tok': .*Hub cannot be reached.*model.tokenizer=gpt2"):
        load_tokenizer("no-org/tok")
    with pytest.raises(ShardlmError, match="Hub cannot be reached.*point data.train/data.val at local"):
        next(iter_documents(Source("hf:wikitext", hf=("wikitext", None, "train"))))


def test_hub_name_loads_from_the_local_hf_cache_offline(hub_unreachable):
    """A model downloaded earlier (HF cache layout) loads by its hub name with no network."""
    snapshot = hub_unreachable / "models--some-org--tiny-gpt2" / "snapshots" / ("0" * 40)
    byte_gpt2_config().save_pretrained(snapshot)
    byte_tokenizer().save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    tokenizer = load_tokenizer("some-org/tiny-gpt2")
    cfg = load_config(None, ["model.name=some-org/tiny-gpt2", "data.seq_len=32"])
    assert model_config(cfg, tokenizer).n_positions == 64


@pytest.mark.parametrize("extra, message", [
    ({"train.batch_size": 100000}, "fewer than one global batch"),
    ({"parallel.precision": "fp16"}, "fp16 needs a GPU"),
    ({"data.train": "/nonexistent/corpus.txt"}, "does not exist"),
    ({"train.lr": "fast"}, "train.lr' expects float"),
])
def test_cli_errors_are_one_line_exit_2(corpus, cache_dir, tmp_path, extra, message):
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path / "run", **extra)], check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:")
    assert not (tmp_path / "run").exists()  # a failed command leaves no empty run folder behind


def test_a_failed_rank_under_nproc_is_one_line(corpus, cache_dir, tmp_path):
    """`shardlm train --nproc 2` with bad input: the rank's one-line error, not torchrun's failure report."""
    args = tiny(corpus, cache_dir, tmp_path / "run", **{"data.train": "/missing.txt"})
    proc = shardlm_cli(["train", "--nproc", "2", *args], check=False)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: data path '/missing.txt' does not exist")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["bad.yaml"], "error: config file 'bad.yaml' is not valid YAML: expected ',' or ']', but got ':' at line 3"),
    (["data.train=tiny.txt", "data.seq_len=512", "model.n_positions=256"],  # and a 2-byte corpus
     "error: data.seq_len=512 exceeds model.n_positions=256: lower data.seq_len or raise model.n_positions."),
])
def test_config_errors_come_first_in_one_line(tmp_path, args, message):
    (tmp_path / "bad.yaml").write_text("train:\n  lr: [1, 2\n  x: 3\n")
    (tmp_path / "tiny.txt").write_text("hi")
    proc = shardlm_cli(["train", *args, "out_dir=run", "data.cache_dir=cache"], check=False, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(message) and "\n" not in proc.stderr.strip()
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()  # nothing read or written


def test_out_dir_that_is_a_file(corpus, cache_dir, tmp_path):
    (tmp_path / "file").write_text("precious")
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path / "file")], check=False)
    assert proc.returncode == 2 and "is a file" in proc.stderr
    assert (tmp_path / "file").read_text() == "precious"


def test_failed_or_finished_commands_leave_a_run_folder_as_it_was(corpus, cache_dir, tmp_path):
    """A bad resume, a missing data path and a resume past the last step change no byte of the run; a
    resume with a changed config keeps the earlier config and counts this invocation's steps apart."""
    shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 2})])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"model.n_layer": 3})], check=False)
    assert proc.returncode == 2 and "n_layer: checkpoint 2 vs config 3" in proc.stderr
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"data.train": "/missing.txt"})], check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 2})])
    assert "nothing to train" in proc.stdout and "raise train.max_steps" in proc.stdout
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 3})])
    assert "train.max_steps 2 -> 3" in proc.stdout and "done: step 3/3; this invocation: 1 step in" in proc.stdout
    assert (tmp_path / "config.1.yaml").read_bytes() == before[tmp_path / "config.yaml"]


def test_disk_full_while_saving_keeps_earlier_checkpoints(corpus, cache_dir, tmp_path, monkeypatch):
    from shardlm.checkpoint import checkpointer as ckpt_mod
    from shardlm.train import train

    cfg = load_config(None, tiny(corpus, cache_dir, tmp_path, **{"checkpoint.every": 2, "train.max_steps": 6}))
    real_save, calls = ckpt_mod.dcp.save, []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod.dcp, "save", full_disk)
    with pytest.raises(ShardlmError, match="No space left on device.*intact"):
        train(cfg)
    assert (tmp_path / "checkpoints" / "step_000000002" / "manifest.json").is_file()


@pytest.fixture
def hf_folder(tmp_path):
    from transformers import GPT2LMHeadModel

    folder = tmp_path / "hf"
    GPT2LMHeadModel(byte_gpt2_config(n_positions=32)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_export_never_replaces_a_file_or_a_foreign_folder(hf_folder, tmp_path):
    from shardlm.inference.export import export

    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(ShardlmError, match="is a file; give a folder"):
        export(hf_folder, tmp_path / "notes.txt")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(ShardlmError, match="holds other files .not an earlier shardlm export"):
        export(hf_folder, tmp_path / "home")
    assert (tmp_path / "notes.txt").read_text() == (tmp_path / "home" / "thesis.tex").read_text() == "precious"
    export(hf_folder, tmp_path / "out")
    export(hf_folder, tmp_path / "out")  # an earlier export is replaced
    assert (tmp_path / "out" / "model.safetensors").is_file()
    with pytest.raises(ShardlmError, match="is the model being exported"):
        export(tmp_path / "out", tmp_path / "out")
    before = sorted(p.name for p in hf_folder.iterdir())
    with pytest.raises(ShardlmError, match="not an earlier shardlm export"):  # e.g. a downloaded model
        export(tmp_path / "out", hf_folder)
    assert sorted(p.name for p in hf_folder.iterdir()) == before


def test_eval_of_an_export_needs_data(hf_folder):
    from shardlm.inference.evaluate import evaluate_path

    with pytest.raises(ShardlmError, match="carries no data settings: pass data.val=PATH"):
        evaluate_path(str(hf_folder), [])


# ---- rows 85-91: eval --generation and export --push-to-hub --------------------------------------------------
@pytest.mark.parametrize("env, message", [
    ({"HF_HUB_OFFLINE": "1"}, "--push-to-hub: HF_HUB_OFFLINE is set, so nothing was uploaded; the export in"),
    ({"HF_TOKEN": ""}, "--push-to-hub needs a Hugging Face token with write access: set HF_TOKEN"),
])
def test_push_to_hub_offline_or_without_token(hf_folder, tmp_path, monkeypatch, env, message):
    from huggingface_hub import constants

    from shardlm.hub import push_folder
    from shardlm.inference.export import export

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no `hf auth login` token
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = export(hf_folder, tmp_path / "out", repo_id="me/tiny")
    with pytest.raises(ShardlmError, match=message) as error:
        push_folder(out, "me/tiny")
    assert "\n" not in str(error.value) and (out / "model.safetensors").is_file()


def test_generation_options_are_checked_before_loading(tmp_path, monkeypatch):
    import sys

    from shardlm.inference.evaluate import GenOptions, evaluate_path

    missing = str(tmp_path / "no-run")
    with pytest.raises(ShardlmError, match="--generation must be >= 0"):
        evaluate_path(missing, [], gen=GenOptions(n=-1))
    with pytest.raises(ShardlmError, match=r"--top-p must be in \(0, 1\]"):
        evaluate_path(missing, [], gen=GenOptions(n=4, top_p=0))
    monkeypatch.setitem(sys.modules, "mauve", None)
    with pytest.raises(ShardlmError, match=r"need the [a-z-]+ package, which is not installed: .*shardlm\[gen\]"):
        evaluate_path(missing, [], gen=GenOptions(n=4))
    with pytest.raises(ShardlmError, match="--private applies to --push-to-hub"):
        from shardlm.cli import cmd_export, parse_args

        cmd_export(parse_args(["export", missing, str(tmp_path / "out"), "--private"]))


def test_generation_without_validation_data(hf_folder, tmp_path):
    pytest.importorskip("mauve")
    from shardlm.inference.evaluate import GenOptions, evaluate_path

    with pytest.raises(ShardlmError, match="carries no data settings: pass data.val=PATH"):
        evaluate_path(str(hf_folder), [], gen=GenOptions(n=4))
    (tmp_path / "short.txt").write_text("x" * 100)
    with pytest.raises(ShardlmError, match="--generation 4 needs 4 held-out blocks of 32 tokens, but the validation "
                                           "data holds 3: lower --generation or data.seq_len"):
        evaluate_path(str(hf_folder), [f"data.val={tmp_path / 'short.txt'}", "data.seq_len=32",
                                       f"data.cache_dir={tmp_path / 'cache'}"], gen=GenOptions(n=4))


# --- bad data files (rows 70-74): one line naming the file and the fix; earlier caches untouched ---------------

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


# ---- row 92: a config that is neither a file nor a bundled config name ----------------------------------------
@pytest.mark.parametrize("arg, message", [
    ("shakespear", "error: config 'shakespear' is neither a file nor a bundled config. Did you mean "
                   "'shakespeare_tiny'? Pass a YAML file, none, or a bundled config by name: gpt2_124m_openwebtext"),
    ("nowhere/shakespeare_tiny.yaml", "error: config file 'nowhere/shakespeare_tiny.yaml' not found. Did you mean "
                                      "the bundled 'shakespeare_tiny' (no folder)?"),
])
def test_an_unknown_config_lists_the_bundled_ones_in_one_line(tmp_path, monkeypatch, capsys, arg, message):
    from shardlm.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["train", arg, "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and err.startswith(message) and "\n" not in err, err
    assert "shakespeare_tiny (`shardlm configs` describes them)." in err and not list(tmp_path.iterdir())


# ---- rows 95-99: weighted mixtures (a list data.train) --------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["data.train=[a.txt,b.txt]", "data.weights=[1,2,3]"],
     "data.weights has 3 weights but data.train lists 2 sources: give one weight per source, or data.weights=null"),
    (["data.train=[a.txt,b.txt]", "data.weights=[1,-0.5]"],
     "data.weights[1] is -0.5: weights must be finite and >= 0 (0 = leave a source out)."),
    (["data.train=[a.txt,b.txt]", "data.weights=[0,0]"],
     "data.weights are all 0: give at least one source a positive weight."),
    (["data.train=a.txt", "data.weights=[1]"],
     "data.weights applies to a mixture, but data.train is one source ('a.txt'): give data.train a list of sources"),
    (["data.train=[]"], "data.train is an empty list: give one source, or a list of sources to mix."),
])
def test_bad_mixture_weights_fail_in_one_line(overrides, message):
    with pytest.raises(ShardlmError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_mixture_source_too_short_for_one_block_is_named(tmp_path):
    from shardlm.data import prepare_data
    from shardlm.distributed.process_group import Dist, LaunchInfo

    (tmp_path / "a.txt").write_text("plenty of text here. " * 40)
    (tmp_path / "b.txt").write_text("too short")
    cfg = load_config(None, [f"data.train=[{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}]", "data.seq_len=32",
                             f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ShardlmError) as err:
        prepare_data(cfg.data, byte_tokenizer(), Dist(LaunchInfo("single"), CPU))
    assert str(err.value).startswith("mixture source data.train[1] '") and "\n" not in str(err.value)
    assert "b.txt' has 9 tokens (less the 10% held out for validation), fewer than one block of data.seq_len=32 " \
           "+ 1. Give it more data, remove it from data.train, or use a smaller data.seq_len." in str(err.value)


# ---- issue 25: messages that pointed the wrong way --------------------------------------------------------------
def test_a_mistyped_model_path_is_named_before_the_tokenizer(tmp_path):
    """`model.name=./mymodle` blamed the tokenizer (and advised model.tokenizer=gpt2): the path comes first."""
    (tmp_path / "mymodel").mkdir()
    byte_gpt2_config().save_pretrained(tmp_path / "mymodel")
    proc = shardlm_cli(["train", "model.name=./mymodle", "out_dir=run", "data.cache_dir=cache"], check=False,
                       cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: model.name './mymodle' is a path that does not exist. Did you mean './mymodel'? Point model.name at "
        "a folder holding config.json and the weights (saved with save_pretrained or `shardlm export`), or give a "
        "hub name such as gpt2."), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mymodel"]  # nothing read or written


def test_a_model_path_that_is_a_file_or_a_folder_without_config(tmp_path):
    from shardlm.hub import check_model_path
    from shardlm.tokenizer import model_tokenizer

    byte_gpt2_config().save_pretrained(tmp_path / "m")
    (tmp_path / "empty").mkdir()
    for name, message in ((tmp_path / "m" / "config.json", "config.json' is a file, not a folder. Point model.name"),
                          (tmp_path / "empty", "empty': it is a folder without a config.json."),
                          (tmp_path / "runs" / "m", "m' is a path that does not exist. Point model.name")):
        with pytest.raises(ShardlmError, match=message):
            model_tokenizer(load_config(None, [f"model.name={name}"]).model)
    check_model_path(str(tmp_path / "m"))
    check_model_path("some-org/model")  # a hub name: the hub decides


def test_a_gpu_config_on_a_cpu_warns_once_with_what_to_change(corpus, cache_dir, tmp_path):
    from shardlm.distributed.parallelize import gpu_config_warning

    warning = gpu_config_warning(load_config("gpt2_wikitext2"), CPU)
    assert warning.startswith("warning: this config was written for a GPU (parallel.precision=bf16) and runs on a "
                              "CPU") and "set parallel.precision=fp32" in warning and "shakespeare_tiny" in warning
    assert "parallel.compile=false" in gpu_config_warning(load_config(None, ["parallel.compile=model"]), CPU)
    assert gpu_config_warning(load_config(None, []), CPU) is None
    assert gpu_config_warning(load_config("gpt2_wikitext2"), torch.device("cuda")) is None
    args = tiny(corpus, cache_dir, tmp_path / "run", **{"parallel.precision": "bf16", "train.max_steps": 1})
    proc = shardlm_cli(["train", "--nproc", "2", *args])  # bf16 trains on a CPU: a warning, not an error
    assert proc.stderr.count("warning: this config was written for a GPU") == 1, proc.stderr


def test_dry_run_fails_where_the_run_fails_validation_shorter_than_a_block(tmp_path):
    """`--dry-run` said "the config is valid" for data whose held-out tail is shorter than one block."""
    (tmp_path / "pc.txt").write_text("x" * 900)  # 901 tokens with EOS: a 91-token tail, under 128 + 1
    args = ["train", "data.train=pc.txt", "train.batch_size=2", "out_dir=run", "data.cache_dir=cache"]
    dry = shardlm_cli([*args, "--dry-run"], check=False, cwd=tmp_path)
    assert dry.returncode == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["pc.txt"]  # nothing written
    real = shardlm_cli(args, check=False, cwd=tmp_path)
    assert real.returncode == 2 and dry.stderr.strip() == real.stderr.strip().splitlines()[-1] == (
        "error: the validation data (the last 10% of 'pc.txt') has 91 tokens, fewer than one block of "
        "data.seq_len=128 + 1. Use more data or a smaller data.seq_len, or a larger data.val_fraction.")


@pytest.mark.parametrize("extra, message", [
    ({"train.batch_size": 100000}, "fewer than one global batch"),
    ({"train.gen_every": 2, "train.gen_samples": 100000}, "train.gen_samples 100000 needs 100000 held-out blocks"),
    ({"out_dir": "file/run"}, "cannot create out_dir 'file/run': '.*file' is a file"),
])
def test_dry_run_makes_the_checks_of_build(corpus, cache_dir, tmp_path, monkeypatch, extra, message):
    from shardlm.preflight.dryrun import dry_run

    if "train.gen_every" in extra:
        pytest.importorskip("mauve")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    args = tiny(corpus, cache_dir, tmp_path / "run", **{k: v for k, v in extra.items() if k != "out_dir"})
    with pytest.raises(ShardlmError, match=message):
        dry_run(load_config(None, [*args, f"out_dir={extra.get('out_dir', tmp_path / 'run')}"]), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]

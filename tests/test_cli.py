"""The command line on bad input: one line `error: ...` on stderr, exit code 2, no traceback, and a run folder
left as it was (under `--nproc` too); a finished run's rerun trains nothing. `shardlm env`. The messages are
catalogued in docs/errors.md; each subject's own cases are in its test file."""

import json

import pytest
import torch

from helpers import shardlm_cli, tiny
from shardlm.cli import cmd_env, parse_args


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


@pytest.mark.parametrize("arg, message", [
    ("shakespear", "error: config 'shakespear' is neither a file nor a bundled config. Did you mean "
                   "'shakespeare_tiny'? Pass a YAML file, none, or a bundled config by name: chat_tiny, "),
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
    assert "shakespeare_tiny, sort_tiny (`shardlm configs` describes them)." in err and not list(tmp_path.iterdir())


def test_env_names_torch_and_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLM_CACHE", str(tmp_path / "tokens"))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cmd_env(parse_args(["env"])) == 0
    text = capsys.readouterr().out
    assert f"torch:            {torch.__version__}" in text and str(tmp_path / "tokens") in text
    assert "launcher:         single, rank 0 of 1" in text and "OMP_NUM_THREADS:  3" in text
    assert cmd_env(parse_args(["env", "--json"])) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["torch"] == torch.__version__ and info["caches"]["token_cache"] == str(tmp_path / "tokens")
    assert info["devices"]["cpu_count"] >= 1 and ("cuda" in info["devices"])

"""`shardlm train --dry-run` fails where the run would fail before its first step, with the run's message, and
writes nothing."""

import pytest

from helpers import shardlm_cli, tiny
from shardlm import ShardlmError
from shardlm.config import load_config


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


def test_dry_run_of_a_finished_run_says_it_would_train_nothing(corpus, cache_dir, tmp_path):
    """The run itself says "nothing to train" when its checkpoint is at the config's last step; so does the dry
    run, instead of reporting the steps it would not train."""
    args = ["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 2})]
    shardlm_cli(args)
    assert "nothing to train" not in shardlm_cli([*args, "train.max_steps=3", "--dry-run"]).stdout  # later wins
    dry = shardlm_cli([*args, "--dry-run"]).stdout
    assert "nothing to train: the checkpoint is step 2 and this config ends at step 2" in dry, dry

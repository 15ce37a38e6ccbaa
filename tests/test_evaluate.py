"""`shardlm eval` on bad input: an export without data settings, `--generation` options checked before any
model is loaded, and too little validation data for the asked generations."""

import pytest

from shardlm import ShardlmError


def test_eval_of_an_export_needs_data(hf_folder):
    from shardlm.inference.evaluate import evaluate_path

    with pytest.raises(ShardlmError, match="carries no data settings: pass data.val=PATH"):
        evaluate_path(str(hf_folder), [])


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


def test_eval_progress_lines_end_at_the_whole(capsys):
    """Without a terminal: a line after the first batch (an early ETA), then the last one, not a stop at 53%."""
    from shardlm.inference.evaluate import EvalProgress

    progress = EvalProgress(total=193, steps=2)
    progress.update(103)
    progress.update(90)  # within every_s of the first line: not printed yet
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["eval 103/193 tokens (53.4%)", "eval 193/193 tokens (100.0%)"]

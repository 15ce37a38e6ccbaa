"""`shardlm sweep`: the search space's parsing and its one-line errors, and a tiny study end to end: trials as run
folders, one pruned from its validation records, the study kept in OUT_DIR/study.db, an interrupted trial
resumed by the next invocation, the summary table and the figures. (Each trial is a `shardlm train` process.)"""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import tiny
from shardlm import ShardlmError
from shardlm.cli import main
from shardlm.sweep.run import SweepOptions, prepare, run_sweep, trial_command
from shardlm.sweep.space import override, parse_enqueued, parse_param, parse_space

optuna = pytest.importorskip("optuna")


@pytest.mark.parametrize("text, message", [
    ("train.lrr=loguniform:1e-4:1e-2", "unknown config key 'train.lrr'. Did you mean 'train.lr'?"),
    ("train.learning_rate=loguniform:1e-4:1e-2", "Did you mean 'train.lr'?"),
    ("train.lr=logunifrom:1e-4:1e-2", "unknown distribution 'logunifrom'"),
    ("train.lr=loguniform:1e-2", "loguniform takes LOW:HIGH or LOW:HIGH:STEP, got '1e-2'"),
    ("train.lr=loguniform", "loguniform takes LOW:HIGH."),
    ("train.lr=loguniform:0:1e-2", "loguniform needs LOW > 0"),
    ("train.lr=uniform:1e-2:1e-4", "LOW (1e-2) must be below HIGH (1e-4)"),
    ("train.lr=uniform:a:1", "LOW 'a' is not a number"),
    ("train.warmup_steps=uniform:0:200", "'train.warmup_steps' is int, not a float: use int:0:200"),
    ("train.lr=int:1:3", "'train.lr' is float: use uniform or loguniform"),
    ("train.warmup_steps=int:0:2.5", "int takes whole numbers"),
    ("train.schedule=choice:", "choice needs values"),
    ("train.lr", "no '='"),
    ("out_dir=choice:a,b", "out_dir is the sweep's folder"),
])
def test_a_bad_param_is_one_line_that_names_the_fix(text, message):
    with pytest.raises(ShardlmError) as e:
        parse_param(text)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "Write KEY=KIND:ARGS" in str(e.value)


def test_param_kinds_and_enqueued_values():
    lr, warmup, schedule, batch = parse_space(["train.lr=loguniform:1e-4:1e-2", "train.warmup_steps=int:0:200:50",
                                               "train.schedule=choice:cosine,wsd", "train.batch_size=logint:4:64"])
    assert (lr.kind, lr.log, lr.low, lr.high) == ("float", True, 1e-4, 1e-2)
    assert (warmup.kind, warmup.step, schedule.choices, batch.log) == ("int", 50, ("cosine", "wsd"), True)
    assert parse_enqueued("train.lr=1e-3,train.warmup_steps=50,train.schedule=wsd,train.batch_size=8",
                          [lr, warmup, schedule, batch]) == {"train.lr": 1e-3, "train.warmup_steps": 50,
                                                              "train.schedule": "wsd", "train.batch_size": 8}
    with pytest.raises(ShardlmError, match=r"train.lr=1 is not in \[0.0001, 0.01\]"):
        parse_enqueued("train.lr=1,train.warmup_steps=0,train.schedule=wsd,train.batch_size=8",
                       [lr, warmup, schedule, batch])
    with pytest.raises(ShardlmError, match="gives no value for train.warmup_steps"):
        parse_enqueued("train.lr=1e-3", [lr, warmup])
    assert override("train.lr", 1e-3) == "train.lr=0.001" and override("model.name", None) == "model.name=null"
    with pytest.raises(ShardlmError, match="train.lr is given twice"):
        parse_space(["train.lr=uniform:0:1", "train.lr=loguniform:1e-3:1"])


def test_sweep_errors_come_first_in_one_line(corpus, cache_dir, tmp_path, capsys):
    """Bad input fails before a folder or a process is made: exit code 2, `error: ...` in one line."""
    out = tmp_path / "sweep"
    args = ["sweep", *tiny(corpus, cache_dir, out)]
    cases = [(["--param", "train.lrr=uniform:0:1"], "Did you mean 'train.lr'?"),
             ([], "needs a search space: --param KEY=KIND:ARGS"),
             (["--param", "train.grad_accum=int:0:8"], "with train.grad_accum=0 the config fails"),
             (["--param", "train.schedule=choice:cosine,wsdd"],  # a run's check, not the config's: it started
              "with train.schedule=wsdd the config fails: train.schedule='wsdd' is not one of"),
             (["--param", "train.optimizer=choice:adamw,muonn"], "with train.optimizer=muonn the config fails"),
             (["--param", "train.lr=uniform:0.1:1"], "train.lr is both a key=value override and a --param"),
             (["--param", "train.weight_decay=uniform:0:1", "--pruner", "asha"], "--pruner asha: choose one of")]
    for extra, message in cases:
        with pytest.raises(SystemExit) as e:
            main([*args, *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith("error: ") and message in err and "\n" not in err, err
        assert not out.exists()


def test_a_sweep_whose_trials_all_failed_exits_with_their_error(corpus, cache_dir, tmp_path, monkeypatch):
    """It printed "no trial completed" and exited 0 (a script went on as if it had a result)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    opts = SweepOptions(params=["train.batch_size=int:100000:100001"], trials=1, quiet=True)  # data, not settings
    with pytest.raises(ShardlmError, match=r"no trial completed: the last 1 failed, the last with: the training data "
                                           r"has [\d,]+ blocks .* fewer than one global batch"):
        run_sweep([], [o for o in tiny(corpus, cache_dir, tmp_path / "sweep") if "batch_size" not in o], opts)


def test_a_run_folder_or_a_busy_sweep_is_refused(corpus, cache_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}")
    opts = SweepOptions(params=["train.weight_decay=uniform:0:0.1"])
    with pytest.raises(ShardlmError, match="out_dir '.*run' is a training run: give the sweep a folder of its own"):
        prepare([], tiny(corpus, cache_dir, run), opts)
    from shardlm.sweep.run import _locked

    (tmp_path / "sweep").mkdir()
    with _locked(tmp_path / "sweep"), pytest.raises(ShardlmError, match="another shardlm sweep is running in"):
        run_sweep([], tiny(corpus, cache_dir, tmp_path / "sweep"), opts)


def test_trial_command_is_shardlm_train_with_the_callback(tmp_path):
    cmd = trial_command(tmp_path, 3, {"train.lr": 1e-3}, nproc=2, debug=False)
    assert cmd[1:5] == ["-m", "shardlm", "train", str(tmp_path / "base.yaml")]
    assert f"out_dir={tmp_path / 'trial_0003'}" in cmd and "train.lr=0.001" in cmd and "--nproc=2" in cmd
    assert f"--callback=shardlm.sweep.trial:SweepTrial({str(tmp_path.resolve())!r}, 3)" in cmd


def test_a_tiny_sweep_prunes_resumes_and_plots(corpus, cache_dir, tmp_path, monkeypatch, capsys):
    """Trials of 4 steps validating at step 2: a fixed good one, then a learning rate too small to learn, which the
    median pruner stops at step 2. Then a trial left running (an interrupted sweep) resumes in the next invocation,
    which stops at --trials 3 without asking for more, and draws the figures."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "sweep"
    overrides = [o for o in tiny(corpus, cache_dir, out, **{"train.max_steps": 4, "train.eval_every": 2,
                                                            "checkpoint.keep": 1})
                 if not o.startswith(("train.lr=", "train.warmup_steps="))]
    opts = SweepOptions(params=["train.lr=loguniform:1e-5:1e-2", "train.warmup_steps=int:0:2"], trials=2,
                        pruner_startup=1, quiet=True,
                        enqueue=["train.lr=3e-3,train.warmup_steps=0", "train.lr=1e-5,train.warmup_steps=2"])
    assert run_sweep([], overrides, opts) == 0
    printed = capsys.readouterr().out
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED"], printed
    assert "trial 1 pruned at step 2" in printed
    table = printed[printed.index("trial  state"):]
    assert "val loss" in table and "pruned" in table and "0*" in table and "train.warmup_steps" in table

    # the same command with another base config refuses, naming what changed
    with pytest.raises(ShardlmError, match="holds a sweep of another search .*train.max_steps 4 -> 5"):
        prepare([], [*overrides, "train.max_steps=5"], opts)

    # an interrupted sweep: a trial asked for but never told (its process was stopped) stays RUNNING
    study.enqueue_trial({"train.lr": 1e-2, "train.warmup_steps": 0})
    trial = study.ask()
    trial.suggest_float("train.lr", 1e-5, 1e-2, log=True)
    trial.suggest_int("train.warmup_steps", 0, 2)
    assert run_sweep([str(out)], [], SweepOptions(trials=3, quiet=True)) == 0
    printed = capsys.readouterr().out
    assert "trial 2 (3 of 3) resumed" in printed and "trial 2 complete" in printed, printed
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED", "COMPLETE"]
    assert study.trials[2].params == {"train.lr": 1e-2, "train.warmup_steps": 0}

    for t in study.trials:  # each trial is a run folder: its config has the trial's values, its records the loss
        run = out / f"trial_{t.number:04d}"
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["train"]["lr"] == pytest.approx(t.params["train.lr"]) and saved["out_dir"] == str(run)
        vals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "val"]
        assert {r["step"]: r["loss"] for r in vals} == pytest.approx(t.intermediate_values)
        if t.state.name == "COMPLETE":
            assert t.value == pytest.approx(vals[-1]["loss"]) and vals[-1]["step"] == 4
    assert max(study.trials[1].intermediate_values) == 2  # pruned at its first validation
    for name in ("sweep_trials", "sweep_curves", "sweep_params", "sweep_importance"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as e:  # `shardlm plot SWEEP_DIR` draws the study's figures
        main(["plot", str(out), "--out", str(tmp_path / "figures")])
    assert e.value.code == 0 and len(list((tmp_path / "figures").glob("sweep_*.png"))) == 4


def test_sweep_and_lm_eval_without_their_library_say_what_to_install(monkeypatch):
    import importlib.util

    from shardlm.inference import harness
    from shardlm.sweep.run import require_optuna

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("optuna", "lm_eval")
                        else real(name, *a))
    with pytest.raises(ShardlmError, match=r"shardlm sweep runs Optuna, which is not installed: pip install "
                                           r"'shardlm\[sweep\]'"):
        require_optuna()
    with pytest.raises(ShardlmError, match=r"lm-evaluation-harness, which is not installed: pip install "
                                           r"'shardlm\[lmeval\]'"):
        harness.require()

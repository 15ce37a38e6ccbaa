"""Callbacks: every event in order on a tiny in-process run, early stopping with `request_stop`, the caller's
signal handlers given back, and `--callback` specs (by module or file, with literal arguments; bad ones fail
with one line)."""

import json
import signal

import pytest
from faults import FAULTS, SigtermAt

from helpers import tiny
from shardlm import ShardlmError
from shardlm.callbacks import Callback, load
from shardlm.config import load_config
from shardlm.runner import train


class Recorder(Callback):
    """Records events; stops the run at the evaluation of `stop_at` (all ranks see the same global metrics)."""

    def __init__(self, stop_at: int):
        self.stop_at, self.events = stop_at, []

    def on_train_begin(self, trainer):
        self.events.append(("begin", trainer.step))

    def on_step_end(self, trainer, result):
        self.events.append(("step", trainer.step))

    def on_evaluate(self, trainer, metrics):
        self.events.append(("eval", trainer.step))
        if trainer.step == self.stop_at:
            trainer.request_stop()

    def on_checkpoint_saved(self, trainer, step, path):
        self.events.append(("saved", step, path.name))

    def on_train_end(self, trainer, summary):
        self.events.append(("end", summary["steps"]))


def test_events_in_order_early_stop_and_signal_handlers_restored(corpus, cache_dir, tmp_path):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    recorder = Recorder(stop_at=4)
    train(load_config(None, tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 10, "train.eval_every": 2,
                                                                 "checkpoint.every": 3})), callbacks=[recorder])
    assert recorder.events == [("begin", 0), ("step", 1), ("step", 2), ("eval", 2), ("step", 3),
                               ("saved", 3, "step_000000003"), ("step", 4), ("eval", 4),
                               ("saved", 4, "step_000000004"), ("end", 4)]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_callback_specs():
    assert isinstance(load("faults:SigtermAt(5)"), SigtermAt) and load("faults:SigtermAt(step=5)").step == 5
    assert load(f"{FAULTS}:NanSteps(3, 4)").steps == {3, 4}  # a file path, as tests/faults.py:NanSteps(3, 4)
    for spec, why in [("faults", "not MODULE:NAME"), ("faults:Nope", "'faults' has no 'Nope'"),
                      ("faults:SigtermAt(os.getpid())", "not Python literals"),
                      ("no_such_module:X", "no module named 'no_such_module'"),
                      ("missing.py:X", "file 'missing.py' does not exist"),
                      ("faults:FAULTS", "PosixPath has none of the methods")]:
        with pytest.raises(ShardlmError, match="^--callback") as err:
            load(spec)
        assert why in str(err.value) and "\n" not in str(err.value), spec


def test_early_stopping_waits_patience_evaluations_without_improvement():
    stopper = load("shardlm.callbacks:EarlyStopping(patience=2, min_delta=0.1)")
    stopped = []

    class Run:  # the two things EarlyStopping touches
        dist = type("D", (), {"print": staticmethod(print)})()
        request_stop = staticmethod(lambda reason=None: stopped.append(reason))

    for loss in (3.0, 2.5, 2.45, 2.6):  # 2.45 is not better by more than 0.1: the second miss stops
        stopper.on_evaluate(Run, {"loss": loss})
        assert bool(stopped) == (loss == 2.6)
    assert "not improved in 2 evaluations" in stopped[0]  # a final stop: the run does not offer a resume
    rerun = load("shardlm.callbacks:EarlyStopping(patience=2, min_delta=0.1)")
    rerun.load_state_dict(json.loads(json.dumps(stopper.state_dict())))  # as trainer_state.json keeps it
    rerun.on_train_begin(Run)  # a rerun of the stopped run stays stopped
    assert len(stopped) == 2 and rerun.best == 2.5
    rl = load("shardlm.callbacks:EarlyStopping(patience=1)")  # an online-RL run records a reward, no loss
    for reward in (0.2, 0.3, 0.25):  # higher is better: only the fall stops it
        rl.on_evaluate(Run, {"reward": reward, "exact_match": 0.1})
    assert len(stopped) == 3 and "val reward 0.3000" in stopped[-1]


def test_gen_every_records_generation_quality_during_training(corpus, cache_dir, tmp_path):
    """train.gen_every=2: a split "gen" record at steps 2 and 4 with eval --generation's numbers."""
    import json

    pytest.importorskip("mauve")
    train(load_config(None, tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 4, "train.gen_every": 2,
                                                                 "train.gen_samples": 10})))
    gen = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["split"] == "gen"]
    assert [r["step"] for r in gen] == [2, 4]
    assert all(0 < r["distinct_1"] <= 1 and 0 < r["mauve"] <= 1 + 1e-9 for r in gen)
    with pytest.raises(ShardlmError, match="train.gen_samples 100000 needs 100000 held-out blocks"):
        train(load_config(None, tiny(corpus, cache_dir, tmp_path / "b", **{"train.gen_every": 2,
                                                                          "train.gen_samples": 100000})))

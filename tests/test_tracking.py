"""Experiment tracking: W&B (offline) and MLflow (local file store) get the scalars, config and summary; a
resumed run keeps logging to the same runs; a tracker that is not installed is a one-line error."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import shardlm_cli, tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.observe.metrics import MetricsLog


def test_wandb_offline_and_mlflow_get_metrics_params_summary_and_resume(corpus, cache_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store back, as shardlm does
    out = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    args = {"train.max_steps": 4, "train.log_every": 1, "train.eval_every": 2, "log.wandb": True, "log.mlflow": True}
    shardlm_cli(["train", *tiny(corpus, cache_dir, out, **args)], env=env)

    state = json.loads((out / "tracking.json").read_text())
    wandb_runs = list((out / "wandb").glob(f"offline-run-*-{state['wandb']['id']}"))
    assert len(wandb_runs) == 1 and any(wandb_runs[0].rglob("*.wandb")), list((out / "wandb").iterdir())

    client = MlflowClient(tracking_uri=state["mlflow"]["tracking_uri"])
    run_id = state["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert state["mlflow"]["tracking_uri"] == f"sqlite:///{(out / 'mlflow.db').resolve()}"  # MLflow's default store
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(run_id, "val/loss")] == [2, 4]
    assert float(run.data.params["train.lr"]) == 3e-3 and run.data.params["train.max_steps"] == "4"
    val = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert val["split"] == "val" and run.data.metrics["final/val_loss"] == pytest.approx(val["loss"])
    assert run.data.metrics["final/steps"] == 4 and "final/val_accuracy" in run.data.metrics

    args["train.max_steps"] = 6  # resume: same out_dir, same runs
    shardlm_cli(["train", *tiny(corpus, cache_dir, out, **args)], env=env)
    again = json.loads((out / "tracking.json").read_text())
    assert again["mlflow"]["run_id"] == run_id and again["wandb"]["id"] == state["wandb"]["id"]
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert client.get_run(run_id).data.metrics["final/steps"] == 6
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.parametrize("flag", ["wandb", "mlflow"])
def test_tracker_not_installed_is_one_line_error_naming_the_extra(tmp_path, monkeypatch, flag):
    monkeypatch.setitem(sys.modules, flag, None)  # `import wandb` / `import mlflow` raises ImportError
    cfg = load_config(overrides=[f"log.{flag}=true", f"out_dir={tmp_path / 'run'}"])
    message = rf"log\.{flag}=true needs the {flag} package.*pip install shardlm\[{flag}\]"
    with pytest.raises(ShardlmError, match=message):
        MetricsLog(tmp_path / "run", False, False, cfg=cfg)  # any rank, enabled or not
    assert not (tmp_path / "run").exists()


def test_a_crashed_run_is_marked_failed_in_mlflow(tmp_path, monkeypatch):
    """What runs at interpreter exit, or in dist.shutdown under torchrun, when training raised (close() never
    ran) marks the run FAILED."""
    pytest.importorskip("mlflow")

    from mlflow.tracking import MlflowClient

    from shardlm.observe.tracking import MlflowTracker, abandon_open

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow's default store needs no switch
    cfg = load_config(overrides=["log.mlflow=true", f"out_dir={tmp_path}"])
    tracker = MlflowTracker(cfg.log, tmp_path, {"train.lr": 0.1}, "crash")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    abandon_open()  # = the atexit hook after an exception, and dist.shutdown's (os._exit skips atexit)
    assert client.get_run(tracker.run_id).info.status == "FAILED"


def test_mlflow_writes_sqlite_in_the_run_folder_and_a_file_store_run_stays_there(tmp_path):
    from shardlm.observe.tracking import mlflow_default_uri

    assert mlflow_default_uri(tmp_path, None) == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    old = (tmp_path / "mlruns").resolve().as_uri()  # a run that began before SQLite was the default
    assert mlflow_default_uri(tmp_path, old) == old

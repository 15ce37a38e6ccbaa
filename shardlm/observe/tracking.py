"""Experiment trackers (Weights & Biases, MLflow) behind one small interface, fed by `MetricsLog`.

Each tracker gets the same scalars as TensorBoard (`split/key`, step), the resolved config as flat dotted
hyperparameters, and a final summary. The run ids live in OUT_DIR/tracking.json, so a resumed run (same
out_dir) goes on logging to the same W&B run / MLflow run.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

from shardlm import ShardlmError

STATE_FILE = "tracking.json"
EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # log.<flag> (= the pip extra) -> module imported


def require(log_cfg: Any) -> None:
    """Fail with one line, before any training work, when a tracker is asked for but not installed."""
    for flag, module in EXTRAS.items():
        if getattr(log_cfg, flag, False):
            _import(flag, module)


def _import(flag: str, module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ShardlmError(f"log.{flag}=true needs the {module} package, which is not installed: "
                           f"pip install shardlm[{flag}] (or set log.{flag}=false).") from None


def read_state(out_dir: Path) -> dict:
    path = Path(out_dir) / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_state(out_dir: Path, key: str, value: dict) -> None:
    """Merge `{key: value}` into OUT_DIR/tracking.json, atomically (temp file + rename)."""
    state = read_state(out_dir)
    state[key] = value
    path = Path(out_dir) / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)


class Tracker:
    def log(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def summary(self, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class WandbTracker(Tracker):
    def __init__(self, log_cfg: Any, out_dir: Path, params: dict[str, Any], run_name: str):
        wandb = _import("wandb", "wandb")
        previous = read_state(out_dir).get("wandb", {}).get("id")
        self.run = wandb.init(project=log_cfg.project, entity=log_cfg.entity, name=run_name, dir=str(out_dir),
                              id=previous, resume="allow")
        self.run.config.update(params, allow_val_change=True)  # a resume may change e.g. train.max_steps
        write_state(out_dir, "wandb", {"id": self.run.id, "project": log_cfg.project, "entity": log_cfg.entity})

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self) -> None:
        self.run.finish()


def mlflow_default_uri(out_dir: Path, previous: str | None) -> str:
    """MLflow's own default store since 3.x, SQLite, in the run folder: `mlflow ui --backend-store-uri
    sqlite:///OUT_DIR/mlflow.db` reads it with no environment switch. A run that began on the old file store
    (OUT_DIR/mlruns, before this default) keeps logging there, so its history stays in one place."""
    if previous and previous.startswith("file:"):
        return previous
    return f"sqlite:///{Path(out_dir).resolve() / 'mlflow.db'}"


class MlflowTracker(Tracker):
    def __init__(self, log_cfg: Any, out_dir: Path, params: dict[str, Any], run_name: str):
        _import("mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        previous = read_state(out_dir).get("mlflow", {})
        uri = log_cfg.mlflow_uri or mlflow_default_uri(out_dir, previous.get("tracking_uri"))
        if uri.startswith("file:"):  # MLflow 3 refuses its (maintenance-mode) file store without this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if previous.get("run_id") and previous.get("tracking_uri") == uri:
            self.run_id = previous["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            logged = self.client.get_run(self.run_id).data.params
        else:
            experiment = self.client.get_experiment_by_name(log_cfg.project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(log_cfg.project))
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            logged = {}
        write_state(out_dir, "mlflow", {"run_id": self.run_id, "tracking_uri": uri})
        # MLflow params cannot change once logged: a resume adds new keys only (the first value is kept).
        new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        OPEN.add(self)  # a crash skips close(): the run must not stay RUNNING forever (abandon_open)

    def log(self, scalars: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(k, float(v), now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def summary(self, values: dict[str, float]) -> None:
        step = int(values.get("final/steps", 0))
        self.log(values, step)

    def close(self) -> None:
        OPEN.discard(self)
        self.client.set_terminated(self.run_id)

    def abandon(self) -> None:
        """At interpreter exit without close(): an exception or Ctrl-C ended training, so the run FAILED
        (a resume sets it RUNNING again). A SIGKILL runs nothing: such a run stays RUNNING."""
        OPEN.discard(self)
        with contextlib.suppress(Exception):  # best effort on the way out: the real error is already printed
            self.client.set_terminated(self.run_id, status="FAILED")


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}
OPEN: set[MlflowTracker] = set()  # MLflow runs started and not yet closed


@atexit.register
def abandon_open() -> None:
    """Mark every unclosed MLflow run FAILED: at interpreter exit, and from dist.shutdown, whose os._exit
    (multi-process runs) skips atexit."""
    for tracker in list(OPEN):
        tracker.abandon()


def start(cfg: Any, out_dir: Path) -> list[Tracker]:
    """The trackers `cfg.log` asks for, started (or resumed from OUT_DIR/tracking.json). Call on rank 0 only."""
    from shardlm.config import to_flat_dict

    require(cfg.log)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = to_flat_dict(cfg)
    run_name = cfg.log.run_name or out_dir.resolve().name
    trackers: list[Tracker] = []
    try:
        for flag, cls in TRACKERS.items():
            if getattr(cfg.log, flag):
                trackers.append(cls(cfg.log, out_dir, params, run_name))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers

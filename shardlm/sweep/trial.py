"""What a sweep's trial runs inside its own `shardlm train`: `SweepTrial`, a callback (shardlm.callbacks) that
reports each validation to the Optuna trial and stops the run when the study's pruner says so, and the sweep
folder's files that both sides read (the study's storage, the search's definition).

The sweep starts each trial as `shardlm train BASE out_dir=OUT/trial_NNNN KEY=VALUE ... --callback
'shardlm.sweep.trial:SweepTrial(OUT, N)'`. Rank 0 alone talks to the storage; its decision reaches every rank
through `run_on_main` (a broadcast), so every rank calls `request_stop` at the same step, as the callback
contract asks. The outcome (complete, pruned, non-finite) is written into the trial's user attributes, which
the sweep reads once the process has ended: a run interrupted by a signal leaves none, and its trial is resumed
from its checkpoint by the next `shardlm sweep`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from shardlm import ShardlmError
from shardlm.callbacks import Callback, Trainer

STUDY_DB = "study.db"
DEFINITION = "sweep.yaml"  # the search: params, metric, direction, pruner, sampler, seed
BASE = "base.yaml"  # the config every trial starts from
PRUNED = "pruned by the sweep's pruner"  # how a pruned trial's stop reason starts
MAXIMIZED = ("accuracy", "rewards/accuracy", "rewards/margin", "rewards/chosen")


def run_dir(out: Path, number: int) -> Path:
    """A trial's run folder in the sweep folder."""
    return out / f"trial_{number:04d}"


def storage_url(out: Path) -> str:
    return f"sqlite:///{(Path(out) / STUDY_DB).resolve()}"


def is_sweep(path: str | Path) -> bool:
    return (Path(path) / DEFINITION).is_file() and (Path(path) / STUDY_DB).is_file()


def read_definition(out: Path) -> dict[str, Any]:
    return yaml.safe_load((Path(out) / DEFINITION).read_text())


def make_pruner(definition: dict[str, Any]):
    import optuna

    kind, startup, warmup = definition["pruner"], definition["pruner_startup"], definition["pruner_warmup"]
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=warmup)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, warmup))
    return optuna.pruners.NopPruner()


def load_study(out: Path, pruner=None, sampler=None):
    """The sweep's study (the only one in OUT/study.db)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=None, storage=storage_url(out), pruner=pruner, sampler=sampler)


def trial_id(study, number: int) -> int:
    return next(t._trial_id for t in study.get_trials(deepcopy=False) if t.number == number)


class SweepTrial(Callback):
    """Report each validation's `metric` to trial `number` of the sweep in `out`; stop the run when pruned."""

    def __init__(self, out: str, number: int):
        self.out, self.number = Path(out), number
        self.trial: Any = None
        self.metric = ""

    def _open(self) -> None:  # rank 0, at the first validation
        import optuna

        definition = read_definition(self.out)
        self.metric = definition["metric"]
        study = load_study(self.out, pruner=make_pruner(definition))
        self.trial = optuna.trial.Trial(study, trial_id(study, self.number))

    def _decide(self, step: int, final: bool, metrics: dict[str, Any]) -> str | None:
        if self.trial is None:
            self._open()
        value = metrics.get(self.metric)
        if not isinstance(value, (int, float)):
            scalars = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
            raise ShardlmError(f"shardlm sweep --metric {self.metric}: the validation reports "
                               f"{', '.join(scalars)}; choose one of them.")
        value = float(value)
        if not math.isfinite(value):
            self.trial.set_user_attr("outcome", {"state": "fail", "step": step, "value": None,
                                                 "error": f"validation {self.metric} is {value} at step {step}"})
            return f"validation {self.metric} is {value}"
        reported = next(t for t in self.trial.study.get_trials(deepcopy=False) if t.number == self.number)
        if step not in reported.intermediate_values:
            self.trial.report(value, step)  # a resumed trial validates again at steps it has reported
        if final:
            self.trial.set_user_attr("outcome", {"state": "complete", "step": step, "value": value,
                                                 "val": _scalars(metrics)})
            return None
        if self.trial.should_prune():
            self.trial.set_user_attr("outcome", {"state": "pruned", "step": step, "value": value,
                                                 "val": _scalars(metrics)})
            return f"{PRUNED} at step {step} ({self.metric} {value:.4g})"
        return None

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        step, final = trainer.step, trainer.step >= trainer.run.total_steps
        reason = trainer.dist.run_on_main(self._decide, step, final, metrics)
        if reason:
            trainer.dist.print(f"sweep: trial {self.number} {reason}")
            trainer.request_stop(reason)


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}

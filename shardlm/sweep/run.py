"""`shardlm sweep CONFIG --param KEY=KIND:ARGS ... --trials N`: an Optuna study over config keys, each trial a
`shardlm train` run of its own (OUT_DIR/trial_NNNN), in sequence, minimizing (or maximizing) a validation metric.

The sweep folder holds the study (Optuna's RDB storage, `sqlite:///OUT_DIR/study.db`), the search (`sweep.yaml`)
and the config every trial starts from (`base.yaml`). Rerunning the command, or `shardlm sweep OUT_DIR`, goes on
where it stopped: a trial that was running when the sweep was interrupted continues from its own newest
checkpoint, with the same parameters, and new trials follow until the study holds `--trials` of them.

Each trial is a separate process (under torchrun with `--nproc`): a crashed, diverged or out-of-memory trial
is recorded as failed and the sweep goes on; its output is streamed and kept in the trial's `train.log`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shardlm import ShardlmError
from shardlm.checkpoint import layout
from shardlm.config import Config, build_config, load_config, parse_overrides, save_config, to_flat_dict
from shardlm.sweep.report import best_trial, closing, header, outcome_line, shown, table
from shardlm.sweep.space import Param, ends, override, parse_enqueued, parse_space
from shardlm.sweep.trial import (
    BASE,
    DEFINITION,
    MAXIMIZED,
    make_pruner,
    read_definition,
    run_dir,
    storage_url,
    trial_id,
)

PRUNERS = ("median", "hyperband", "none")
SAMPLERS = ("tpe", "random")
FAILURES_IN_A_ROW = 3  # then the sweep stops: the search space or the base config is wrong, not a trial
SEARCH_KEYS = ("params", "metric", "direction")  # what makes trials comparable: fixed for the study's life
HOW_DEFAULTS = {"pruner": "median", "pruner_startup": 5, "pruner_warmup": 0, "sampler": "tpe", "seed": 0,
                "trials": 20}


@dataclass
class SweepOptions:
    """The command line's options; None = the saved sweep's value (or the default, for a new sweep)."""
    params: list[str] = field(default_factory=list)
    trials: int | None = None
    nproc: int = 0
    metric: str | None = None
    direction: str | None = None
    pruner: str | None = None
    pruner_startup: int | None = None
    pruner_warmup: int | None = None
    sampler: str | None = None
    seed: int | None = None
    enqueue: list[str] = field(default_factory=list)
    quiet: bool = False
    debug: bool = False


def require_optuna() -> None:
    import importlib.util

    if importlib.util.find_spec("optuna") is None:
        raise ShardlmError("shardlm sweep runs Optuna, which is not installed: pip install 'shardlm[sweep]' (or "
                           "pip install optuna).")


# ---- the sweep's definition ---------------------------------------------------------------------------------
def _definition(opts: SweepOptions, params: list[Param], saved: dict[str, Any] | None) -> dict[str, Any]:
    base = saved or {}
    metric = opts.metric or base.get("metric") or "loss"
    definition: dict[str, Any] = {
        "params": {p.key: p.spec for p in params} if params else base.get("params", {}),
        "metric": metric,
        "direction": opts.direction or base.get("direction") or ("maximize" if metric in MAXIMIZED else "minimize"),
    }
    for key, default in HOW_DEFAULTS.items():
        given = getattr(opts, key)
        definition[key] = given if given is not None else base.get(key, default)
    if definition["pruner"] not in PRUNERS:
        raise ShardlmError(f"--pruner {definition['pruner']}: choose one of {', '.join(PRUNERS)}.")
    if definition["sampler"] not in SAMPLERS:
        raise ShardlmError(f"--sampler {definition['sampler']}: choose one of {', '.join(SAMPLERS)}.")
    if definition["trials"] < 0 or definition["pruner_startup"] < 0 or definition["pruner_warmup"] < 0:
        raise ShardlmError("--trials, --pruner-startup and --pruner-warmup take a number >= 0.")
    return definition


def _check_ends(cfg: Config, params: list[Param], nproc: int) -> None:
    """Both ends of each range and every choice make a config the run's checks that need no data pass
    (shardlm.training.checks: the schedule's and the optimizer's names, the plan, ...), before any trial starts."""
    from shardlm.training import checks

    flat = to_flat_dict(cfg)
    for p in params:
        for value in ends(p):
            try:
                trial = build_config({**flat, p.key: value})
                device, pl = checks.planned(trial, nproc or 1)
                checks.check_settings(trial, pl, device)
            except ShardlmError as e:
                raise ShardlmError(f"--param {p.key}={p.spec}: with {p.key}={value} the config fails: {e}") from None


def _changed(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k)]


def prepare(config: list[str], overrides: list[str], opts: SweepOptions) -> tuple[Path, Config, dict, bool]:
    """(sweep folder, base config, definition, new): everything checked before a file is written."""
    sweeps = [c for c in config if (Path(c) / DEFINITION).is_file()]
    if sweeps:  # `shardlm sweep OUT_DIR`: the sweep as it was defined
        if len(config) > 1 or overrides or opts.params:
            raise ShardlmError(f"'{sweeps[0]}' is a sweep: continue it with `shardlm sweep {sweeps[0]} [--trials N]` "
                               "alone, its base config and --param list fixed (base.yaml, sweep.yaml there). To change "
                               "them, start a new sweep in a new out_dir.")
        out = Path(sweeps[0])
        kept = read_definition(out)
        cfg = load_config(str(out / BASE))
        params = parse_space([f"{k}={v}" for k, v in kept["params"].items()])
        return out, cfg, _definition(opts, params, kept), False
    cfg = load_config(config, overrides)
    out = Path(cfg.out_dir)
    if not opts.params:
        raise ShardlmError("shardlm sweep needs a search space: --param KEY=KIND:ARGS, e.g. --param "
                           "train.lr=loguniform:1e-4:1e-2 --param train.warmup_steps=int:0:200 (docs/sweep.md).")
    params = parse_space(opts.params)
    fixed = set(parse_overrides(overrides))
    both = [p.key for p in params if p.key in fixed]
    if both:
        raise ShardlmError(f"{both[0]} is both a key=value override and a --param: drop one of them.")
    if (out / layout.CONFIG).is_file() or (out / layout.CHECKPOINTS).is_dir():
        raise ShardlmError(f"out_dir '{out}' is a training run: give the sweep a folder of its own, e.g. "
                           f"out_dir={out}-sweep (its trials run in OUT_DIR/trial_NNNN).")
    if out.is_file():
        raise ShardlmError(f"out_dir '{out}' is a file; give the sweep a folder.")
    _check_ends(cfg, params, opts.nproc)
    saved = read_definition(out) if (out / DEFINITION).is_file() else None
    definition = _definition(opts, params, saved)
    if saved is not None:  # the same command again: the same search, or an error that says what changed
        changed = _changed({k: saved.get(k) for k in SEARCH_KEYS}, {k: definition[k] for k in SEARCH_KEYS})
        before = {k: v for k, v in to_flat_dict(load_config(str(out / BASE))).items() if k != "out_dir"}
        changed += _changed(before, {k: v for k, v in to_flat_dict(cfg).items() if k != "out_dir"})
        if changed:
            raise ShardlmError(f"'{out}' holds a sweep of another search ({'; '.join(changed[:4])}"
                               f"{'; ...' if len(changed) > 4 else ''}): its trials would not compare. Continue it "
                               f"as it was with `shardlm sweep {out} --trials N`, or use a new out_dir.")
    return out, cfg, definition, saved is None


# ---- the loop -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(out: Path):
    """One `shardlm sweep` per folder at a time (released however the process ends)."""
    import fcntl

    with open(out / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ShardlmError(f"another shardlm sweep is running in '{out}': wait for it, or stop it (Ctrl-C "
                               "saves its trial) before starting this one.") from None
        yield


def _sampler(definition: dict[str, Any], done: int):
    import optuna

    seed = definition["seed"] + done  # a resumed sweep does not draw its first trials' values again
    if definition["sampler"] == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def run_sweep(config: list[str], overrides: list[str], opts: SweepOptions) -> int:
    import optuna
    from optuna.trial import TrialState

    out, cfg, definition, new = prepare(config, overrides, opts)
    params = parse_space([f"{k}={v}" for k, v in definition["params"].items()])
    enqueued = [parse_enqueued(text, params) for text in opts.enqueue]
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        if new:
            save_config(cfg, out / BASE)
        (out / DEFINITION).write_text(yaml.safe_dump(definition, sort_keys=False))
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(storage=storage_url(out), study_name=out.resolve().name, load_if_exists=True,
                                    direction=definition["direction"], pruner=make_pruner(definition))
        study.sampler = _sampler(definition, len(study.get_trials(deepcopy=False)))
        for values in enqueued:
            study.enqueue_trial(values, skip_if_exists=True)
        print(header(out, cfg, definition, study), flush=True)
        failures: list[str] = []
        while True:
            trials = study.get_trials(deepcopy=False)
            stale = [t for t in trials if t.state == TrialState.RUNNING]  # an interrupted sweep's trial
            if not stale and sum(t.state != TrialState.WAITING for t in trials) >= definition["trials"]:
                break
            trial = optuna.trial.Trial(study, stale[0]._trial_id) if stale else study.ask()
            values = {p.key: p.suggest(trial) for p in params}
            outcome = run_trial(out, study, trial.number, values, opts, definition, resumed=bool(stale))
            if outcome["state"] == "interrupted":
                print(f"sweep interrupted: trial {trial.number} saved its checkpoint. Rerun the same command (or "
                      f"`shardlm sweep {out}`) to go on; it continues from there.", file=sys.stderr, flush=True)
                print(table(study, params, definition), flush=True)
                return 130
            _record(study, trial.number, outcome)
            print(outcome_line(trial.number, outcome, study, definition), flush=True)
            if outcome.get("signalled"):  # the trial ended just as the signal came: the sweep stops after it
                print(f"sweep interrupted after trial {trial.number}. Rerun the same command (or `shardlm sweep "
                      f"{out}`) to go on.", file=sys.stderr, flush=True)
                print(table(study, params, definition), flush=True)
                return 130
            failures = failures + [outcome["error"]] if outcome["state"] == "fail" else []
            if len(failures) >= FAILURES_IN_A_ROW:
                print(table(study, params, definition), flush=True)
                raise ShardlmError(f"{len(failures)} trials in a row failed, the last with: {failures[-1]} Fix the "
                                   f"base config or the --param ranges (each trial's output: {out}/trial_NNNN/"
                                   "train.log); rerunning the command goes on with new trials.")
    print(table(study, params, definition), flush=True)
    if failures and best_trial(study) is None:  # a sweep that measured nothing has not succeeded
        raise ShardlmError(f"no trial completed: the last {len(failures)} failed, the last with: {failures[-1]} Fix "
                           "the base config or the --param ranges; rerunning the command goes on with new trials.")
    closing(out, study, definition)
    return 0


def _record(study, number: int, outcome: dict[str, Any]) -> None:
    import optuna
    from optuna.trial import TrialState

    trial = optuna.trial.Trial(study, trial_id(study, number))
    if outcome.get("error"):
        trial.set_user_attr("error", outcome["error"])
    if outcome["state"] == "complete":
        study.tell(number, outcome["value"])
    else:
        study.tell(number, state=TrialState.PRUNED if outcome["state"] == "pruned" else TrialState.FAIL)


def trial_command(out: Path, number: int, values: dict[str, Any], nproc: int, debug: bool) -> list[str]:
    callback = f"shardlm.sweep.trial:SweepTrial({str(out.resolve())!r}, {number})"
    return [sys.executable, "-m", "shardlm", "train", str(out / BASE), f"out_dir={run_dir(out, number)}",
            *(override(k, v) for k, v in values.items()), f"--callback={callback}",
            *([f"--nproc={nproc}"] if nproc else []), *(["--debug"] if debug else [])]


def run_trial(out: Path, study, number: int, values: dict[str, Any], opts: SweepOptions, definition: dict,
              resumed: bool = False) -> dict[str, Any]:
    """Train trial `number` in a process of its own; its outcome: complete (value), pruned, fail (error) or
    interrupted (a signal reached the sweep; the trial saved a checkpoint and stays running in the study)."""
    folder = run_dir(out, number)
    folder.mkdir(parents=True, exist_ok=True)
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    if "run_dir" not in trial.user_attrs:
        import optuna

        handle = optuna.trial.Trial(study, trial._trial_id)
        handle.set_user_attr("run_dir", folder.name)
        handle.set_user_attr("overrides", [override(k, v) for k, v in values.items()])
    total = definition["trials"]
    print(f"== trial {number} ({number + 1} of {total}){' resumed' if resumed else ''}: {shown(values)} -> {folder}",
          flush=True)
    cmd = trial_command(out, number, values, opts.nproc, opts.debug)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    received: list[int] = []
    error = ""
    with open(folder / "train.log", "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, preexec_fn=_term_with_parent)

        def forward(signum, _frame):
            """The first signal lets the trial save and stop (as `shardlm train` does on Ctrl-C); a second kills it."""
            received.append(signum)
            from shardlm.distributed.launch import descendants

            targets = [proc.pid] if len(received) == 1 else [proc.pid, *descendants(proc.pid)]
            for pid in targets:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum if len(received) == 1 else signal.SIGKILL)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if not opts.quiet:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                if "error:" in line or "unexpected failure" in line:
                    error = line.strip()
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    outcome = dict(trial.user_attrs.get("outcome") or {})
    if outcome:  # measured in the trial (a failure after its final validation does not undo it)
        return outcome | {"signalled": bool(received)}
    if received:
        return {"state": "interrupted"}
    if code == 0:  # nothing left to train (its last checkpoint was the final step): its final validation
        last = _last_val(folder)
        if last is not None and isinstance(last.get(definition["metric"]), (int, float)):
            return {"state": "complete", "value": float(last[definition["metric"]]), "step": last["step"]}
    return {"state": "fail", "error": (error or f"exit code {code}.").removeprefix("error: ")
            + f" (output: {folder / 'train.log'})"}


def _term_with_parent() -> None:
    """The trial gets SIGTERM (saves and stops) if the sweep itself is killed outright."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _last_val(folder: Path) -> dict[str, Any] | None:
    path = folder / layout.METRICS
    if not path.is_file():
        return None
    records = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split") == "val"]
    return max(records, key=lambda r: r["step"]) if records else None

"""What `shardlm sweep` prints: the study's header, a line per finished trial, the table of trials and the
closing lines (the best trial, its run folder, the plots)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from shardlm import ShardlmError
from shardlm.config import Config
from shardlm.sweep.space import Param
from shardlm.sweep.trial import run_dir, storage_url


def header(out: Path, cfg: Config, definition: dict[str, Any], study) -> str:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    done = sum(t.state.is_finished() for t in trials)
    p = definition["pruner"]
    warmup = f" from step {definition['pruner_warmup']}" if definition["pruner_warmup"] else ""
    pruner = "no pruning" if p == "none" else f"{p} pruner (once {definition['pruner_startup']} trials are complete" \
        f"{warmup})" if p == "median" else f"{p} pruner{warmup}"
    lines = [f"sweep {out}: {definition['trials']} trials ({done} done"
             + (f", {sum(t.state == TrialState.RUNNING for t in trials)} to resume" if done < len(trials) else "")
             + f"), {definition['direction']} val {definition['metric']}, {definition['sampler']} sampler (seed "
             f"{definition['seed']}), {pruner}",
             f"  params: {'  '.join(f'{k}={v}' for k, v in definition['params'].items())}",
             f"  study: {storage_url(out)} (optuna-dashboard reads it)"]
    if p != "none" and not cfg.train.eval_every:
        lines.append("  note: train.eval_every=0 validates only at the end, so no trial can be pruned; set "
                     "train.eval_every=N to stop bad trials early.")
    return "\n".join(lines)


def shown(values: dict[str, Any]) -> str:
    """`train.lr=0.000443 train.warmup_steps=2`: the values as overrides, floats to 4 digits (the trial's
    config.yaml has them whole)."""
    return " ".join(f"{k}={_fmt(v)}" for k, v in values.items())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def trial_rows(study) -> list[dict[str, Any]]:
    """One dict per trial: number, state, value (a pruned trial's: its last report), step, params, seconds."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        steps = sorted(t.intermediate_values)
        value = t.value if t.value is not None else (t.intermediate_values[steps[-1]] if steps else None)
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() \
            if t.datetime_complete and t.datetime_start else None
        rows.append({"number": t.number, "state": t.state.name.lower(), "value": value,
                     "step": (t.user_attrs.get("outcome") or {}).get("step", steps[-1] if steps else None),
                     "params": dict(t.params), "seconds": seconds, "error": t.user_attrs.get("error")})
    return rows


def table(study, params: list[Param], definition: dict[str, Any]) -> str:
    """The summary: a row per trial, the best marked with *."""
    rows = trial_rows(study)
    best = best_trial(study)
    head = ["trial", "state", f"val {definition['metric']}", "step", *(p.key for p in params), "time"]
    body = [[f"{r['number']}{'*' if best is not None and r['number'] == best.number else ''}", r["state"],
             _fmt(r["value"]), _fmt(r["step"]), *(_fmt(r["params"].get(p.key)) for p in params),
             "-" if r["seconds"] is None else f"{r['seconds']:.0f}s"] for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [head, *body]]
    return "\n".join(lines)


def best_trial(study):
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    return study.best_trial if done else None


def outcome_line(number: int, outcome: dict[str, Any], study, definition: dict[str, Any]) -> str:
    metric = f"val {definition['metric']}"
    if outcome["state"] == "complete":
        best = best_trial(study)
        return f"== trial {number} complete: {metric} {outcome['value']:.4f}" + \
            (" (best so far)" if best is not None and best.number == number else f" (best: trial {best.number}, "
             f"{best.value:.4f})" if best is not None else "")
    if outcome["state"] == "pruned":
        return f"== trial {number} pruned at step {outcome['step']} ({metric} {outcome['value']:.4f})"
    return f"== trial {number} failed: {outcome['error']}"


def closing(out: Path, study, definition: dict[str, Any]) -> None:
    best = best_trial(study)
    if best is None:
        print("no trial completed: nothing is best yet.", file=sys.stderr)
    else:
        folder = run_dir(out, best.number)
        print(f"best: trial {best.number}, val {definition['metric']} {best.value:.4f}: "
              f"{shown(best.params)}\n"
              f"  its run: {folder} (config.yaml, metrics.jsonl; shardlm export {folder} OUT)", flush=True)
    try:
        from shardlm.sweep.plot import plot_sweep

        paths = plot_sweep(out)
    except ShardlmError as e:
        print(f"no plots: {e}", file=sys.stderr)
        return
    if paths:
        print(f"plots: {', '.join(str(p) for p in paths)}", flush=True)

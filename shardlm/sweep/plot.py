"""`shardlm plot SWEEP_DIR` (and the end of every `shardlm sweep`): PNGs of a study in SWEEP_DIR/plots/.

    sweep_trials.png      the metric per trial (pruned trials at their last report) and the best so far
    sweep_curves.png      each trial's validation reports by step: where the pruner stopped the bad ones
    sweep_params.png      the metric against each parameter's value (a log axis for log-scale parameters)
    sweep_importance.png  each parameter's importance (Optuna's fANOVA evaluator), from the completed trials
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from shardlm import ShardlmError
from shardlm.sweep.space import parse_space
from shardlm.sweep.trial import is_sweep, load_study, read_definition

MIN_FOR_IMPORTANCE = 2  # completed trials


def plot_sweep(out: str | Path, folder: str | Path | None = None) -> list[Path]:
    """Write the sweep's figures; a figure the study cannot have yet is named on stderr, with the reason."""
    out = Path(out)
    if not is_sweep(out):
        raise ShardlmError(f"'{out}' is not a sweep folder (no sweep.yaml and study.db): give the out_dir of a "
                           "shardlm sweep.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState

    definition = read_definition(out)
    params = parse_space([f"{k}={v}" for k, v in definition["params"].items()])
    study = load_study(out)
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == TrialState.PRUNED and t.intermediate_values]
    metric, maximize = f"val {definition['metric']}", definition["direction"] == "maximize"
    target = Path(folder) if folder else out / "plots"
    target.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, name: str) -> None:
        path = target / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if not complete and not pruned:
        print(f"{out}: no completed or pruned trial yet, so no figures", file=sys.stderr)
        return written
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter([t.number for t in complete], [t.value for t in complete], label="complete", zorder=3)
    ax.scatter([t.number for t in pruned], [t.intermediate_values[max(t.intermediate_values)] for t in pruned],
               marker="x", color="tab:red", label="pruned (last report)", zorder=3)
    best, xs, ys = None, [], []
    for t in sorted(complete, key=lambda t: t.number):
        if best is None or (t.value > best if maximize else t.value < best):
            best = t.value
        xs.append(t.number)
        ys.append(best)
    if xs:  # the best so far runs on to the last trial
        xs, ys = [*xs, max(t.number for t in trials)], [*ys, ys[-1]]
    ax.step(xs, ys, where="post", color="tab:green", label="best so far")
    ax.set(xlabel="trial", ylabel=metric, title=f"{out.name}: {metric} per trial")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "sweep_trials.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    best_trial = study.best_trial if complete else None
    for t in trials:
        if not t.intermediate_values:
            continue
        steps = sorted(t.intermediate_values)
        is_best = best_trial is not None and t.number == best_trial.number
        style: dict[str, Any] = \
            {"color": "tab:green", "lw": 2.2, "zorder": 3, "label": f"trial {t.number} (best)"} if is_best \
            else {"color": "tab:red", "ls": "--", "alpha": 0.6} if t.state == TrialState.PRUNED \
            else {"color": "tab:blue", "alpha": 0.5}
        ax.plot(steps, [t.intermediate_values[s] for s in steps], marker=".", **style)
    ax.set(xlabel="step", ylabel=metric, title=f"{out.name}: validation by step (dashed: pruned)")
    if best_trial is not None:
        ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "sweep_curves.png")

    if complete:
        fig, axes = plt.subplots(1, len(params), figsize=(3.6 * len(params), 3.4), squeeze=False)
        for ax, p in zip(axes[0], params, strict=True):
            done = [t for t in complete if p.key in t.params]
            if p.kind == "choice":
                labels = [str(c) for c in p.choices]
                ax.scatter([labels.index(str(t.params[p.key])) for t in done], [t.value for t in done])
                ax.set_xticks(range(len(labels)), labels)
            else:
                ax.scatter([t.params[p.key] for t in done], [t.value for t in done])
                if p.log:
                    ax.set_xscale("log")
            ax.set(xlabel=p.key, ylabel=metric)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{out.name}: {metric} by parameter (completed trials)")
        save(fig, "sweep_params.png")

    if len(complete) < MIN_FOR_IMPORTANCE:
        print(f"{out}: no sweep_importance.png: parameter importance needs {MIN_FOR_IMPORTANCE} completed trials "
              f"({len(complete)} so far)", file=sys.stderr)
        return written
    import optuna

    importances = optuna.importance.get_param_importances(study)
    fig, ax = plt.subplots(figsize=(6.5, 1.6 + 0.45 * len(importances)))
    names = list(importances)[::-1]
    ax.barh(names, [importances[n] for n in names])
    for y, n in enumerate(names):
        ax.text(importances[n], y, f" {importances[n]:.2f}", va="center")
    ax.set(xlabel=f"importance for {metric} (fANOVA, sums to 1)", xlim=(0, 1.15),
           title=f"{out.name}: parameter importance ({len(complete)} completed trials)")
    save(fig, "sweep_importance.png")
    return written

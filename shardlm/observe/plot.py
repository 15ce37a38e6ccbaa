"""`shardlm plot RUN_DIR [RUN_DIR ...]`: PNGs of metrics.jsonl, several runs overlaid for comparison."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from shardlm import ShardlmError
from shardlm.checkpoint import layout
from shardlm.checkpoint.layout import metrics_file

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure  # imported when drawing: matplotlib is slow to import


class Panel(NamedTuple):
    file: str
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]  # (split, metric)
    x: str = "step"  # or "tokens": tokens trained on (val records name it tokens_seen)
    scale: float = 1.0  # record unit -> axis unit
    y: str = ""  # "zero": from 0, so that small changes do not look large; "log": log scale over a wide range


class RunData(NamedTuple):
    name: str
    device: str | None  # "cpu", "cuda" or None when the run does not tell
    records: list[dict]


GIB_PER_GB = 1e9 / 2**30  # records hold GB (1e9 bytes); `shardlm estimate` reports GiB
LOSS = (("train", "loss"), ("val", "loss"))
PANELS = (
    Panel("loss_vs_step.png", "Loss", "cross-entropy loss (nats/token)", LOSS),
    Panel("loss_vs_tokens.png", "Loss vs tokens trained on", "cross-entropy loss (nats/token)", LOSS, "tokens"),
    Panel("val_perplexity.png", "Validation perplexity", "perplexity", (("val", "ppl"),), y="log"),
    Panel("val_accuracy.png", "Validation next-token accuracy", "accuracy (%)", (("val", "accuracy"),), scale=100),
    Panel("learning_rate.png", "Learning rate", "learning rate", (("train", "lr"),)),
    Panel("grad_norm.png", "Gradient norm (before clipping)", "global L2 norm", (("train", "grad_norm"),)),
    Panel("throughput.png", "Throughput (all ranks)", "tokens/s", (("train", "tokens_per_s"),), y="zero"),
    Panel("mfu.png", "Model FLOPs utilization", "MFU (%)", (("train", "mfu"),), scale=100, y="zero"),
    Panel("memory.png", "Memory (rank 0)", "memory (GiB)", (("train", "peak_mem_gb"), ("train", "gpu_mem_used_gb")),
          scale=GIB_PER_GB, y="zero"),
    Panel("gpu_utilization.png", "GPU utilization (NVML, rank 0)", "GPU busy (%)", (("train", "gpu_util"),), y="zero"),
    Panel("expert_load.png", "Expert load, most uneven layer (mixture of experts)", "share of tokens / uniform share",
          (("train", "expert_load_min"), ("train", "expert_load_max"), ("train", "expert_load_cv")), y="zero"),
    Panel("router_aux_loss.png", "Router load-balancing loss (mixture of experts)", "auxiliary loss",
          (("train", "router_aux_loss"),)),
    Panel("generation.png", "Generation quality (held-out prompts)", "score (0 to 1)",
          tuple(("gen", m) for m in ("distinct_2", "rep_4", "self_bleu", "rouge_l", "mauve")), y="zero"),
    Panel("rewards.png", "Implicit rewards (preference pairs)", "reward (nats x beta)",
          tuple((s, f"rewards/{side}") for s in ("train", "val") for side in ("chosen", "rejected"))),
    Panel("reward_accuracy.png", "Reward accuracy (preference pairs)", "pairs with chosen reward > rejected (%)",
          (("train", "rewards/accuracy"), ("val", "rewards/accuracy")), scale=100, y="zero"),
    Panel("logps.png", "Answer log-probabilities (preference pairs)", "log-probability per answer (nats)",
          tuple((s, f"logps/{side}") for s in ("train", "val") for side in ("chosen", "rejected"))),
    Panel("rl_reward.png", "Reward (online RL): sampled, and held-out greedy exact match", "reward; exact match",
          (("train", "reward"), ("val", "reward"), ("val", "exact_match"))),
    Panel("rl_shares.png", "Groups and tokens (online RL)", "share (%)",
          (("train", "frac_reward_zero_std"), ("train", "completions/clipped_ratio"),
           ("train", "clip_ratio/region_mean")), scale=100, y="zero"),
    Panel("rl_completion_length.png", "Completion length (online RL)", "tokens",
          tuple(("train", f"completions/{m}") for m in ("mean_length", "min_length", "max_length",
                                                           "mean_terminated_length")), y="zero"),
    Panel("rl_entropy.png", "Policy entropy over the completions' tokens (online RL)", "entropy (nats)",
          (("train", "entropy"),), y="zero"),
    Panel("rl_kl.png", "KL to the initial model (online RL, grpo.beta > 0)", "KL (k3, nats/token)",
          (("train", "kl"),), y="zero"),
    Panel("distill_loss.png", "Distillation: divergence to the teacher, the student's next-token loss",
          "nats/token", tuple((s, f"distill/{m}") for s in ("train", "val") for m in ("loss", "nll")), y="zero"),
    Panel("distill_entropy.png", "Distillation: entropy at the temperature", "entropy (nats/token)",
          tuple((s, f"distill/{m}_entropy") for s in ("train", "val") for m in ("teacher", "student")), y="zero"),
)
MOE_PANELS = ("expert_load.png", "router_aux_loss.png")
PAIR_PANELS = ("rewards.png", "reward_accuracy.png", "logps.png")
DISTILL_PANELS = ("distill_loss.png", "distill_entropy.png")
RL_PANELS = ("rl_reward.png", "rl_shares.png", "rl_completion_length.png", "rl_entropy.png", "rl_kl.png",
             "rl_rewards_by_function.png")
TOKEN_METRICS = ("ppl", "accuracy")  # of text and examples; a pair record's (chosen answers' ppl, rewards') are not
STYLES = ("-", "--", ":", "-.", (0, (3, 1, 1, 1, 1, 1)))  # one per series of a panel
PEAK_MEM = {"cpu": "peak RSS of the process (CPU)", "cuda": "peak allocated by PyTorch (CUDA)",
            None: "peak memory (process RSS on CPU, allocated on GPU)"}
METRIC_NAMES = {"gpu_mem_used_gb": "GPU memory used (NVML)", "ppl": "perplexity", "lr": "learning rate",
                "grad_norm": "grad norm", "tokens_per_s": "tokens/s", "mfu": "MFU", "gpu_util": "GPU utilization",
                "distinct_2": "distinct-2", "rep_4": "rep-4 (repetition)", "self_bleu": "self-BLEU",
                "rouge_l": "ROUGE-L", "mauve": "MAUVE", "expert_load_min": "least-loaded expert",
                "expert_load_max": "most-loaded expert", "expert_load_cv": "coefficient of variation",
                "router_aux_loss": "aux loss", "rewards/chosen": "chosen", "rewards/rejected": "rejected",
                "rewards/accuracy": "reward accuracy", "logps/chosen": "chosen", "logps/rejected": "rejected",
                "frac_reward_zero_std": "groups with equal rewards", "completions/clipped_ratio": "cut at max length",
                "clip_ratio/region_mean": "tokens with a clipped ratio", "exact_match": "greedy exact match",
                "completions/mean_terminated_length": "mean of those that ended", "distill/loss": "divergence",
                "distill/nll": "next-token loss", "distill/teacher_entropy": "teacher",
                "distill/student_entropy": "student"}


def metric_name(metric: str) -> str:
    """A record key as a legend names it: `rewards/NAME/mean` (online RL's per function) is NAME."""
    if metric.startswith("rewards/") and metric.endswith("/mean"):
        return metric.removeprefix("rewards/").removesuffix("/mean")
    return METRIC_NAMES.get(metric, metric.removeprefix("completions/").replace("_", " "))


def reward_functions_panel(runs: list[RunData]) -> Panel:
    """Online RL's reward per function (their names come from the records), up to as many as there are styles."""
    names = dict.fromkeys(k for run in runs for r in run.records if r.get("split") == "train" for k in r
                          if k.startswith("rewards/") and k.endswith("/mean"))
    return Panel("rl_rewards_by_function.png", "Reward per function (online RL, train)", "mean reward",
                 tuple(("train", k) for k in list(names)[:len(STYLES)]))


def read_metrics(run: Path) -> list[dict]:
    path = metrics_file(run)
    if not path.is_file():
        raise ShardlmError(f"'{run}' has no metrics.jsonl: give a run dir (the out_dir of a training run).")
    by_key = {}  # a resumed run may repeat steps: the last record wins
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
        by_key[(r.get("split"), r.get("step"))] = r
    return sorted(by_key.values(), key=lambda r: (r.get("split", ""), r.get("step", 0)))


def run_device(run: Path, records: list[dict]) -> str | None:
    """Train records name their device; older runs: NVML fields and MFU are only logged on CUDA, else
    the config's parallel.device when it is not `auto`."""
    if (named := next((r["device"] for r in records if r.get("device") in ("cpu", "cuda")), None)):
        return named
    if any("gpu_util" in r or "gpu_mem_used_gb" in r or r.get("mfu") is not None for r in records):
        return "cuda"
    import yaml

    try:
        device = yaml.safe_load((run / layout.CONFIG).read_text())["parallel"]["device"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return device if device in ("cpu", "cuda") else None


def run_names(runs: list[Path]) -> list[str]:
    """Each run's shortest trailing path that no other run ends with: a/seed1 and b/seed1 stay distinct."""
    names = []
    for p in (run.parts for run in runs):
        n = 1
        while n < len(p) and sum(run.parts[-n:] == p[-n:] for run in runs) > 1:
            n += 1
        names.append(str(Path(*p[-n:])))
    return names


def load_runs(runs: list[str]) -> list[RunData]:
    unique = {Path(r).resolve(): Path(r) for r in runs}  # the same dir twice is plotted once
    records = [read_metrics(run) for run in unique.values()]
    names = run_names(list(unique))
    return [RunData(n, run_device(r, recs), recs) for n, r, recs in zip(names, unique.values(), records, strict=True)]


def compact(value: float, _pos: object = None) -> str:
    """Plain tick labels: 8, 12, 0.5, 5e-5, 1.5k, 2M."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:g}{suffix}"
    return f"{value:g}".replace("e-0", "e-")


def log_axis(ax: Axes, ys: list[float]) -> None:
    """Log scale only over a wide range (over a narrow one it looks linear but would get no labelled tick)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ratio = max(ys) / min(ys) if min(ys) > 0 else 0
    if ratio < 3:
        return
    ax.set_yscale("log")  # resets the formatters
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 3, 5) if ratio < 30 else (1, 3) if ratio < 1e4 else (1,)))
    ax.yaxis.set_major_formatter(FuncFormatter(compact))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel(f"{ax.get_ylabel()} (log scale)")


def series_points(records: list[dict], split: str, metric: str, xkey: str) -> list[tuple[float, float]]:
    xkey = "tokens_seen" if split == "val" and xkey == "tokens" else xkey
    pts = [(r.get(xkey), r.get(metric)) for r in records if r.get("split") == split
           and not (metric in TOKEN_METRICS and "pairs" in r)]
    return [(x, y) for x, y in pts if x is not None and y is not None]


def plot_series(ax: Axes, panel: Panel, runs: list[RunData]) -> list[float]:
    """Draws each run's series of the panel; returns all the y values drawn."""
    ys_all: list[float] = []
    for i, run in enumerate(runs):
        for j, (split, metric) in enumerate(panel.series):
            pts = series_points(run.records, split, metric, panel.x)
            if not pts:
                continue
            xs, raw = zip(*pts, strict=True)
            ys = [y * panel.scale for y in raw]
            what = PEAK_MEM[run.device] if metric == "peak_mem_gb" else metric_name(metric)
            label = f"{split} {what}" if any(s == "val" for s, _ in panel.series) else what
            ax.plot(xs, ys, linestyle=STYLES[j], color=f"C{i if len(runs) > 1 else j}", markersize=4,
                    marker="o" if split == "val" or len(xs) < 10 else None,  # a line through 1 point is invisible
                    label=f"{run.name}: {label}" if len(runs) > 1 else label)
            ys_all += ys
    return ys_all


def draw(panel: Panel, runs: list[RunData]) -> Figure | None:
    """The panel's figure, or None when no run has its metrics."""
    from matplotlib.figure import Figure  # no pyplot: no backend to pick, no figure to close
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(8, 4.5), dpi=110, layout="constrained")
    ax = fig.subplots()
    ys = plot_series(ax, panel, runs)
    if not ys:
        return None
    ax.set(title=panel.title, xlabel="tokens trained on" if panel.x == "tokens" else "optimizer step",
           ylabel=panel.ylabel)
    for axis in (ax.xaxis, ax.yaxis):  # 0.0003, 2.5, 1.5k, 40M: no offset text, no "×10⁰" (log scale)
        axis.set_major_formatter(FuncFormatter(compact))
    if panel.y == "log":
        log_axis(ax, ys)
    elif panel.y == "zero":
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)  # below the axes: never on data
    return fig


def _trained_on(runs: list[RunData]) -> str:
    devices = sorted({(r.device or "an unrecorded device").replace("cpu", "CPU").replace("cuda", "CUDA")
                      for r in runs})
    return f"{'this run' if len(runs) == 1 else 'these runs'} trained on {' and '.join(devices)}"


def why_missing(panel: Panel, runs: list[RunData]) -> str:
    """Why no run has the panel's metrics: a figure the README lists is never left out without a word."""
    why = {"mfu.png": "MFU needs the device's peak FLOP/s, which shardlm knows for the GPUs of its table and for "
                      f"TPUs, not for CPUs ({_trained_on(runs)})",
           "gpu_utilization.png": "GPU utilization is read from NVML on CUDA GPUs, with pip install shardlm[gpu] "
                                  f"({_trained_on(runs)})",
           "generation.png": "no generation-quality records: train.gen_every=N or shardlm eval RUN --generation N "
                             "writes them",
           "val_perplexity.png": "no validation records yet (train.eval_every, and one at the end)",
           "val_accuracy.png": "no validation records yet (train.eval_every, and one at the end)"}
    if panel.file in ("val_perplexity.png", "val_accuracy.png") and any(
            "pairs" in r for run in runs for r in run.records):
        return (f"no {panel.file}: a preference run's validation scores pairs, not next tokens (rewards.png and "
                "reward_accuracy.png draw them)")
    if panel.file in ("val_perplexity.png", "val_accuracy.png") and any(
            "reward" in r for run in runs for r in run.records if r.get("split") == "val"):
        return (f"no {panel.file}: an online RL run's validation samples completions of prompts (rl_reward.png "
                "draws its reward and exact match)")
    metrics = ", ".join(f"{split} {metric}" for split, metric in panel.series)
    return f"no {panel.file}: " + why.get(panel.file, f"no run has {metrics} records")


def plot_runs(runs: list[str], out: str | None = None,
              log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> list[Path]:
    """The PNGs written; `log` says which of PANELS could not be drawn and why (stderr: stdout lists the files)."""
    data = load_runs(runs)
    empty = [d.name for d in data if not d.records]
    if empty:
        raise ShardlmError(f"no metrics records in {', '.join(empty)} (metrics.jsonl is empty): nothing to plot. "
                           "A run writes one every train.log_every steps.")
    out_dir = Path(out) if out else Path(runs[0]) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for panel in (*PANELS, reward_functions_panel(data)):
        if (fig := draw(panel, data)) is not None:
            fig.savefig(out_dir / panel.file)
            written.append(out_dir / panel.file)
        elif panel.file not in MOE_PANELS + PAIR_PANELS + RL_PANELS + DISTILL_PANELS:  # a run without: nothing to say
            log(why_missing(panel, data))
    return written

"""`shardlm plot RUN_DIR [RUN_DIR ...]`: PNGs of metrics.jsonl, several runs overlaid for comparison."""

from __future__ import annotations

import json
from pathlib import Path

from shardlm import ShardlmError

# (file name, title, y label, [(split, metric)], x key, log y)
PANELS = [
    ("loss_vs_step.png", "Loss", "loss", [("train", "loss"), ("val", "loss")], "step", False),
    ("loss_vs_tokens.png", "Loss vs tokens", "loss", [("train", "loss"), ("val", "loss")], "tokens", False),
    ("val_perplexity.png", "Validation perplexity", "perplexity", [("val", "ppl")], "step", True),
    ("val_accuracy.png", "Validation next-token accuracy", "accuracy", [("val", "accuracy")], "step", False),
    ("learning_rate.png", "Learning rate", "lr", [("train", "lr")], "step", False),
    ("throughput.png", "Throughput", "tokens/s", [("train", "tokens_per_s")], "step", False),
    ("memory.png", "Peak memory", "GB", [("train", "peak_mem_gb"), ("train", "gpu_mem_used_gb")], "step", False),
    ("gpu_utilization.png", "GPU utilization (NVML)", "%", [("train", "gpu_util")], "step", False),
]


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ShardlmError(f"'{run}' has no metrics.jsonl: give a run dir (the out_dir of a training run).")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    by_key = {}
    for r in records:  # a resumed run may repeat steps: the last record wins
        by_key[(r.get("split"), r.get("step"))] = r
    return sorted(by_key.values(), key=lambda r: (r.get("split", ""), r.get("step", 0)))


def plot_runs(runs: list[str], out: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {str(Path(r)): read_metrics(Path(r)) for r in runs}
    out_dir = Path(out) if out else Path(runs[0]) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, title, ylabel, series, xkey, logy in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        drawn = 0
        for run, records in data.items():
            label_run = Path(run).name if len(data) > 1 else ""
            for split, metric in series:
                pts = [(r.get(xkey if split == "train" or xkey == "step" else "tokens_seen"), r.get(metric))
                       for r in records if r.get("split") == split]
                pts = [(x, y) for x, y in pts if x is not None and y is not None]
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                style = "-" if split == "train" else "o-"
                ax.plot(xs, ys, style, markersize=3, label=" ".join(filter(None, [label_run, split, metric])))
                drawn += 1
        if not drawn:
            plt.close(fig)
            continue
        ax.set(title=title, xlabel="tokens" if xkey == "tokens" else "step", ylabel=ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written

"""`shardlm plot`: what the figures show, checked on the matplotlib artists (PNG smoke test: test_errors.py)."""

import json
from pathlib import Path

import pytest

from shardlm.plot import PANELS, draw, load_runs, plot_runs

PANEL = {p.file: p for p in PANELS}


def write_run(folder: Path, records: list[dict], device: str | None = None) -> str:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if device:
        (folder / "config.yaml").write_text(f"parallel:\n  device: {device}\n")
    return str(folder)


def train(step: int, **extra) -> dict:
    return {"step": step, "split": "train", "loss": 3.0, "lr": 1e-3, "tokens": 100 * step, "tokens_per_s": 500.0,
            "peak_mem_gb": 2**30 / 1e9, **extra}


def val(step: int, ppl: float) -> dict:
    return {"step": step, "split": "val", "loss": 2.0, "ppl": ppl, "accuracy": 0.3, "tokens": 64,
            "tokens_seen": 100 * step}


def test_single_record_run_is_drawn_with_markers(tmp_path):
    run = write_run(tmp_path / "one", [train(5), val(5, 7.0)])
    fig = draw(PANEL["loss_vs_tokens.png"], load_runs([run]))
    lines = fig.axes[0].get_lines()
    assert [(ln.get_label(), list(ln.get_xdata())) for ln in lines] == [("train loss", [500]), ("val loss", [500])]
    assert all(line.get_marker() not in (None, "None", "") for line in lines)
    assert [p.name for p in plot_runs([run], str(tmp_path / "out"))][:2] == ["loss_vs_step.png", "loss_vs_tokens.png"]


@pytest.mark.parametrize("ppls, log", [([9.0, 7.1, 5.2], False), ([3000.0, 120.0, 3.0], True)])
def test_perplexity_ticks_are_plain_numbers(tmp_path, ppls, log):
    run = write_run(tmp_path / "r", [val(s, p) for s, p in zip((1, 2, 3), ppls, strict=True)])
    ax = draw(PANEL["val_perplexity.png"], load_runs([run])).axes[0]
    ax.figure.draw_without_rendering()  # computes the tick labels
    labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    assert len(labels) >= 3 and not any(c in "".join(labels) for c in ("×", "times", "^", "e+"))
    assert (ax.get_yscale() == "log") == log


def test_memory_in_gib_says_what_each_run_measures(tmp_path):
    cpu = write_run(tmp_path / "cpu" / "run", [train(1), train(2)], device="cpu")
    cuda = write_run(tmp_path / "cuda" / "run", [train(1, gpu_util=50.0, gpu_mem_used_gb=2 * 2**30 / 1e9)])
    unknown = write_run(tmp_path / "other", [train(1)], device="auto")
    ax = draw(PANEL["memory.png"], load_runs([cpu, cuda, unknown])).axes[0]
    assert "GiB" in ax.get_ylabel()
    assert {ln.get_label(): [round(y, 6) for y in ln.get_ydata()] for ln in ax.get_lines()} == {
        "cpu/run: peak RSS of the process (CPU)": [1.0, 1.0],
        "cuda/run: peak allocated by PyTorch (CUDA)": [1.0],
        "cuda/run: GPU memory used (NVML)": [2.0],
        "other: peak memory (process RSS on CPU, allocated on GPU)": [1.0]}

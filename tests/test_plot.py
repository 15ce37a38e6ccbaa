"""`shardlm plot`: what the figures show, checked on the matplotlib artists and a PNG smoke test."""

import json
from pathlib import Path

import pytest

from shardlm import ShardlmError
from shardlm.observe.plot import PANELS, draw, load_runs, plot_runs

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


def test_plot_says_which_figures_a_cpu_run_cannot_have(tmp_path, capsys):
    run = write_run(tmp_path / "cpu", [train(1, device="cpu", mfu=None, grad_norm=0.5), val(1, 7.0)])
    assert "mfu.png" not in {p.name for p in plot_runs([run])}
    assert capsys.readouterr().err.splitlines() == [
        "no mfu.png: MFU needs the device's peak FLOP/s, which shardlm knows for the GPUs of its table and for TPUs, "
        "not for CPUs (this run trained on CPU)",
        "no gpu_utilization.png: GPU utilization is read from NVML on CUDA GPUs, with pip install shardlm[gpu] "
        "(this run trained on CPU)",
        "no generation.png: no generation-quality records: train.gen_every=N or shardlm eval RUN --generation N "
        "writes them"]


def test_plot_writes_pngs_and_overlays_runs(tmp_path):
    for name, scale in (("a", 1.0), ("b", 0.9)):
        run = tmp_path / name
        run.mkdir()
        lines = [{"step": s, "split": "train", "loss": scale * 5 / s, "lr": 1e-3, "tokens": s * 100,
                  "tokens_per_s": 1000.0, "peak_mem_gb": 1.0} for s in range(1, 11)]
        lines += [{"step": 10, "split": "val", "loss": 1.0, "ppl": 2.7, "accuracy": 0.3, "tokens_seen": 1000}]
        (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    paths = plot_runs([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "plots"))
    assert {p.name for p in paths} >= {"loss_vs_step.png", "loss_vs_tokens.png", "val_perplexity.png",
                                       "learning_rate.png", "throughput.png", "memory.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    with pytest.raises(ShardlmError, match="no metrics.jsonl"):
        plot_runs([str(tmp_path)])
    (tmp_path / "a" / "metrics.jsonl").write_text("")
    with pytest.raises(ShardlmError, match="no metrics records in a .*nothing to plot"):
        plot_runs([str(tmp_path / "a")])
    assert not (tmp_path / "a" / "plots").exists()


def test_a_preference_run_gets_its_rewards_drawn_not_a_perplexity_of_its_pairs(tmp_path, capsys):
    """A pair record's `ppl` (the chosen answers') and `accuracy` (the rewards') are not next-token metrics."""
    stats = {"rewards/chosen": 0.1, "rewards/rejected": -0.2, "rewards/accuracy": 0.75, "rewards/margin": 0.3,
             "logps/chosen": -20.0, "logps/rejected": -25.0}
    pair_val = {**val(2, 18902.6), "pairs": 4, **stats}
    run = write_run(tmp_path / "dpo", [train(1, **stats), train(2, **stats), pair_val])
    written = {p.name for p in plot_runs([run])}
    assert {"rewards.png", "reward_accuracy.png", "logps.png"} <= written
    assert not {"val_perplexity.png", "val_accuracy.png"} & written
    err = capsys.readouterr().err
    assert "no val_perplexity.png: a preference run's validation scores pairs, not next tokens" in err
    lines = draw(PANEL["reward_accuracy.png"], load_runs([run])).axes[0].get_lines()
    assert [(line.get_label(), list(line.get_ydata())) for line in lines] == [
        ("train reward accuracy", [75.0, 75.0]), ("val reward accuracy", [75.0])]
    sft = write_run(tmp_path / "sft", [train(1, device="cpu"), val(1, 7.0)])
    plot_runs([sft])
    assert "rewards" not in capsys.readouterr().err  # an sft run has no pairs: nothing missing to explain


"""`shardlm tune`: batch search under a budget that keeps the config's global batch, a table, and a YAML file
`shardlm train CONFIG tuned.yaml` accepts."""

import re

import pytest
import yaml

import shardlm.preflight.tune
from helpers import shardlm_cli, tiny
from shardlm.config import load_config, save_config
from shardlm.preflight.tune import report, tune
from shardlm.training.checks import count_steps

ROW = re.compile(r"^full\s+(\w+)\s+(\d+)\s+\S+\s+\S+\s+(>=\d+ \(cap\)|\d+)\s+(\d+) x (\d+)\s")


def table_rows(table: str) -> dict[tuple[str, str], tuple[str, int, int]]:
    """(AC, loss chunk) -> (max micro, micro-batch, grad_accum) of the rows of a full-sharding table."""
    matches = [ROW.match(line) for line in table.splitlines()]
    return {m.group(1, 2): (m[3], int(m[4]), int(m[5])) for m in matches if m}


def test_tune_keeps_the_global_batch_and_marks_a_capped_search(corpus, cache_dir, tmp_path):
    user = tmp_path / "config.yaml"  # per rank: 4 x 2 = 8 blocks; steps from epochs, so from the global batch
    save_config(load_config([], tiny(corpus, cache_dir, tmp_path / "run", **{
        "model.tokenizer": "gpt2", "data.seq_len": 32, "train.batch_size": 4, "train.grad_accum": 2,
        "train.max_steps": "null", "train.epochs": 1})), user)
    out = tmp_path / "tuned.yaml"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("precious")
    proc = shardlm_cli(["tune", str(user), "--budget-gb", "0.1", "--steps", "1", "--max-batch", "16",
                        "--out", str(out)], timeout=600, cwd=tmp_path)
    # trials write into a scratch folder: neither the run's out_dir nor ./runs/default is touched
    assert (tmp_path / "run" / "config.yaml").read_text() == "precious"
    assert not (tmp_path / "runs").exists()
    table = proc.stdout
    assert "global batch kept: 1 rank x 8 blocks = 8 blocks per optimizer step (as in your config)" in table
    assert "the search stopped at the per-rank batch (8)" in table and "best:" in table
    rows = table_rows(table)
    assert rows[("none", "1024")] == (">=8 (cap)", 8, 1)  # the chunked loss fits the whole per-rank batch
    fit, micro, accum = rows[("none", "0")]  # the full-logits loss does not: micro-batches are accumulated
    assert micro <= int(fit) < 8 and micro * accum == 8 and accum > 1

    tuned = yaml.safe_load(out.read_text())
    assert tuned["train"]["batch_size"] * tuned["train"]["grad_accum"] == 8
    assert {"sharding", "activation_checkpointing", "precision", "cpu_offload"} <= set(tuned["parallel"])
    alone, both = load_config(user), load_config([user, out])  # as `shardlm train CONFIG tuned.yaml` reads them
    assert both.train.batch_size * both.train.grad_accum == alone.train.batch_size * alone.train.grad_accum
    blocks = range(567)  # count_steps reads only the number of training blocks
    assert count_steps(both, blocks, 1) == count_steps(alone, blocks, 1) == 567 // 8


@pytest.mark.parametrize(("max_batch", "chosen", "capped"), [(256, (6, 2), False), (4, (4, 3), True)])
def test_search_stays_within_the_per_rank_batch(corpus, cache_dir, tmp_path, monkeypatch, max_batch, chosen,
                                                capped):
    """The user's report: batch_size 12 came back as 256. Trials are faked: a micro-batch fits up to 8 blocks
    with the chunked loss, up to 5 without; tokens/s grow with the micro-batch."""
    tried = []

    def fake_trial(cfg, steps, budget):
        t = cfg.train
        tried.append((t.batch_size, t.grad_accum))
        ok = t.batch_size <= (8 if t.loss_chunk_size else 5)
        return ok, t.batch_size / 100, 1000.0 * t.batch_size * ok

    monkeypatch.setattr(shardlm.preflight.tune, "run_trial", fake_trial)
    cfg = load_config([], tiny(corpus, cache_dir, tmp_path / "run", **{"train.batch_size": 12}))
    table = report(tune(cfg, 1.0, 1, max_batch), tmp_path / "tuned.yaml")
    assert max(batch for batch, _ in tried) == min(max_batch, 12)  # never above the per-rank batch
    assert chosen in tried  # tokens/s and peak of the best come from a trial of exactly what is written
    tuned = yaml.safe_load((tmp_path / "tuned.yaml").read_text())["train"]
    assert (tuned["batch_size"], tuned["grad_accum"]) == chosen
    assert table_rows(table)[("none", "1024")] == (">=4 (cap)" if capped else "8", *chosen)
    assert ("--max-batch (4), below the per-rank batch (12)" in table) == capped


def test_tune_splits_the_blocks_when_no_setting_fits_the_per_rank_batch(corpus, cache_dir, tmp_path, monkeypatch):
    """On 2 ranks, trials faked: without tensor parallelism a micro-batch fits up to 3 blocks (the per-rank batch is
    12); split over 2 ranks, which then read 24 blocks together, 24 fit. Tune tries the split only then, keeps the
    global batch (2 x 12 = 1 x 24) and writes it."""
    import shardlm.distributed.process_group as process_group

    def fake_trial(cfg, steps, budget):
        t, split = cfg.train, cfg.parallel.tensor
        ok = t.batch_size <= (24 if split == 2 else 3) and cfg.parallel.activation_checkpointing == "none"
        return ok, t.batch_size / 100, 1000.0 * t.batch_size * ok

    monkeypatch.setattr(shardlm.preflight.tune, "run_trial", fake_trial)
    two_ranks = process_group.LaunchInfo("torchrun", 0, 2, 0, 2)
    monkeypatch.setattr(process_group, "detect_launch", lambda launcher: two_ranks)
    cfg = load_config([], tiny(corpus, cache_dir, tmp_path / "run", **{"train.batch_size": 12,
                                                                       "model.arch": "llama"}))
    points = tune(cfg, 1.0, 1, 256)
    assert {p.tensor for p in points} == {1, 2} and all(p.tensor == 1 for p in points[:-3])
    table = report(points, tmp_path / "tuned.yaml")
    assert "full+tp2" in table and "N times the blocks per rank" in table
    tuned = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    assert tuned["parallel"]["tensor"] == 2 and (tuned["train"]["batch_size"], tuned["train"]["grad_accum"]) == (24, 1)

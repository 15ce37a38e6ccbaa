"""Runs written before the package moved into subpackages still resume, bit for bit. tests/data/main-edda001
holds what shardlm at commit edda001 (the flat layout) wrote: the step-4 checkpoint of a 6-step run of a
1-layer byte-level GPT, the run's config.yaml, and the losses that run logged uninterrupted."""

import json
import shutil

from helpers import ROOT, records, shardlm_cli

OLD = ROOT / "tests" / "data" / "main-edda001"
OVERRIDES = {"model.n_layer": 1, "model.n_embd": 16, "model.n_head": 2, "model.n_positions": 16, "data.seq_len": 16,
             "train.batch_size": 4, "train.warmup_steps": 2, "train.lr": 3e-3, "train.log_every": 1,
             "train.eval_every": 0, "train.eval_batches": 2, "train.sample_tokens": 0, "log.tensorboard": False,
             "log.progress": "lines", "parallel.device": "cpu", "parallel.compile": "false", "checkpoint.every": 4,
             "checkpoint.keep": 2, "model.dropout": 0.0, "train.max_steps": 6}


def test_a_checkpoint_of_the_flat_layout_resumes_exactly(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(OLD / "run", run)
    args = {**OVERRIDES, "data.train": OLD / "corpus.txt", "data.cache_dir": tmp_path / "cache", "out_dir": run}
    out = shardlm_cli(["train", *(f"{k}={v}" for k, v in args.items())]).stdout
    assert "resumed from" in out and "step 4" in out, out
    uninterrupted = {int(k): v for k, v in json.loads((OLD / "uninterrupted_losses.json").read_text()).items()}
    assert {r["step"]: r["loss"] for r in records(run)} == {s: uninterrupted[s] for s in (5, 6)}

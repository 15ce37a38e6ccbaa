"""End-to-end training: FSDP parity with one process, accumulation, evaluation, tied weights."""

import math
import subprocess

import pytest
import torch

from helpers import ROOT, fp32_tol, python_cmd, records, shardlm_cli, tiny
from shardlm.config import load_config
from shardlm.training.trainer import Trainer


@pytest.fixture(scope="module")
def single_run(corpus, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    shardlm_cli(["train", *tiny(corpus, cache_dir, out, **{"train.batch_size": 8})])
    return records(out)


@pytest.mark.parametrize("sharding, nproc, extra", [
    ("full", 2, {"parallel.wrap": "block"}),  # a unit per block, each prefetching the next (auto: one of both)
    ("grad_op", 2, {}),
    ("no_shard", 2, {}),
    ("hybrid_full", 4, {"parallel.shard_size": 2}),
    ("full", 2, {"parallel.compile": "model"}),  # each block compiled in its FSDP unit, the loss compiled
])
def test_fsdp_matches_single_process(single_run, corpus, cache_dir, tmp_path, sharding, nproc, extra):
    batch = 8 // nproc
    shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.batch_size": batch,
                                                                 "parallel.sharding": sharding, **extra})],
                nproc=nproc)
    got = records(tmp_path)
    assert len(got) == len(single_run) == 10
    for a, b in zip(got, single_run, strict=True):  # the norm is summed over shards, not over replicas
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-4)
    assert got[-1]["loss"] < got[0]["loss"]


def _trainer(corpus, cache_dir, out, **extra) -> Trainer:
    return Trainer.from_config(load_config(None, tiny(corpus, cache_dir, out, **extra)))


def _step_losses(trainer: Trainer, steps: int) -> list[float]:
    tokens = trainer.global_batch * trainer.seq_len
    return [trainer.train_step()["loss_sum"].item() / tokens for _ in range(steps)]


@pytest.mark.cuda
def test_grad_accumulation_equals_big_batch(corpus, cache_dir, tmp_path):
    big = _step_losses(_trainer(corpus, cache_dir, tmp_path / "a", **{"train.batch_size": 8}), 5)
    accum = _step_losses(_trainer(corpus, cache_dir, tmp_path / "b", **{"train.batch_size": 2,
                                                                        "train.grad_accum": 4}), 5)
    assert accum == pytest.approx(big, rel=fp32_tol(1e-5))


@pytest.mark.cuda
@pytest.mark.parametrize("chunk", [0, 50])
def test_validation_metrics_equal_hf_labels_loss(corpus, cache_dir, tmp_path, chunk):
    trainer = _trainer(corpus, cache_dir, tmp_path, **{"train.eval_batches": 0, "train.loss_chunk_size": chunk})
    _step_losses(trainer, 3)
    got = trainer.evaluate()
    hf, val = trainer.model.hf.eval(), trainer.run.val
    tokens = val.get(list(range(len(val)))).to(trainer.device)
    with torch.no_grad():
        out = hf(input_ids=tokens[:, :-1], labels=tokens[:, :-1])  # HF shifts labels itself
        logits = out.logits
    # HF drops the last position; score it too, as every block has seq_len targets
    full = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    acc = (logits.argmax(-1) == tokens[:, 1:]).double().mean().item()
    assert got["tokens"] == tokens[:, 1:].numel()
    assert got["loss"] == pytest.approx(full.item(), rel=fp32_tol(1e-5))
    assert got["ppl"] == pytest.approx(math.exp(full.item()), rel=fp32_tol(1e-5))
    assert got["accuracy"] == pytest.approx(acc, abs=fp32_tol(1e-9))  # TF32 may flip a near-tie argmax
    shifted = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:-1].flatten())
    assert out.loss.item() == pytest.approx(shifted.item(), rel=fp32_tol(1e-5))


def test_tied_weights_survive_sharding(corpus, cache_dir, tmp_path):
    out = subprocess.run(python_cmd(str(ROOT / "tests/scripts/tied_check.py"),
                                    *tiny(corpus, cache_dir, tmp_path, **{"parallel.wrap": "block"}),
                                    nproc=2),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TIED OK" in out.stdout and "LOCAL STEP OK" in out.stdout


@pytest.mark.cuda
def test_cli_run_learns_and_writes_metrics(corpus, cache_dir, tmp_path):
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 40,
                                                                       "train.eval_every": 20,
                                                                       "log.tensorboard": True})])
    val = records(tmp_path, "val")
    assert [r["step"] for r in val] == [20, 40]
    assert val[-1]["loss"] < val[0]["loss"] < math.log(257)
    assert {"ppl", "accuracy"} <= set(val[0])
    train = records(tmp_path, "train")
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb"} <= set(train[0])
    assert (tmp_path / "config.yaml").is_file() and any((tmp_path / "tensorboard").iterdir())
    assert "val loss" in proc.stdout

"""torch.compile per block (with activation checkpointing) compiles once, not every step or every layer."""

import pytest
import torch

from conftest import tiny
from shardlm.build import build
from shardlm.config import load_config
from shardlm.trainer import Trainer


def test_compiled_blocks_do_not_recompile(corpus, cache_dir, tmp_path):
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    cfg = load_config(None, tiny(corpus, cache_dir, tmp_path, **{"parallel.compile": "blocks", "model.n_layer": 3,
                                                                 "parallel.activation_checkpointing": True}))
    trainer = Trainer(build(cfg))
    eager = Trainer(build(load_config(None, tiny(corpus, cache_dir, tmp_path / "eager", **{"model.n_layer": 3}))))
    losses = []
    for _ in range(2):
        losses.append((trainer.train_step()["loss_sum"].item(), eager.train_step()["loss_sum"].item()))
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    for _ in range(3):
        losses.append((trainer.train_step()["loss_sum"].item(), eager.train_step()["loss_sum"].item()))
    assert graphs_after_warmup >= 1  # the blocks really were compiled
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup  # steady state: no recompiles
    assert graphs_after_warmup <= 4  # one graph for all 3 blocks (not one per layer_idx), plus backward
    assert not counters["recompiles"] or sum(counters["recompiles"].values()) <= 1
    for compiled, plain in losses:
        assert compiled == pytest.approx(plain, rel=1e-4)

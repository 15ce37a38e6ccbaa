"""Weighted mixtures (a list data.train): the sampler's proportions, its position property (what world-size
invariance and exact resume rest on), a tiny training run that reports tokens per source; bad weights, and a
source too short for one block, fail in one line."""

import numpy as np
import pytest
import torch

from helpers import records, tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.data import MixtureBlocks, MixtureSampler, TokenBlocks, micro_batch_position
from shardlm.data.mixture import quotas
from shardlm.tokenizer import byte_tokenizer


@pytest.mark.parametrize("sizes, weights", [([50, 7, 300], [0.7, 0.2, 0.1]), ([10, 40], [1.0, 1.0]),
                                            ([5, 5, 5], [0.0, 3.0, 1.0])])
def test_proportions_follow_the_weights_and_each_source_runs_its_own_epochs(sizes, weights):
    sampler = MixtureSampler(sizes, weights, seed=3)
    n = 20_000
    drawn = sampler.indices(0, n)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    source = np.searchsorted(offsets, drawn, side="right") - 1
    share = np.bincount(source, minlength=len(sizes)) / n
    assert share == pytest.approx(np.array(weights) / sum(weights), abs=2e-3)
    assert list(sampler.counts(n)) == list(np.bincount(source, minlength=len(sizes)))
    for s, size in enumerate(sizes):  # a source that runs out starts its next epoch: a permutation each pass
        mine = drawn[source == s] - offsets[s]
        for epoch in range(len(mine) // size):
            assert sorted(mine[epoch * size:(epoch + 1) * size]) == list(range(size))


def test_positions_are_a_pure_function_so_ranks_and_resume_agree():
    sampler = MixtureSampler([30, 11, 70], [0.5, 0.3, 0.2], seed=7, round_size=64)  # small rounds: many crossed
    whole = sampler.indices(0, 600)
    pieces = np.concatenate([MixtureSampler([30, 11, 70], [0.5, 0.3, 0.2], seed=7, round_size=64)
                             .indices(p, 8) for p in range(0, 600, 8)])
    assert list(pieces) == list(whole)
    resumed = MixtureSampler([30, 11, 70], [0.5, 0.3, 0.2], seed=7, round_size=64)  # a fresh process at 333
    assert list(resumed.indices(333, 100)) == list(whole[333:433])
    for world, batch, accum in [(2, 4, 1), (4, 1, 2)]:  # 2 ranks x 4 blocks draw what 1 x 8 draws
        for step in range(20):
            shares = [sampler.indices(micro_batch_position(step * 8, m, r, world, batch), batch)
                      for m in range(accum) for r in range(world)]
            assert sorted(np.concatenate(shares)) == sorted(whole[step * 8:(step + 1) * 8])
    assert list(MixtureSampler([30, 11, 70], [0.5, 0.3, 0.2], seed=8, round_size=64).indices(0, 50)) != \
        list(whole[:50])


def test_quotas_and_blocks():
    assert list(quotas([0.7, 0.3], 10)) == [7, 3] and list(quotas([1.0, 1e-9, 0.0], 10)) == [9, 1, 0]
    tokens = np.arange(100, dtype=np.uint16)
    a, b = TokenBlocks(tokens, 4, 0, 41), TokenBlocks(tokens, 4, 50)  # 10 and 12 blocks
    mix = MixtureBlocks([a, b])
    assert len(mix) == 22 and mix.weights == [10.0, 12.0] and mix.sampled_blocks == 22
    assert MixtureBlocks([a, b], [1.0, 0.0]).sampled_blocks == 10  # weight 0 leaves b out of an epoch
    assert mix.get(np.array([11, 0])).tolist() == [[54, 55, 56, 57, 58], [0, 1, 2, 3, 4]]
    spread = MixtureBlocks.interleaved([a, b])  # any prefix holds both sources
    assert {int(r[0]) >= 50 for r in spread.get(np.arange(4))} == {True, False}
    assert sorted(spread.get(np.arange(22))[:, 0].tolist()) == sorted(mix.get(np.arange(22))[:, 0].tolist())


def test_a_mixture_run_reports_tokens_per_source(tmp_path, cache_dir):
    from shardlm.training.trainer import Trainer

    (tmp_path / "a.txt").write_text("to be or not to be, that is the question. " * 60)
    (tmp_path / "b.txt").write_text("the quick brown fox jumps over the lazy dog. " * 120)
    mix = f"[{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}]"
    cfg = load_config(None, tiny(tmp_path / "a.txt", cache_dir, tmp_path / "run", **{
        "data.train": mix, "data.weights": "[3,1]", "train.max_steps": 6, "train.log_every": 3,
        "train.batch_size": 4}))
    trainer = Trainer.from_config(cfg)
    assert [len(p) for p in trainer.run.train.parts] == [70, 151]  # 90% of each source; the tails validate
    assert len(trainer.run.val) == 7 + 16
    summary = trainer.fit()
    train = records(tmp_path / "run")
    assert [r["step"] for r in train] == [3, 6] and summary["val"]["loss"] > 0
    for r in train:
        assert sum(r["tokens_by_source"]) == r["tokens"] == r["step"] * 4 * 32
    assert train[-1]["tokens_by_source"][0] > 2 * train[-1]["tokens_by_source"][1]  # weights 3:1
    import torch

    from shardlm.inference.evaluate import _evaluate, _validation_tails  # `shardlm eval` scores the blocks training did

    hf = trainer.run.model.hf.eval()
    tails = _validation_tails(cfg, trainer.run.tokenizer, torch.device("cpu"), exported=False)
    result = _evaluate(hf, np.concatenate(tails), tails, cfg, 64, 0, torch.device("cpu"))
    assert result["loss"] == pytest.approx(summary["val"]["loss"], rel=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["data.train=[a.txt,b.txt]", "data.weights=[1,2,3]"],
     "data.weights has 3 weights but data.train lists 2 sources: give one weight per source, or data.weights=null"),
    (["data.train=[a.txt,b.txt]", "data.weights=[1,-0.5]"],
     "data.weights[1] is -0.5: weights must be finite and >= 0 (0 = leave a source out)."),
    (["data.train=[a.txt,b.txt]", "data.weights=[0,0]"],
     "data.weights are all 0: give at least one source a positive weight."),
    (["data.train=a.txt", "data.weights=[1]"],
     "data.weights applies to a mixture, but data.train is one source ('a.txt'): give data.train a list of sources"),
    (["data.train=[]"], "data.train is an empty list: give one source, or a list of sources to mix."),
])
def test_bad_mixture_weights_fail_in_one_line(overrides, message):
    with pytest.raises(ShardlmError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_mixture_source_too_short_for_one_block_is_named(tmp_path):
    from shardlm.data import prepare_data
    from shardlm.distributed.process_group import Dist, LaunchInfo

    (tmp_path / "a.txt").write_text("plenty of text here. " * 40)
    (tmp_path / "b.txt").write_text("too short")
    cfg = load_config(None, [f"data.train=[{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}]", "data.seq_len=32",
                             f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ShardlmError) as err:
        prepare_data(cfg.data, byte_tokenizer(), Dist(LaunchInfo("single"), torch.device("cpu")))
    assert str(err.value).startswith("mixture source data.train[1] '") and "\n" not in str(err.value)
    assert "b.txt' has 9 tokens (less the 10% held out for validation), fewer than one block of data.seq_len=32 " \
           "+ 1. Give it more data, remove it from data.train, or use a smaller data.seq_len." in str(err.value)

"""Background batch loading feeds exactly the batches of the plain path, also after the position moves."""

import pytest

from helpers import tiny
from shardlm.config import load_config
from shardlm.training.trainer import Trainer


def test_prefetched_batches_equal_direct_ones(corpus, cache_dir, tmp_path):
    overrides = tiny(corpus, cache_dir, tmp_path, **{"train.grad_accum": 2})
    direct, ahead = (Trainer.from_config(load_config(None, overrides), prefetch=p) for p in (False, True))
    for trainer in (direct, ahead):
        trainer.position = 24  # as a resumed run: the prefetcher must start here, then follow moves
    seen = []
    for step in range(4):
        if step == 2:
            direct.position = ahead.position = 8
        seen.append([[t.train_batch(m) for m in range(2)] for t in (direct, ahead)])
        direct.position += direct.global_batch
        ahead.position += ahead.global_batch
    ahead.close()
    for plain, prefetched in seen:
        assert all((a.inputs == b.inputs).all() and (a.targets == b.targets).all()
                   for a, b in zip(plain, prefetched, strict=True))
    assert not (seen[0][0][0].inputs == seen[2][0][0].inputs).all()  # the move really changed the batches


@pytest.mark.cuda
def test_no_host_sync_in_a_training_step(corpus, cache_dir, tmp_path):
    """On CUDA a step waits for nothing: the gradient norm is read one step late (train.sync_free_step), and
    transformers' mask builder, which asks the device whether position ids pack sequences once per eager
    forward, is told that text blocks never do (attention.skip_packing_probe)."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        pytest.skip("counts CUDA synchronizations")
    trainer = Trainer.from_config(load_config(None, tiny(corpus, cache_dir, tmp_path, **{
        "parallel.device": "cuda", "train.grad_accum": 4})))
    for _ in range(2):  # warm-up: the prefetcher starts, kernels are chosen
        trainer.train_step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.close()
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == []

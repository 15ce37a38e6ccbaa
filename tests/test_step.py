"""The sync-free optimizer step (train.sync_free_step, shardlm.training.optim.update) gives the synchronous step's
numbers: losses, learning rates, skipped steps and the stop after train.max_bad_steps."""

import pytest
import torch
from faults import _NanGradient

from helpers import tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.training.trainer import Trainer


def steps(corpus, cache_dir, out, sync_free: bool, nan_steps: set[int], n: int, **extra) -> tuple[list, Trainer]:
    """`n` train_step calls, no callbacks (nothing makes the late read happen early); `nan_steps` (1-based) get
    NaN gradients. Returns (loss, lr) per step and the trainer."""
    trainer = Trainer.from_config(load_config(None, tiny(corpus, cache_dir, out, **{
        "train.sync_free_step": sync_free, "train.max_steps": n, "train.grad_clip": 0.5, **extra})))
    assert trainer.sync_free == sync_free

    def poison(module, args, output):
        return (_NanGradient.apply(output[0]), *output[1:]) if trainer.step + 1 in nan_steps else output

    trainer.model.register_forward_hook(poison)
    seen = []
    for _ in range(n):
        result = trainer.train_step()
        seen.append((result["loss_sum"].item(), result["lr"]))
    trainer.settle()
    return seen, trainer


def test_sync_free_step_equals_the_synchronous_step_with_a_nan_step(corpus, cache_dir, tmp_path):
    plain, ref = steps(corpus, cache_dir, tmp_path / "a", False, {5}, 20)
    late, new = steps(corpus, cache_dir, tmp_path / "b", True, {5}, 20)
    assert ref.skipped_steps == new.skipped_steps == 1
    assert plain[5][1] == plain[4][1] and late[5][1] == late[4][1]  # the skipped step did not move the schedule
    for (loss_a, lr_a), (loss_b, lr_b) in zip(plain, late, strict=True):
        assert lr_a == lr_b
        assert loss_b == pytest.approx(loss_a, rel=1e-5, nan_ok=False)  # clipping divides instead of multiplying
    for a, b in zip(ref.model.parameters(), new.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # Adam: rounding near 0
    steps_taken = [t.run.optimizer.state_dict()["state"][0]["step"] for t in (ref, new)]
    assert steps_taken == [19, 19]


def test_sync_free_step_stops_after_max_bad_steps_before_the_next_update(corpus, cache_dir, tmp_path):
    with pytest.raises(ShardlmError, match=r"2 consecutive steps had a non-finite loss \(last at step 4\)"):
        steps(corpus, cache_dir, tmp_path, True, {3, 4}, 8, **{"train.max_bad_steps": 2})


def test_one_process_bf16_carries_a_bf16_residual_stream_with_fp32_loss_close(corpus, cache_dir, tmp_path):
    """As under FSDP's mixed precision; the loss stays within bf16 rounding of autocast's fp32 stream."""
    from shardlm.models.causal_lm import transformer_blocks

    runs = {}
    for on in (True, False):
        trainer = Trainer.from_config(load_config(None, tiny(corpus, cache_dir, tmp_path / str(on), **{
            "parallel.precision": "bf16", "parallel.bf16_residual": on, "train.max_steps": 6})))
        seen: list[torch.dtype] = []
        transformer_blocks(trainer.model.hf)[1].register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(a[0].dtype))
        runs[on] = [trainer.train_step()["loss_sum"].item() for _ in range(6)]
        assert set(seen) == {torch.bfloat16 if on else torch.float32}
        assert next(trainer.model.parameters()).dtype == torch.float32  # master weights stay fp32
    assert runs[True] == pytest.approx(runs[False], rel=2e-2)
    assert runs[True] != runs[False]


def test_text_rows_skip_transformers_packing_probe_and_packed_rows_keep_it(corpus, cache_dir, tmp_path):
    """The probe waits for the device once per eager forward; text blocks never pack, examples do."""
    import transformers.masking_utils as masking

    from shardlm.models.attention import one_sequence_per_row

    Trainer.from_config(load_config(None, tiny(corpus, cache_dir, tmp_path)))  # building a model installs it
    packed = torch.tensor([[0, 1, 2, 0, 1, 0]])
    with one_sequence_per_row(True):
        assert masking.find_packed_sequence_indices(packed) is None
    with one_sequence_per_row(False):
        assert masking.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1, 2]]
    assert masking.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1, 2]]  # outside a forward

"""KTO's loss equals TRL's own in value, gradient and logged metrics.

TRL 1.16 has no `kto_loss` method: the loss is written inline in `KTOTrainer._compute_loss`
(trl/trainer/kto_trainer.py). That method is called here as it is, unbound, with a stand-in `self` and stand-in
models that return fixed summed log-probabilities, so every line from the KL reference point to `nanmean` is TRL's.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from shardlm.objectives.preference.kto_loss import (
    KTO_LOSS_TYPES,
    kl_from_sums,
    kl_reference_point,
    kl_sums,
    kto_losses,
)

SEQ, KL_SEQ = 6, 5  # the main and the KL sequences differ in length, which tells the stand-in model which is asked


class FakeLM:
    """A fused-LM-head model: per-token log-probs (B, L - 1) whose sum over tokens is the given per-example value."""

    def __init__(self, logps: torch.Tensor, kl_logps: torch.Tensor | None):
        self.logps, self.kl_logps = logps, kl_logps

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head, use_cache=False, **kwargs):
        assert fused_lm_head
        b, n = input_ids.shape
        per_example = self.kl_logps if n == KL_SEQ else self.logps
        zeros = torch.zeros(b, n - 2, dtype=per_example.dtype)
        log_probs = torch.cat([zeros, per_example[:, None]], dim=1)  # sums to exactly `per_example`
        return SimpleNamespace(log_probs=log_probs, entropy=torch.zeros(b, n - 1), mean_logits=torch.zeros(b, n - 1))


def _batch(n: int, length: int, prefix: str = "") -> dict[str, torch.Tensor]:
    completion_mask = torch.zeros(n, length, dtype=torch.int64)
    completion_mask[:, 2:] = 1
    return {f"{prefix}input_ids": torch.ones(n, length, dtype=torch.int64),
            f"{prefix}attention_mask": torch.ones(n, length, dtype=torch.int64),
            f"{prefix}completion_mask": completion_mask}


def trl_loss(policy, reference, policy_kl, reference_kl, desirable, *, beta, desirable_weight, undesirable_weight,
             loss_type, precompute):
    """TRL's `KTOTrainer._compute_loss` on these log-probs: (loss, the metrics it recorded)."""
    from trl.trainer.kto_trainer import KTOTrainer

    calculate_kl = loss_type != "apo_zero_unpaired"  # kto_trainer.py: calculate_kl = loss_type not in [...]
    n = len(desirable)
    batch = {**_batch(n, SEQ), "label": desirable.clone()}
    if calculate_kl:
        batch.update(_batch(n, KL_SEQ, "KL_"))
    if precompute:
        batch["ref_logps"] = reference
        if calculate_kl:
            batch["ref_KL_logps"] = reference_kl
    model = torch.nn.Module()  # `is_peft_model` unwraps it as a module; training mode, no checkpointing
    model.is_gradient_checkpointing = False
    me = SimpleNamespace(
        model=model,
        ref_model=FakeLM(reference, reference_kl if calculate_kl else None),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight, loss_type=loss_type,
        calculate_KL=calculate_kl, precompute_ref_logps=precompute, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    me._compute_kl_logps = functools.partial(KTOTrainer._compute_kl_logps, me)
    policy_model = FakeLM(policy, policy_kl if calculate_kl else None)
    loss = KTOTrainer._compute_loss(me, policy_model, batch, return_outputs=False)
    return loss, me._metrics["train"]


def _inputs(n: int, seed: int, kl_shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    policy = -torch.rand(n, generator=g, dtype=torch.float64) * 30 - 1
    reference = policy + torch.randn(n, generator=g, dtype=torch.float64) * 3
    policy_kl = -torch.rand(n, generator=g, dtype=torch.float64) * 30 - 1
    reference_kl = policy_kl + torch.randn(n, generator=g, dtype=torch.float64) * 3 - kl_shift
    return policy, reference, policy_kl, reference_kl


LABELS = {
    "mixed": [True, False, False, True, True, False, True],
    "all_desirable": [True] * 5,
    "all_undesirable": [False] * 4,
}
KW = {"beta": 0.25, "desirable_weight": 1.3, "undesirable_weight": 0.7}


@pytest.mark.parametrize("precompute", [True, False], ids=["precomputed_ref", "ref_model"])
@pytest.mark.parametrize("kl_shift", [4.0, -4.0], ids=["kl_positive", "kl_clamped"])
@pytest.mark.parametrize("labels", list(LABELS))
@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_kto_losses_are_trls(loss_type, labels, kl_shift, precompute):
    pytest.importorskip("trl")
    desirable = torch.tensor(LABELS[labels])
    policy, reference, policy_kl, reference_kl = _inputs(len(desirable), seed=len(labels), kl_shift=kl_shift)

    trl_policy = policy.clone().requires_grad_()
    want, metrics = trl_loss(trl_policy, reference, policy_kl, reference_kl, desirable, loss_type=loss_type,
                             precompute=precompute, **KW)
    want.backward()

    mine = policy.clone().requires_grad_()
    kl = kl_reference_point(policy_kl, reference_kl) if loss_type == "kto" else None
    out = kto_losses(mine, reference, desirable, kl, loss_type=loss_type, **KW)
    got = out.losses.sum() / out.valid.sum()
    got.backward()

    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(mine.grad, trl_policy.grad, rtol=1e-12, atol=1e-15)
    if loss_type == "kto":
        assert metrics["kl"] == [pytest.approx(kl.item(), rel=1e-12, abs=0)]
        assert (kl.item() == 0) == (kl_shift < 0)  # the negative mean was clamped
    n_c, n_r = out.num_chosen.item(), out.num_rejected.item()
    expected = {}
    if n_c:
        expected["rewards/chosen"] = out.chosen_rewards_sum.item() / n_c
        expected["logps/chosen"] = out.chosen_logps_sum.item() / n_c
    if n_r:
        expected["rewards/rejected"] = out.rejected_rewards_sum.item() / n_r
        expected["logps/rejected"] = out.rejected_logps_sum.item() / n_r
    for key in ("rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected"):
        assert (key in metrics) == (key in expected), key
        if key in expected:
            assert metrics[key] == [pytest.approx(expected[key], rel=1e-12)]


@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_two_ranks_of_four_equal_one_of_eight(loss_type):
    """DDP averages the ranks' `nanmean`s; sum / global count over the shards gives that, and 1 x 8 as well.

    Both ranks hold the same KL pairs, so each rank's own KL mean is already the cross-rank one TRL gathers.
    """
    pytest.importorskip("trl")
    policy, reference, policy_kl, reference_kl = _inputs(8, seed=3)
    policy_kl[4:], reference_kl[4:] = policy_kl[:4], reference_kl[:4]
    desirable = torch.tensor([True, True, True, True, False, True, False, False])
    halves = (slice(0, 4), slice(4, 8))

    trl_policy = policy.clone().requires_grad_()
    ranks = [trl_loss(trl_policy[h], reference[h], policy_kl[h], reference_kl[h], desirable[h], loss_type=loss_type,
                      precompute=True, **KW)[0] for h in halves]
    want = sum(ranks) / 2
    want.backward()
    one_of_eight, _ = trl_loss(policy, reference, policy_kl, reference_kl, desirable, loss_type=loss_type,
                               precompute=True, **KW)

    mine = policy.clone().requires_grad_()
    sums = [kl_sums(policy_kl[h], reference_kl[h]) for h in halves]
    kl = kl_from_sums(sums[0][0] + sums[1][0], sums[0][1] + sums[1][1])
    outs = [kto_losses(mine[h], reference[h], desirable[h], kl, loss_type=loss_type, **KW) for h in halves]
    got = sum(o.losses.sum() for o in outs) / sum(o.valid.sum() for o in outs)
    got.backward()

    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got, one_of_eight, rtol=1e-12, atol=0)
    torch.testing.assert_close(mine.grad, trl_policy.grad, rtol=1e-12, atol=1e-15)


def test_nan_is_left_out_like_nanmean():
    policy, reference = torch.tensor([-3.0, float("nan"), -5.0]), torch.tensor([-4.0, -2.0, -4.5])
    out = kto_losses(policy, reference, torch.tensor([True, True, False]), torch.tensor(0.5))
    assert out.valid.tolist() == [True, False, True]
    want = torch.stack([1 - torch.sigmoid(0.1 * (1.0 - 0.5 * torch.ones(()))),
                        1 - torch.sigmoid(0.1 * (0.5 - (-0.5) * torch.ones(())))]).mean()
    torch.testing.assert_close(out.losses.sum() / out.valid.sum(), want)


def test_kto_needs_the_reference_point_and_a_known_loss_type():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="KL reference point"):
        kto_losses(x, x, torch.tensor([True, False]), None)
    with pytest.raises(ValueError, match="unknown KTO loss_type"):
        kto_losses(x, x, torch.tensor([True, False]), torch.tensor(0.0), loss_type="sigmoid")
    kto_losses(x, x, torch.tensor([True, False]), None, loss_type="apo_zero_unpaired")  # no KL term there

"""Preference losses equal TRL's own on fixed log-probabilities: its CPO (sigmoid with label smoothing, SimPO) and
ORPO methods are called as they are; DPO and IPO, which TRL computes inside `DPOTrainer._compute_loss`, are
compared with the lines of that method (trl/trainer/dpo_trainer.py, "sigmoid" and "ipo")."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shardlm.models.preference import pair_losses

g = torch.Generator().manual_seed(0)
CHOSEN, REJECTED = -torch.rand(6, generator=g) * 20 - 1, -torch.rand(6, generator=g) * 20 - 1
REF_C, REF_R = CHOSEN + torch.randn(6, generator=g), REJECTED + torch.randn(6, generator=g)
LEN_C, LEN_R = torch.tensor([3, 5, 8, 2, 9, 4]), torch.tensor([4, 4, 7, 6, 2, 3])


def test_dpo_and_ipo_are_trls():
    beta = 0.2
    delta = (CHOSEN - REF_C) - (REJECTED - REF_R)
    got = pair_losses("dpo", CHOSEN, REJECTED, LEN_C, LEN_R, REF_C, REF_R, beta=beta)
    assert torch.allclose(got.losses, -F.logsigmoid(beta * delta))
    assert torch.allclose(got.chosen_rewards, beta * (CHOSEN - REF_C))
    ipo_delta = (CHOSEN - REF_C) / LEN_C - (REJECTED - REF_R) / LEN_R
    got = pair_losses("ipo", CHOSEN, REJECTED, LEN_C, LEN_R, REF_C, REF_R, beta=beta)
    assert torch.allclose(got.losses, (ipo_delta - 1 / (2 * beta)) ** 2)


@pytest.mark.parametrize(("loss_type", "smoothing"), [("sigmoid", 0.1), ("simpo", 0.0), ("simpo", 0.2)])
def test_simpo_and_smoothed_sigmoid_are_trls_cpo(loss_type, smoothing):
    pytest.importorskip("trl")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    beta, gamma = 2.0, 0.7
    me = SimpleNamespace(alpha=0.0, beta=beta, simpo_gamma=gamma, label_smoothing=smoothing, loss_type=loss_type,
                         accelerator=SimpleNamespace(device="cpu"))
    if loss_type == "simpo":  # CPO averages per token for SimPO (average_log_prob): give it the averages
        want = CPOTrainer.cpo_loss(me, CHOSEN / LEN_C, REJECTED / LEN_R)
        got = pair_losses("simpo", CHOSEN, REJECTED, LEN_C, LEN_R, beta=beta, label_smoothing=smoothing, gamma=gamma)
    else:  # cDPO: TRL's CPO sigmoid on log-ratios is DPO with label smoothing
        want = CPOTrainer.cpo_loss(me, CHOSEN - REF_C, REJECTED - REF_R)
        got = pair_losses("dpo", CHOSEN, REJECTED, LEN_C, LEN_R, REF_C, REF_R, beta=beta, label_smoothing=smoothing)
    assert torch.allclose(got.losses, want[0])
    assert torch.allclose(got.chosen_rewards, want[1]) and torch.allclose(got.rejected_rewards, want[2])


def test_orpo_is_trls():
    pytest.importorskip("trl")
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    me = SimpleNamespace(beta=0.25, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(me, CHOSEN / LEN_C, REJECTED / LEN_R)
    got = pair_losses("orpo", CHOSEN, REJECTED, LEN_C, LEN_R, beta=0.25)
    assert torch.allclose(got.losses, -losses)  # TRL subtracts its term from the NLL; shardlm adds the negation
    assert torch.allclose(got.chosen_rewards, chosen_rewards) and torch.allclose(got.rejected_rewards, rejected_rewards)

"""Preference losses on sequence log-probabilities, each TRL's definition (TRL 1.16; the file named per loss).

Inputs per pair: the policy's summed log-probabilities of the chosen and rejected answers (`chosen`,
`rejected`), the reference's (`ref_chosen`, `ref_rejected`; unused by the reference-free losses) and the answers'
token counts. Each function returns per-pair losses and the rewards TRL logs (`rewards/chosen`, ...).

- dpo (trl/trainer/dpo_trainer.py, "sigmoid"; with label smoothing the conservative cDPO form, as CPO's
  "sigmoid"): Δ = (c - c_ref) - (r - r_ref);  loss = -(1 - ε) log σ(βΔ) - ε log σ(-βΔ);
  rewards β(c - c_ref), β(r - r_ref)
- ipo (dpo_trainer.py, "ipo", per-token averaged as TRL does): Δ = (c - c_ref)/|y_c| - (r - r_ref)/|y_r|;
  loss = (Δ - 1/(2β))²
- simpo (trl/experimental/cpo/cpo_trainer.py, loss_type "simpo"): ρ = c/|y_c| - r/|y_r| - γ/β;
  loss = -(1 - ε) log σ(βρ) - ε log σ(-βρ);  rewards β c/|y_c|, β r/|y_r|
- orpo (trl/experimental/orpo/orpo_trainer.py): a_c = c/|y_c|, a_r = r/|y_r|;
  log-odds = (a_c - a_r) - (log(1 - e^{a_c}) - log(1 - e^{a_r}));  pair term = -β log σ(log-odds), added to the
  chosen answers' token-mean cross-entropy (which the trainer sums over the batch);  rewards β a_c, β a_r
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

PAIR_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
OBJECTIVES = ("sft", *PAIR_OBJECTIVES)
REFERENCE_FREE = ("simpo", "orpo")


class PairLosses(NamedTuple):
    losses: torch.Tensor  # per pair
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _smoothed(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, stable at both ends."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_losses(objective: str, chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor,
                rejected_len: torch.Tensor, ref_chosen: torch.Tensor | None = None,
                ref_rejected: torch.Tensor | None = None, beta: float = 0.1, label_smoothing: float = 0.0,
                gamma: float = 0.5) -> PairLosses:
    chosen, rejected = chosen.float(), rejected.float()
    n_c, n_r = chosen_len.float().clamp(min=1), rejected_len.float().clamp(min=1)
    if objective in ("dpo", "ipo"):
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"{objective} needs the reference's log-probabilities")
        c_ratio, r_ratio = chosen - ref_chosen.float(), rejected - ref_rejected.float()
        if objective == "dpo":
            losses = _smoothed(c_ratio - r_ratio, beta, label_smoothing)
        else:
            losses = (c_ratio / n_c - r_ratio / n_r - 1 / (2 * beta)) ** 2
        return PairLosses(losses, beta * c_ratio.detach(), beta * r_ratio.detach())
    avg_c, avg_r = chosen / n_c, rejected / n_r
    if objective == "simpo":
        losses = _smoothed(avg_c - avg_r - gamma / beta, beta, label_smoothing)
    elif objective == "orpo":
        log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
        losses = -beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown preference objective {objective!r}; one of {', '.join(OBJECTIVES[1:])}")
    return PairLosses(losses, beta * avg_c.detach(), beta * avg_r.detach())

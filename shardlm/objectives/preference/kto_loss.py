"""KTO's loss on sequence log-probabilities, as TRL 1.16 computes it (trl/trainer/kto_trainer.py, `_compute_loss`).

TRL has no separate loss method: the loss is written inline in `KTOTrainer._compute_loss`. Per example, with r the
policy's minus the reference's summed completion log-probability (no per-token averaging, for either loss type):

- kto (Eqn 7 of the KTO paper): desirable  w_d (1 - σ(β (r - z)));  undesirable  w_u (1 - σ(β (z - r)))
- apo_zero_unpaired (APO paper):  desirable  w_d (1 - σ(β r));        undesirable  w_u σ(β r)

z is the KL reference point: the mean over the micro-batch, across data-parallel ranks, of (policy - reference)
summed log-probabilities of mismatched (prompt, completion) pairs, detached and clamped at 0 after the cross-rank
mean. TRL's step loss is `cat(w_d * desirable_losses, w_u * undesirable_losses).nanmean()` per rank, averaged over
ranks by DDP and over micro-batches by gradient accumulation. With equal micro-batches that is the sum of the
per-example losses over all of them divided by their count, which is how this module expresses it: the sum and
the count can be all-reduced, so 2 ranks x 4 examples give exactly what 1 x 8 gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass(frozen=True)
class KTOOut:
    """Per-example KTO terms and the 0-dim sums TRL logs, each summable across ranks.

    `losses` already carry the desirable/undesirable weight; a NaN loss (a NaN log-probability) is zeroed and left
    out of `valid`, as `nanmean` leaves it out of both sums. The step loss is sum(losses) / sum(valid), both summed
    over every example of the step (all ranks, all micro-batches).
    """

    losses: torch.Tensor  # (B,) weighted per-example losses, 0 where NaN
    valid: torch.Tensor  # (B,) bool: counted in the step's denominator
    rewards: torch.Tensor  # (B,) β (policy - reference), detached
    chosen_rewards_sum: torch.Tensor  # TRL: rewards/chosen = Σ / num_chosen (nansum), logged when num_chosen > 0
    rejected_rewards_sum: torch.Tensor
    chosen_logps_sum: torch.Tensor  # TRL: logps/chosen = Σ policy logps of desirable examples / num_chosen
    rejected_logps_sum: torch.Tensor
    num_chosen: torch.Tensor
    num_rejected: torch.Tensor


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def kto_losses(policy_logps: torch.Tensor, reference_logps: torch.Tensor, desirable: torch.Tensor,
               kl: torch.Tensor | None, beta: float = 0.1, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0, loss_type: str = "kto") -> KTOOut:
    """Per-example weighted KTO losses; reduce with sum(losses) / global sum(valid).

    `policy_logps`, `reference_logps`: (B,) log-probabilities summed over each completion's tokens; `desirable`: (B,)
    bool; `kl`: the reference point from `kl_from_sums` (detached, clamped at 0; unused and may be None for
    apo_zero_unpaired, which does not estimate it). Defaults are TRL's (KTOConfig).
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; one of {', '.join(KTO_LOSS_TYPES)}")
    if loss_type == "kto" and kl is None:
        raise ValueError("loss_type 'kto' needs the KL reference point (kl_from_sums)")
    policy_logps, reference_logps = _compute_dtype(policy_logps), _compute_dtype(reference_logps)
    desirable = desirable.to(device=policy_logps.device, dtype=torch.bool)
    logratios = policy_logps - reference_logps
    if loss_type == "kto":
        z = kl.detach().to(logratios)  # type: ignore[union-attr]
        chosen = 1 - F.sigmoid(beta * (logratios - z))
        rejected = 1 - F.sigmoid(beta * (z - logratios))
    else:
        chosen = 1 - F.sigmoid(beta * logratios)
        rejected = F.sigmoid(beta * logratios)
    losses = torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)
    valid = ~torch.isnan(losses)
    losses = torch.where(valid, losses, torch.zeros_like(losses))
    rewards = beta * logratios.detach()
    undesirable = ~desirable
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return KTOOut(
        losses=losses, valid=valid, rewards=rewards,
        chosen_rewards_sum=torch.where(desirable, rewards, zero).nansum(),
        rejected_rewards_sum=torch.where(undesirable, rewards, zero).nansum(),
        chosen_logps_sum=torch.where(desirable, policy_logps.detach(), zero).nansum(),
        rejected_logps_sum=torch.where(undesirable, policy_logps.detach(), zero).nansum(),
        num_chosen=desirable.sum(), num_rejected=undesirable.sum(),
    )


def kl_sums(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ (policy - reference) KL log-probs, count) over this rank's micro-batch, detached, to all-reduce.

    TRL averages per rank and then over ranks (`gather_for_metrics(kl).mean()`), which equals the pooled mean when
    the ranks hold equally many examples (they do, but for a short last batch).
    """
    diff = (_compute_dtype(policy_kl_logps) - _compute_dtype(reference_kl_logps)).detach()
    return diff.sum(), torch.tensor(float(diff.numel()), dtype=diff.dtype, device=diff.device)


def kl_from_sums(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z = max(0, mean), detached: clamped after the cross-rank mean, as TRL does."""
    return (total / count).clamp(min=0).detach()


def kl_reference_point(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor) -> torch.Tensor:
    """Single-process z: `kl_from_sums(*kl_sums(...))`."""
    return kl_from_sums(*kl_sums(policy_kl_logps, reference_kl_logps))

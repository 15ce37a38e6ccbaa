"""Advantages and the policy loss of online RL from rewards, each TRL 1.16's definition, as pure tensor functions
(trl/trainer/grpo_trainer.py: `_generate_and_score_completions`, `_compute_loss`; rloo_trainer.py for RLOO).

Rewards (N completions, F functions; NaN = the function returned None) are summed with their weights (NaN-sum);
a completion for which every function returned None is unscorable: left out of its group's statistics, with
advantage 0.
- grpo: A = r - mean(group), divided by std + 1e-4, the std of the group (`scale_rewards` group), of the whole
  batch (batch) or not at all (none, Dr. GRPO); std is Bessel-corrected, as TRL's nanstd.
- rloo: A = r - the mean of the other completions of its group (leave-one-out); β > 0 first subtracts
  β x the completion's summed k1 KL (old - ref log-probabilities) from its reward; `normalize` standardizes A
  over the batch.

The loss per completion token t, with ratio ρ = exp(logp - old_logp) (per token, or exp of each completion's
mean log-ratio for `sequence`, GSPO), clipped to [1 - ε, 1 + ε_high]:
  ℓ_t = -min(ρ A, clip(ρ) A)  (+ β KL_t, KL_t = exp(ref - logp) - (ref - logp) - 1, the k3 estimator)
reduced by `loss_type`, over the completions of an optimizer step (every micro-batch and rank):
- dapo: Σ ℓ_t / the step's completion tokens;
- grpo: Σ over completions of their token mean ℓ / the step's completions;
- dr_grpo: Σ ℓ_t / (the step's completions x max_completion_length).
`step_loss` returns one micro-batch's share: summed over the step's micro-batches it is TRL's loss (TRL's grpo and
dr_grpo average micro-batch means, the same when micro-batches hold the same number of completions, as here).
RLOO's loss is per completion: ρ = exp(Σ logp - Σ old_logp), -min(ρ A, clip(ρ) A), averaged over completions.
With μ = 1 the old log-probabilities are the current ones detached: ρ = 1 in value, the gradient that of A·logp.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from shardlm.config.grpo import LOSS_TYPES, SCALE_REWARDS

EPS = 1e-4  # TRL's: added to the std that divides the advantages


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The Bessel-corrected std ignoring NaN (TRL's `nanstd`): NaN where fewer than 2 values are finite."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


class Advantages(NamedTuple):
    advantages: torch.Tensor  # (N,), 0 where unscorable
    rewards: torch.Tensor  # (N,) the weighted sum, NaN where unscorable
    std_zero: torch.Tensor  # (N,) bool: the completion's group (or batch) has rewards all equal


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights.to(per_func).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(unscorable, float("nan"))


def group_advantages(per_func: torch.Tensor, weights: torch.Tensor, group: int,
                     scale_rewards: str = "group") -> Advantages:
    """GRPO's advantages of a whole generation batch (every rank's completions, groups contiguous)."""
    rewards = weighted_rewards(per_func.float(), weights)
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale_rewards in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + EPS)
    std_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, std_zero)


def rloo_advantages(per_func: torch.Tensor, weights: torch.Tensor, group: int, normalize: bool = False,
                    kl: torch.Tensor | None = None, beta: float = 0.0) -> Advantages:
    """RLOO's leave-one-out advantages; `kl` per completion (Σ old - ref over its tokens) when β > 0."""
    rewards = weighted_rewards(per_func.float(), weights)
    if beta != 0.0 and kl is not None:
        rewards = rewards - beta * kl.float()
    grouped = rewards.view(-1, group)
    std = nanstd(grouped, dim=1) if group > 1 else torch.zeros(grouped.shape[0])
    if group > 1:
        scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + EPS)
    std_zero = torch.isclose(std, torch.zeros_like(std)).repeat_interleave(group)
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, std_zero)


class TokenLoss(NamedTuple):
    per_token: torch.Tensor  # (B, T) ℓ_t, before masking
    ratio: torch.Tensor  # (B, T), or (B, 1) at the sequence level: ρ before clipping
    kl: torch.Tensor | None  # (B, T) k3 KL, when β > 0


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
               epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
               ref_logps: torch.Tensor | None = None, delta: float | None = None,
               level: str = "token", sampling_weights: torch.Tensor | None = None) -> TokenLoss:
    """The clipped surrogate per completion token (TRL's `_compute_loss` before its reduction). `old_logps` None:
    μ = 1, the current log-probabilities detached. `sampling_weights` (`sampling_correction`'s) multiply the
    surrogate, not the KL term, as TRL's vLLM importance-sampling correction does."""
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif level != "token":
        raise ValueError(f"importance_sampling_level must be token or sequence, got {level!r}")
    ratio = torch.exp(log_ratio)
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    a = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    per_token = -torch.min(unclipped * a, clipped * a)
    if sampling_weights is not None:
        per_token = per_token * sampling_weights
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
    return TokenLoss(per_token, ratio, kl)


def sampling_correction(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                        clip_min: float | None, clip_max: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's `vllm_importance_sampling_correction`: the trainer's likelihood of each sampled token (at sampling
    time) over the sampler's, per token (B, T) or per completion (B, 1, the product over its tokens), truncated into
    [clip_min, clip_max] or set to 0 outside it (`mode`). The sampler is another implementation of the policy (an
    inference engine, a KV-cache decode in bf16), so its tokens come from a slightly different distribution.
    Also the per-token |difference| of the two log-probabilities (B, T), what `sampling_logp_difference` reports."""
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=low, max=high)
    else:
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return ratio, diff.abs()


def step_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, completions: float, tokens: float,
              max_completion_length: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss; `completions` and `tokens` count the whole optimizer step
    (every micro-batch, over the ranks that average gradients)."""
    mask = mask.to(per_token.dtype)
    if loss_type == "dapo":
        return (per_token * mask).sum() / max(tokens, 1.0)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(completions, 1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (max(completions, 1.0) * max_completion_length)
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def rloo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
              completions: float, epsilon: float = 0.2, epsilon_high: float | None = None) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
    """(this micro-batch's share of RLOO's loss, the per-completion ratio ρ); `old_logps` per completion, summed
    (None: μ = 1)."""
    seq = (logps * mask).sum(1)
    old = seq.detach() if old_logps is None else old_logps
    ratio = torch.exp(seq - old)
    high = epsilon if epsilon_high is None else epsilon_high
    per_completion = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon, 1 + high) * advantages)
    return per_completion.sum() / max(completions, 1.0), ratio


class ClipCounts(NamedTuple):
    low: torch.Tensor  # tokens (or completions) whose ratio fell below 1 - ε with A < 0
    high: torch.Tensor  # above 1 + ε_high with A > 0
    tokens: torch.Tensor  # what they count among


def clip_counts(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon: float,
                epsilon_high: float | None) -> ClipCounts:
    """TRL's clip_ratio/low_mean and high_mean as sums and a count, to be summed over micro-batches and ranks
    (the region ratio is (low + high) / tokens)."""
    a = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    high = epsilon if epsilon_high is None else epsilon_high
    m = mask.float() if ratio.shape == mask.shape else torch.ones_like(ratio)
    low_hit = ((ratio < 1 - epsilon) & (a < 0)).float() * m
    high_hit = ((ratio > 1 + high) & (a > 0)).float() * m
    return ClipCounts(low_hit.sum().detach(), high_hit.sum().detach(), m.sum().detach())

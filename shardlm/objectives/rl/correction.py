"""The sampler/trainer mismatch in a step (TRL's `vllm_importance_sampling_correction`): the sampler (a vLLM engine,
or shardlm's own KV-cache decode) is another implementation of the policy, so the tokens it draws come from a
slightly different distribution than the one the trainer scores. Each micro-batch's completions are weighed by the
trainer's likelihood over the sampler's (`loss.sampling_correction`), computed once per generation round against
the policy at sampling time (the old log-probabilities, or at μ = 1 the current ones: no optimizer step lies
between), and the round's differences and ratios are recorded under TRL's metric names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardlm.objectives.rl.loss import sampling_correction


def sampler_logps(rollout: Any, span: range, lengths: torch.Tensor) -> torch.Tensor | None:
    """The sampler's log-probabilities of the span's completion tokens on a micro-batch's (rows, T) layout, or
    None where the sampler gave none."""
    if not rollout.logps:
        return None
    marks = rollout.trainable or [[1] * len(c) for c in rollout.completions]  # a tool result's tokens are no targets
    flat = torch.tensor([x for i in span for x, m in zip(rollout.logps[i], marks[i], strict=True) if m],
                        dtype=torch.float32, device=lengths.device)
    return torch.zeros(lengths.shape, device=lengths.device).masked_scatter(lengths, flat)


def correct(sampling: torch.Tensor, old: torch.Tensor, lengths: torch.Tensor, g: Any, sums: torch.Tensor,
            highs: torch.Tensor) -> torch.Tensor:
    """A micro-batch's importance-sampling weights, (rows, T) or (rows, 1); adds to `sums` the |difference| sum
    and count and the ratios' sum and count, and raises `highs` to the maxima of the |difference|, of the ratio
    and of minus the ratio (the minimum, through one max-reduction)."""
    weights, diff = sampling_correction(old.float(), sampling, lengths.float(), g.vllm_importance_sampling_mode,
                                        g.vllm_importance_sampling_clip_min, g.vllm_importance_sampling_clip_max)
    ratios = weights.flatten() if weights.shape[-1] == 1 else weights[lengths]
    tokens = diff[lengths]
    sums += torch.tensor([tokens.sum().item(), tokens.numel(), ratios.sum().item(), ratios.numel()],
                         dtype=torch.float64, device=sums.device)
    if ratios.numel():
        highs.copy_(torch.maximum(highs, torch.stack([tokens.max(), ratios.max(), -ratios.min()]).double()))
    return weights


def correction_stats(sums: torch.Tensor, highs: torch.Tensor,
                     all_reduce: Callable[..., None]) -> dict[str, float]:
    """The round's metrics over every rank, TRL's names."""
    all_reduce(sums)
    all_reduce(highs, "max")
    diff, tokens, ratio, count = sums.tolist()
    return {"sampling/sampling_logp_difference/mean": diff / max(tokens, 1),
            "sampling/sampling_logp_difference/max": max(highs[0].item(), 0.0),
            "sampling/importance_sampling_ratio/min": -highs[2].item() if count else 0.0,
            "sampling/importance_sampling_ratio/mean": ratio / count if count else 0.0,
            "sampling/importance_sampling_ratio/max": highs[1].item() if count else 0.0}

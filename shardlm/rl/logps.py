"""Per-token log-probabilities (and entropies) of a rollout's completion tokens under a transformers causal LM, on
TRL's padded layout (`Rollout.padded`): the policy's for the loss, the old policy's and the reference's for
μ > 1 and β > 0.

As TRL's GRPOTrainer, the logits are divided by the sampling temperature first, so the ratio compares the
distributions the completions were sampled from. Positions count from each row's first real token (the left
padding's mask), as the sampler's are; TRL's forward leaves them to the model, which for left-padded rows starts
them at the padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def completion_logps(model: Any, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                     with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probabilities, entropies or None), each (rows, completion length); zero past a completion's end."""
    device = next(model.parameters()).device
    prompt, completion = batch["prompt_ids"].to(device), batch["completion_ids"].to(device)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = completion.shape[1]
    out = model(input_ids=torch.cat([prompt, completion], dim=1), attention_mask=mask, position_ids=positions,
                use_cache=False, logits_to_keep=keep + 1)
    logits = out.logits[:, -keep - 1:-1].float() / (temperature if temperature > 0 else 1.0)
    logprobs = F.log_softmax(logits, dim=-1)
    completion_mask = batch["completion_mask"].to(device)
    logps = logprobs.gather(-1, completion.unsqueeze(-1)).squeeze(-1) * completion_mask
    entropy = None
    if with_entropy:
        entropy = -(logprobs.exp() * logprobs).sum(-1) * completion_mask
    return logps, entropy

"""Per-token log-probabilities (and entropies) of a rollout's completion tokens under a transformers causal LM, on
TRL's padded layout (`Rollout.padded`): the policy's for the loss, the old policy's and the reference's for
μ > 1 and β > 0 (the tests' and benchmarks' reference). The rows the trainer scores them on with
`CausalLM.completion_logps` are built here too: one padded row per completion (`micro_batch`), or one row per
prompt holding its group's completions under a 4D mask (`shared_batch`).

As TRL's GRPOTrainer, the logits are divided by the sampling temperature first, so the ratio compares the
distributions the completions were sampled from. Positions count from each row's first real token (the left
padding's mask), as the sampler's are; TRL's forward leaves them to the model, which for left-padded rows starts
them at the padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardlm.models.loss import IGNORE


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


def micro_batch(prompts: list[list[int]], completions: list[list[int]], pad: int, device: torch.device,
                trainable: list[list[int]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, targets, lengths) of rows prompt + completion: completion token j is the target of the
    position before it, unless `trainable` marks it 0 (a tool's result: context, never a target)."""
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    width, longest = max(map(len, rows)), max(map(len, completions))
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    lengths = torch.zeros((len(rows), longest), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        keep = torch.tensor(trainable[i], dtype=torch.bool) if trainable else torch.ones(len(c), dtype=torch.bool)
        targets[i, len(p) - 1:len(p) - 1 + len(c)] = torch.where(keep, torch.tensor(c), IGNORE)
        lengths[i, :len(c)] = keep
    positions = torch.arange(width).expand(len(rows), width)
    return tokens.to(device), positions.to(device), targets.to(device), lengths.to(device)


def shared_batch(prompts: list[list[int]], completions: list[list[int]], group: int, pad: int, device: torch.device,
                 trainable: list[list[int]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, targets, lengths, mask): one row per prompt holding its `group` completions, the prompt's
    tokens once. A segment per completion repeats the prompt's last token (whose output predicts the completion's
    first token) at its own position, then the completion but its last token; the 4D boolean mask lets a segment see
    the prompt and its own earlier tokens only. Each completion's log-probabilities are those of its own row
    prompt + completion, at a fraction of the tokens when prompts are long beside their completions. A token
    `trainable` marks 0 is context only, as in micro_batch."""
    rows = []
    for p, prompt in enumerate(prompts):
        tokens, positions, targets, segment = prompt[:-1], list(range(len(prompt) - 1)), [IGNORE] * (len(prompt) - 1), \
            [-1] * (len(prompt) - 1)
        for j in range(group):
            c = completions[p * group + j]
            tokens = tokens + [prompt[-1], *c[:-1]]
            positions = positions + list(range(len(prompt) - 1, len(prompt) - 1 + len(c)))
            keep = trainable[p * group + j] if trainable else [1] * len(c)
            targets = targets + [t if k else IGNORE for t, k in zip(c, keep, strict=True)]
            segment = segment + [j] * len(c)
        rows.append((tokens, positions, targets, segment))
    width = max(len(r[0]) for r in rows)
    t = torch.full((len(rows), width), pad, dtype=torch.long)
    pos, tg = torch.zeros_like(t), torch.full_like(t, IGNORE)
    seg = torch.full_like(t, -2)  # padding: a segment of its own
    for i, (tokens, positions, targets, segment) in enumerate(rows):
        n = len(tokens)
        t[i, :n], pos[i, :n], tg[i, :n], seg[i, :n] = (torch.tensor(x) for x in (tokens, positions, targets, segment))
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = causal & ((seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == -1))  # (rows, query, key)
    lengths = torch.zeros((len(completions), max(map(len, completions))), dtype=torch.bool)
    for i, c in enumerate(completions):
        lengths[i, :len(c)] = torch.tensor(trainable[i], dtype=torch.bool) if trainable else True
    return t.to(device), pos.to(device), tg.to(device), lengths.to(device), mask[:, None].to(device)


SHARED_MAX_WIDTH = 2048  # a shared row's dense mask takes SDPA off its flash kernels: O(width^2) attention memory


def shared_pays(prompts: list[list[int]], completions: list[list[int]], group: int) -> bool:
    """Whether rows that hold a prompt once (`shared_batch`) are worth their dense mask: fewer tokens than one padded
    row per completion, and rows short enough for attention that materializes its scores."""
    widths = [len(p) - 1 + sum(len(c) for c in completions[i * group:(i + 1) * group]) for i, p in enumerate(prompts)]
    plain = len(completions) * max(len(prompts[i // group]) + len(c) for i, c in enumerate(completions))
    return max(widths) <= SHARED_MAX_WIDTH and len(widths) * max(widths) < plain

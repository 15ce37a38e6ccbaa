"""Online RL's validation: the mean reward of one sampled completion per held-out prompt and the share of greedy
completions equal to the prompt's `answer` (`RLStep.validate`, `shardlm eval` of an RL run), each rank its share,
the same on 1 rank or many."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from shardlm.data import eval_shares
from shardlm.objectives.rl.loss import weighted_rewards
from shardlm.objectives.rl.rewards import exact_match, text_of
from shardlm.objectives.rl.rollout import eager, prompt_split, sample_round

VAL_KEYS = 1 << 40  # validation prompts' sampling keys start here, apart from the training positions


@torch.no_grad()
def validate_prompts(rl: Any, val: Any, eval_batches: int) -> dict[str, Any]:
    """The mean reward of one sampled completion per prompt (seeded) and the share of greedy completions that
    equal the prompt's `answer` (exact match, `shardlm eval --exact-match`'s rule), over run.val's prompts;
    every rank takes its share, padding rows (index -1) weigh nothing, so 1 or 2 ranks give the same."""
    rows = prompt_split(val, "validation")
    shares = eval_shares(len(rows), rl.dist.rank, rl.dist.world_size, rl.batch, eval_batches)
    indices = np.concatenate(shares) if shares else np.zeros(0, dtype=np.int64)
    real = np.where(indices >= 0, indices, 0)
    weight = torch.from_numpy((indices >= 0).astype(np.float64))
    prompts = [rows.prompt(int(i)) for i in real]
    ids = [rows.token_ids(int(i)) for i in real]
    keys = [VAL_KEYS + int(i) for i in real]
    names = rl.rewards.metric_names
    fields = {k: [p.fields.get(k) for p in prompts] for k in rows.field_names}
    with eager(), rl.autocast():
        greedy, _, greedy_completions = sample_round(rl.sampler, rl.tok, rl.box, prompts, ids, keys,
                                                     dataclasses.replace(rl.params, group=1, temperature=0.0),
                                                     dict(fields))
        sampled, _, completions = sample_round(rl.sampler, rl.tok, rl.box, prompts, ids, keys,
                                               dataclasses.replace(rl.params, group=1), fields)
    if not len(indices):  # this rank has no batch (it sampled nothing, with the others)
        return _val_result(rl, torch.zeros(6 + 2 * len(names), dtype=torch.float64))
    per_func = rl.rewards.score([p.prompt for p in prompts], completions, sampled.completions, fields)
    reward = weighted_rewards(per_func, rl.rewards.weight_tensor).double()
    answered = torch.tensor([p.fields.get("answer") is not None for p in prompts], dtype=torch.float64) * weight
    greedy_texts = [text_of(c) for c in greedy_completions]  # with tools: the last turn's answer
    matched = torch.tensor(exact_match(greedy_texts, [p.fields.get("answer") or "" for p in prompts]),
                           dtype=torch.float64) * answered
    ok = ~torch.isnan(reward)
    columns = [*per_func.double().unbind(1)]
    sums = torch.stack([torch.where(ok, reward, 0.0).mul(weight).sum(), (ok * weight).sum(), matched.sum(),
                        answered.sum(), weight.sum(),
                        (torch.tensor([len(c) for c in sampled.completions], dtype=torch.float64) * weight).sum(),
                        *[torch.nan_to_num(c).mul(weight).sum() for c in columns],
                        *[((~torch.isnan(c)) * weight).sum() for c in columns]])
    return _val_result(rl, sums)


def _val_result(rl: Any, sums: torch.Tensor) -> dict[str, Any]:
    rl.all_reduce(sums)
    total, names = sums.tolist(), rl.rewards.metric_names
    f = len(names)
    out: dict[str, Any] = {"reward": total[0] / total[1] if total[1] else math.nan,
                           "exact_match": total[2] / total[3] if total[3] else math.nan,
                           "prompts": int(total[4]), "completions/mean_length": total[5] / max(total[4], 1)}
    for j, name in enumerate(names):
        n = total[6 + f + j]
        out[f"rewards/{name}/mean"] = total[6 + j] / n if n else math.nan
    return out


def describe_prompts(result: dict[str, Any], held_out: int) -> str:
    """An RL validation in words, as the run and `shardlm eval` print it."""
    return (f"reward {result['reward']:.4f} exact_match {result['exact_match']:.3f} on {result['prompts']:,} of "
            f"{held_out:,} prompts")

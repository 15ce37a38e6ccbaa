"""One generation round of online RL: sample `group` completions of each prompt, decode them for the reward
functions, score them, and turn the rewards into advantages (TRL's `_generate_and_score_completions`).

Each rank holds whole groups (a prompt's completions are sampled where the prompt is), so the group statistics
need no communication; `scale_rewards=batch` and the logged metrics take their sums (and maxima) over the ranks
through `all_reduce(tensor, op)` (in place, op "sum" or "max"), given by the caller: the same numbers on 1 rank
or many.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from shardlm import ShardlmError
from shardlm.config import GrpoConfig
from shardlm.data.prompts import PromptRows, RLPrompt, completion_for_rewards
from shardlm.objectives.rl.custom import custom_rollout
from shardlm.objectives.rl.loss import EPS, Advantages, group_advantages, rloo_advantages
from shardlm.objectives.rl.multiturn import sample_episodes
from shardlm.objectives.rl.rewards import RewardSet
from shardlm.objectives.rl.sampling import Rollout, Sampler, SamplingParams
from shardlm.objectives.rl.tools import Toolbox
from shardlm.tokenizer import end_of_turn_id

AllReduce = Callable[[torch.Tensor, str], None]


@dataclass
class ScoredRound:
    rollout: Rollout
    texts: list[str]  # each completion decoded (special tokens left out), as the rewards saw it
    per_func: torch.Tensor  # (completions, rewards), NaN where a function returned None
    scored: Advantages
    loss_mask: torch.Tensor  # (completions,) 0 for a truncated completion under mask_truncated_completions

    def batch(self, pad: int) -> dict[str, torch.Tensor]:
        """The rollout on TRL's padded layout, `completion_mask` zero for the completions the loss leaves out."""
        out = self.rollout.padded(pad)
        out["completion_mask"] = out["completion_mask"] * self.loss_mask.to(out["completion_mask"].dtype)[:, None]
        return out


def sampling_params(g: GrpoConfig, stop: Sequence[int], seed: int) -> SamplingParams:
    return SamplingParams(group=g.group, max_tokens=g.max_completion_length, temperature=g.temperature,
                          top_p=g.top_p, top_k=g.top_k, stop=tuple(dict.fromkeys(stop)), seed=seed)


def _batch_scaled(per_func: torch.Tensor, weights: torch.Tensor, group: int, all_reduce: AllReduce | None
                  ) -> Advantages:
    """scale_rewards=batch over every rank: the group-centred rewards divided by the std of all the rewards."""
    centred = group_advantages(per_func, weights, group, "none")
    rewards = centred.rewards
    finite = rewards[~torch.isnan(rewards)].double()
    sums = torch.stack([finite.sum(), (finite ** 2).sum(), torch.tensor(float(finite.numel()), dtype=torch.double)])
    if all_reduce is not None:
        all_reduce(sums, "sum")
    total, squares, n = sums.tolist()
    std = math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else math.nan  # TRL's nanstd
    advantages = torch.nan_to_num(centred.advantages / (std + EPS), nan=0.0)
    std_zero = torch.full_like(rewards, float(math.isclose(std, 0.0, abs_tol=1e-8))).bool()
    return Advantages(advantages, rewards, std_zero)


def score_round(sampler: Sampler, tok, prompts: list[RLPrompt], prompt_ids: list[list[int]], keys: Sequence[int],
                rewards: RewardSet, g: GrpoConfig, params: SamplingParams, objective: str = "grpo",
                all_reduce: AllReduce | None = None, box: Toolbox | None = None) -> ScoredRound:
    rollout, texts, per_func = sample_and_reward(sampler, tok, prompts, prompt_ids, keys, rewards, g, params,
                                                 all_reduce, box)
    return with_advantages(rollout, texts, per_func, rewards, g, objective, all_reduce)


def sample_and_reward(sampler: Sampler, tok, prompts: list[RLPrompt], prompt_ids: list[list[int]],
                      keys: Sequence[int], rewards: RewardSet, g: GrpoConfig, params: SamplingParams,
                      all_reduce: AllReduce | None = None, box: Toolbox | None = None
                      ) -> tuple[Rollout, list[str], torch.Tensor]:
    """The completions of a round (with `box`: tool-calling episodes, or grpo.rollout_func's round), decoded, and
    each reward function's value of each (NaN: it returned None)."""
    group = g.group
    owners = [prompts[i // group] for i in range(len(prompts) * group)]
    fields = {k: [p.fields.get(k) for p in owners] for k in dict.fromkeys(k for p in prompts for k in p.fields)}
    rollout, texts, completions = sample_round(sampler, tok, box, prompts, prompt_ids, keys, params, fields)
    per_func = rewards.score([p.prompt for p in owners], completions, rollout.completions, fields)
    check_applied(per_func, rewards, all_reduce)
    return rollout, texts, per_func


def sample_round(sampler: Sampler, tok, box: Toolbox | None, prompts: list[RLPrompt], prompt_ids: list[list[int]],
                 keys: Sequence[int], params: SamplingParams, fields: dict[str, list]
                 ) -> tuple[Rollout, list[str], list]:
    """`params.group` completions of each prompt (with `box`: tool-calling episodes, or grpo.rollout_func's round),
    decoded, and each as the rewards get it; `fields` gains the episodes' environments or the function's keys."""
    messages: list | None = None
    if box is None:
        rollout = sampler.sample(prompt_ids, keys, params)
    elif box.rollout is not None:
        episodes, extra = custom_rollout(box.rollout, box.rollout_name, sampler, tok, prompts, prompt_ids, keys,
                                         params, fields)
        rollout = episodes.rollout
        fields |= extra
    else:
        episodes = sample_episodes(sampler, tok, box, prompts, prompt_ids, keys, params, end_of_turn_id(tok))
        rollout, messages = episodes.rollout, episodes.messages  # TRL's: every assistant and tool turn
        if box.factory is not None:
            fields["environments"] = episodes.environments
    texts = [tok.decode(c, skip_special_tokens=True) for c in rollout.completions]
    owners = [prompts[i // params.group] for i in range(len(texts))]
    return rollout, texts, messages or [completion_for_rewards(t, p) for t, p in zip(texts, owners, strict=True)]


def with_advantages(rollout: Rollout, texts: list[str], per_func: torch.Tensor, rewards: RewardSet, g: GrpoConfig,
                    objective: str = "grpo", all_reduce: AllReduce | None = None) -> ScoredRound:
    """The round's advantages (grpo's, or rloo's leave-one-out) and loss mask."""
    weights = rewards.weight_tensor
    if objective == "rloo":
        scored = rloo_advantages(per_func, weights, g.group, g.normalize_advantages)
    elif g.scale_rewards == "batch":
        scored = _batch_scaled(per_func, weights, g.group, all_reduce)
    else:
        scored = group_advantages(per_func, weights, g.group, g.scale_rewards)
    truncated = torch.tensor(rollout.truncated, dtype=torch.bool)
    loss_mask = (~truncated).float() if g.mask_truncated_completions else torch.ones(len(texts))
    return ScoredRound(rollout, texts, per_func, scored, loss_mask)


def _warn(line: str) -> None:
    if not tdist.is_initialized() or tdist.get_rank() == 0:
        print(line, flush=True)


def check_applied(per_func: torch.Tensor, rewards: RewardSet, all_reduce: AllReduce | None = None) -> None:
    """A round in which every reward returned None for every completion trains nothing (advantages, loss and
    gradient 0) and its metrics look calm (frac_reward_zero_std counts no group whose std is undefined, as TRL's):
    in the run's first round that is a function that never applies (it reads the wrong field, say), so the run
    stops; in a later round it is one warning a run, as is one reward None throughout the first round while
    another scores. Counted over every rank, so every rank decides alike."""
    applied = (~torch.isnan(per_func)).sum(0).double()
    counts = torch.cat([applied, applied.new_tensor([len(per_func)])])  # per reward, then the completions
    if all_reduce is not None:
        all_reduce(counts, "sum")
    *scored, n = (int(x) for x in counts.tolist())
    first, rewards.rounds = rewards.rounds == 0, rewards.rounds + 1
    unused = [r.name for r, k in zip(rewards.rewards, scored, strict=True) if k == 0]
    if not n or not unused:
        return
    if len(unused) == len(rewards.rewards):
        if first:
            raise ShardlmError(f"every reward ({', '.join(unused)}) returned None for all {n} completions of the "
                               "first generation round, so the run would learn nothing (advantages, loss and "
                               "gradient 0): make each function return a float where it can score a completion "
                               "(None only where it cannot), and check the fields it reads.")
        if not rewards.warned:
            rewards.warned = True
            _warn(f"warning: every reward ({', '.join(unused)}) returned None for all {n} completions of generation "
                  f"round {rewards.rounds}, which trains nothing (advantages 0): if it recurs, check what the "
                  "functions return (warned once)")
    elif first:
        for name in unused:
            _warn(f"warning: reward '{name}' returned None for all {n} completions of the first generation round, "
                  "so it adds nothing to their rewards (the others train): if it should apply to these prompts, "
                  "check the fields it reads")


def round_metrics(r: ScoredRound, names: list[str], all_reduce: AllReduce | None = None) -> dict[str, float]:
    """TRL's generation metrics of a round, over every rank: each reward's mean and std (where it applied), the
    weighted reward's, the share of completions whose group's rewards are all equal, completion lengths (all, and
    those that ended with a stop token) and the share cut at max_completion_length."""
    marks = r.rollout.trainable  # with tools, TRL's lengths count the model's tokens only
    lengths = torch.tensor([sum(m) for m in marks] if marks else [len(c) for c in r.rollout.completions],
                           dtype=torch.double)
    terminated = ~torch.tensor(r.rollout.truncated, dtype=torch.bool)
    columns = [*r.per_func.double().unbind(1), r.scored.rewards.double()]
    stats = []
    for x in columns:
        ok = ~torch.isnan(x)
        stats += [x[ok].sum(), (x[ok] ** 2).sum(), ok.sum().double()]
    stats += [lengths.sum(), torch.tensor(float(len(lengths)), dtype=torch.double), lengths[terminated].sum(),
              terminated.sum().double(), r.scored.std_zero.double().sum()]
    sums = torch.stack(stats)
    extremes = torch.stack([-lengths.min(), lengths.max()]) if len(lengths) else torch.zeros(2, dtype=torch.double)
    if all_reduce is not None:
        all_reduce(sums, "sum")
        all_reduce(extremes, "max")  # (-min, max)
    out: dict[str, float] = {}
    for j, name in enumerate([*(f"rewards/{n}" for n in names), "reward"]):
        total, squares, n = sums[3 * j:3 * j + 3].tolist()
        key = name if name == "reward" else f"{name}/mean"
        out[key] = total / n if n else math.nan
        std = math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else math.nan
        out["reward_std" if name == "reward" else f"{name}/std"] = std
    length_sum, count, term_sum, term_count, zero_std = sums[3 * len(columns):].tolist()
    out |= {"frac_reward_zero_std": zero_std / max(count, 1), "completions/mean_length": length_sum / max(count, 1),
            "completions/min_length": -extremes[0].item(), "completions/max_length": extremes[1].item(),
            "completions/clipped_ratio": 1 - term_count / max(count, 1),
            "completions/mean_terminated_length": term_sum / term_count if term_count else 0.0}
    return out | tool_metrics(r.rollout, all_reduce)


def tool_metrics(rollout: Rollout, all_reduce: AllReduce | None) -> dict[str, float]:
    """Tool episodes, over every rank: calls per completion and the share that failed (TRL's
    tools/call_frequency and tools/failure_frequency), model turns per completion, the share that called a tool."""
    if not rollout.tools:
        return {}
    t = rollout.tools
    sums = torch.tensor([t["calls"], t["failed"], t["turns"], t["calling"], float(len(rollout.completions))],
                        dtype=torch.double)
    if all_reduce is not None:
        all_reduce(sums, "sum")
    calls, failed, turns, calling, n = sums.tolist()
    return {"tools/call_frequency": calls / max(n, 1), "tools/failure_frequency": failed / calls if calls else 0.0,
            "tools/turns": turns / max(n, 1), "tools/calling": calling / max(n, 1)}


@contextlib.contextmanager
def eager() -> Iterator[None]:
    with torch.compiler.set_stance("force_eager"):
        yield


def prompt_split(blocks: Any, what: str) -> PromptRows:
    """The prompts of a split, or a clear error (shardlm.training.checks refuses other data first)."""
    if isinstance(blocks, PromptRows):
        return blocks
    from shardlm import ShardlmError

    raise ShardlmError(f"train.objective=grpo/rloo samples completions of prompts ({{'prompt': ...}} records, or chat "
                       f"data); the {what} data is {type(blocks).__name__}. Give prompt records, or another "
                       "train.objective.")

"""DAPO's dynamic sampling (`grpo.dynamic_sampling`): a group whose completions all got the same reward has
advantage 0 everywhere and teaches nothing, so it is dropped, and more prompts (the next ones in the data order)
are sampled until a round holds as many groups of differing rewards as it trains on, at most
`grpo.dynamic_sampling_max_rounds` extra generation rounds (verl's `filter_groups.max_num_gen_batches`). Past the
cap the round is filled with dropped groups, which train nothing, and that is recorded.

Each candidate round is the next `need` prompts of the data order, every rank sampling a contiguous share; the
groups' rewards are gathered to every rank, so every rank picks the same groups, in data order, whatever the
number of ranks; a rank then takes its share of each step's (the layout of a round without filtering). The data
order advances by every prompt sampled, kept or not, so a resume continues where the run stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from shardlm.objectives.rl.loss import weighted_rewards
from shardlm.objectives.rl.rollout import ScoredRound, eager, prompt_split, sample_and_reward, with_advantages
from shardlm.objectives.rl.sampling import Rollout


@dataclass
class Group:
    """A prompt's sampled group, as every rank sees it after the gather."""
    position: int  # its place in the data order (its sampling key)
    index: int  # its row in the prompt data
    completions: list[list[int]]
    logps: list[list[float]]
    truncated: list[bool]
    texts: list[str]
    per_func: list[list[float]]  # (group, rewards)
    varied: bool  # its rewards differ: it trains


def dynamic_round(rl: Any, loop: Any, position: int) -> tuple[ScoredRound, int, dict[str, float]]:
    """This rank's share of a round of groups with differing rewards, how many prompts of the data order it took,
    and its metrics (`dynamic_sampling/*`)."""
    g, need, world, rank = rl.g, rl.per_step * rl.steps, rl.world, rl.dist.rank
    rows = prompt_split(rl.run.train, "training")
    kept: list[Group] = []
    dropped: list[Group] = []
    taken = rounds = 0
    while len(kept) < need and rounds <= g.dynamic_sampling_max_rounds:
        order = loop.sampler.indices(position + taken, need)
        share = range(rank * need // world, (rank + 1) * need // world)
        prompts = [rows.prompt(int(order[j])) for j in share]
        ids = [rows.token_ids(int(order[j])) for j in share]
        keys = [position + taken + j for j in share]
        with eager(), rl.autocast():
            rollout, texts, per_func = sample_and_reward(rl.sampler, rl.tok, prompts, ids, keys, rl.rewards, g,
                                                         rl.params, rl.all_reduce)
        mine = _groups(rollout, texts, per_func, keys, [int(order[j]) for j in share], rl.rewards.weight_tensor,
                       g.group)
        for group in _gathered(mine, world):
            (kept if group.varied else dropped).append(group)
        taken, rounds = taken + need, rounds + 1
    filled = max(0, need - len(kept))
    chosen = (kept + dropped[:filled])[:need]
    chosen.sort(key=lambda x: x.position)
    scored = _share_of(rl, chosen, rows)
    metrics = {"dynamic_sampling/dropped_groups": float(len(dropped) - min(filled, len(dropped))),
               "dynamic_sampling/generation_rounds": float(rounds), "dynamic_sampling/filled_groups": float(filled)}
    return scored, taken, metrics


def _groups(rollout: Rollout, texts: list[str], per_func: torch.Tensor, keys: list[int], indices: list[int],
            weights: torch.Tensor, size: int) -> list[Group]:
    rewards = weighted_rewards(per_func.float(), weights).view(-1, size)
    out = []
    for p, (key, index) in enumerate(zip(keys, indices, strict=True)):
        span = slice(p * size, (p + 1) * size)
        values = rewards[p][~torch.isnan(rewards[p])]
        varied = values.numel() > 1 and bool((values != values[0]).any())
        out.append(Group(key, index, rollout.completions[span], rollout.logps[span] if rollout.logps else [],
                         rollout.truncated[span], texts[span], per_func[span].tolist(), varied))
    return out


def _gathered(mine: list[Group], world: int) -> list[Group]:
    """Every rank's groups, in rank order (the data order of the candidates): the ranks' own objects, trusted."""
    if world == 1 or not tdist.is_initialized():
        return mine
    everyone: list[list[Group] | None] = [None] * world
    tdist.all_gather_object(everyone, mine)
    return [group for part in everyone for group in (part or [])]


def _share_of(rl: Any, chosen: list[Group], rows: Any) -> ScoredRound:
    """This rank's share of each step's groups, scored as a round of its own (advantages within groups; a batch
    scale over every rank's)."""
    mine = [chosen[j] for j in rl.slots()]
    prompts = [rows.token_ids(x.index) for x in mine]
    rollout = Rollout(prompts, [c for x in mine for c in x.completions], [t for x in mine for t in x.truncated],
                      rl.g.group, [lp for x in mine for lp in x.logps])
    per_func = torch.tensor([v for x in mine for v in x.per_func], dtype=torch.float32)
    texts = [t for x in mine for t in x.texts]
    return with_advantages(rollout, texts, per_func, rl.rewards, rl.g, rl.objective, rl.all_reduce)

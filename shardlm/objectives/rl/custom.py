"""`grpo.rollout_func: module:function` (TRL's `rollout_func`): a round's completions made by the user's function,
for full control of generation (an agent loop, a game, another engine).

It is called once per generation round on each rank, with keywords: `prompts` (one per completion: a prompt's
`group` completions are consecutive, TRL's layout), `prompt_ids` (their rendered ids), `generate`, `tokenizer` and
the data's fields (one value per completion). `generate(prompt_ids, rows=None, max_tokens=None)` samples one
continuation of each id list with the run's sampler and settings and returns (ids, log-probabilities) pairs; row
`rows[i]` (default i) seeds it with its call count, so a deterministic function makes the same round on any world
size and after a resume. It returns a dict:

- `completion_ids` (required): one token list per completion;
- `env_mask` (or `loss_mask`): 1 for the tokens the loss trains, 0 for those it only reads (an environment's);
  default all 1;
- `logprobs`: the sampler's log-probability of each completion token, or None (the importance-sampling
  correction then has nothing to weigh);
- `prompt_ids`: one per completion, equal within a prompt's group (default the given);
- any other key: a list of one value per completion, given to the reward functions as a field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from shardlm import ShardlmError
from shardlm.data.prompts import RLPrompt
from shardlm.objectives.rl.multiturn import Episodes, turn_key
from shardlm.objectives.rl.sampling import Rollout, Sampler, SamplingParams

RESERVED = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "loss_mask")


def custom_rollout(fn: Callable, name: str, sampler: Sampler, tok, prompts: list[RLPrompt],
                   prompt_ids: list[list[int]], keys: Sequence[int], params: SamplingParams,
                   fields: dict[str, list]) -> tuple[Episodes, dict[str, list]]:
    """The round `fn` makes, as episodes, and the extra fields it returned for the rewards."""
    group = params.group
    rows = len(prompts) * group
    calls = [0]

    def generate(ids: list[list[int]], rows: Sequence[int] | None = None, max_tokens: int | None = None
                 ) -> list[tuple[list[int], list[float]]]:
        calls[0] += 1
        which = list(rows) if rows is not None else list(range(len(ids)))
        out = sampler.sample(ids, [turn_key(keys[r // group], r % group, 1000 + calls[0]) for r in which],
                             replace(params, group=1, max_tokens=max_tokens or params.max_tokens))
        logps = out.logps or [[0.0] * len(c) for c in out.completions]
        return [(list(c), list(x)) for c, x in zip(out.completions, logps, strict=True)]

    got = fn(prompts=[prompts[r // group].prompt for r in range(rows)],
             prompt_ids=[list(prompt_ids[r // group]) for r in range(rows)], generate=generate, tokenizer=tok,
             **fields)
    if not isinstance(got, dict) or "completion_ids" not in got:
        raise ShardlmError(f"grpo.rollout_func '{name}' returned {type(got).__name__}"
                           f"{' without completion_ids' if isinstance(got, dict) else ''}: it must return a dict "
                           "with completion_ids (one token list per completion) and optionally env_mask, logprobs, "
                           "prompt_ids and fields for the rewards.")
    completions = [list(map(int, c)) for c in _per_row(got, "completion_ids", rows, name)]
    mask = got.get("env_mask", got.get("loss_mask"))
    trainable = [[1] * len(c) for c in completions] if mask is None else \
        [list(map(int, m)) for m in _per_row({"env_mask": mask}, "env_mask", rows, name)]
    logps = [[0.0] * len(c) for c in completions] if got.get("logprobs") is None else \
        [[float(x) for x in lp] for lp in _per_row(got, "logprobs", rows, name)]
    checked: tuple[tuple[str, list[list]], ...] = (("env_mask", trainable), ("logprobs", logps))
    for what, values in checked:
        if any(len(v) != len(c) for v, c in zip(values, completions, strict=True)):
            raise ShardlmError(f"grpo.rollout_func '{name}' returned {what} for a completion in another length "
                               "than the completion's: give one value per completion token.")
    ids = [list(p) for p in prompt_ids]
    if got.get("prompt_ids") is not None:
        given = _per_row(got, "prompt_ids", rows, name)
        for p in range(len(prompts)):
            if any(list(given[p * group + j]) != list(given[p * group]) for j in range(group)):
                raise ShardlmError(f"grpo.rollout_func '{name}' returned different prompt_ids for the completions of "
                                   "one prompt: a prompt's group shares its prompt (the advantages compare them).")
            ids[p] = list(map(int, given[p * group]))
    extra = {k: _per_row(got, k, rows, name) for k in got if k not in RESERVED}
    truncated = [not c or c[-1] not in params.stop for c in completions]
    rollout = Rollout(ids, completions, truncated, group, logps, trainable)
    return Episodes(rollout, [], []), extra


def _per_row(got: dict, key: str, rows: int, name: str) -> list[Any]:
    values = got[key]
    if not isinstance(values, (list, tuple)) or len(values) != rows:
        size = f"{len(values)} items" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise ShardlmError(f"grpo.rollout_func '{name}' returned {key} as {size} for the round's {rows} "
                           "completions: give a list of one per completion.")
    return list(values)

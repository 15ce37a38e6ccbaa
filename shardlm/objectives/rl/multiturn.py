"""Tool-calling episodes (TRL's `_tool_call_loop`): the model's turn, its calls run, their results appended as the
template's tool turn, generation resumed from there, until a turn calls nothing, `max_tool_calling_iterations`
rounds of calls have run, or `max_completion_length` is spent.

The completion is every model turn and every tool turn between them, one token list; `Rollout.trainable` marks
the tool turns' tokens 0: they are context for the turns after them, and out of the loss, the KL, the entropy and
the importance weights. Tool calls count against max_completion_length: a tool turn that would not fit is not
appended (its call ran and is counted, as in TRL) and the episode ends there; a model turn is cut to what is left,
and a completion that does not end in a stop token is truncated.

Seeds: the first turn is sampled exactly as without tools (a prompt's key, sample j); turn t of sample j is its
own row of a group-1 round keyed by (the prompt's key, j, t), so 2 ranks sample what 1 process samples and a
resumed run what the uninterrupted one sampled. Rows of a round are sampled together with the longest budget
among them and each is cut to its own, which is exact: every row draws from its own random stream.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from shardlm import ShardlmError
from shardlm.data.prompts import RLPrompt
from shardlm.objectives.rl.sampling import Rollout, Sampler, SamplingParams, row_seed
from shardlm.objectives.rl.tools import Toolbox, parse_calls, run_call, tool_turn_ids

TURN_STREAM = 0x746F6F6C5475726E  # the later turns' keys, apart from the prompts' own


@dataclass
class Episodes:
    rollout: Rollout  # with `trainable` and `tools` (sums: calls, failed, turns, episodes that called)
    messages: list[list[dict]]  # each completion as TRL gives it to the rewards: assistant and tool turns
    environments: list[Any]  # each completion's environment (None without environment_factory)


def turn_key(key: int, sample: int, turn: int) -> int:
    return row_seed(TURN_STREAM, key, (sample << 16) | turn)


def with_observation(tok, prompt: RLPrompt, observation: str, schemas: list[dict]) -> list[int]:
    """The prompt's ids with reset's observation appended to its last message (TRL's rule)."""
    from shardlm.data.prompts import prompt_token_ids

    assert isinstance(prompt.prompt, list)  # a text prompt with tools is refused when the prompts are rendered
    messages = copy.deepcopy(prompt.prompt)
    messages[-1] = {**messages[-1], "content": str(messages[-1].get("content") or "") + observation}
    return prompt_token_ids(tok, RLPrompt(messages, prompt.fields), tools=schemas)


def first_turn_prompts(tok, box: Toolbox, prompts: list[RLPrompt], prompt_ids: list[list[int]], group: int
                       ) -> tuple[list[tuple[dict, Any]], list[list[int]]]:
    """Each completion's (tools, environment) and each prompt's ids, reset's observation in them."""
    episodes, ids = [], list(prompt_ids)
    for p, prompt in enumerate(prompts):
        made = [box.episode(prompt.fields) for _ in range(group)]
        seen = {obs for _, _, obs in made}
        if len(seen) > 1:
            raise ShardlmError(f"{box.factory.__name__ if box.factory else 'the environment'}.reset gave the "
                               f"completions of one prompt different observations ({sorted(map(str, seen))[:2]}): "
                               "a prompt's group must start alike. Derive what reset randomizes from the prompt's "
                               "fields (e.g. a seed field).")
        observation = seen.pop()
        if observation:
            ids[p] = with_observation(tok, prompt, observation, box.schemas)
        episodes += [(tools, env) for tools, env, _ in made]
    return episodes, ids


def sample_episodes(sampler: Sampler, tok, box: Toolbox, prompts: list[RLPrompt], prompt_ids: list[list[int]],
                    keys: Sequence[int], params: SamplingParams, end_of_turn: int) -> Episodes:
    group, limit = params.group, params.max_tokens
    episodes, ids = first_turn_prompts(tok, box, prompts, prompt_ids, group)
    first = sampler.sample(ids, keys, params)
    completions = [list(c) for c in first.completions]
    logps = [list(x) for x in first.logps] if first.logps else [[0.0] * len(c) for c in completions]
    trainable = [[1] * len(c) for c in completions]
    ended = list(first.truncated)
    messages, calls = [], []
    for c in completions:
        message, found = assistant_turn(tok, c, box.format)
        messages.append([message])
        calls.append(found)
    stats = {"calls": 0.0, "failed": 0.0, "turns": float(len(completions)), "calling": 0.0}
    active = [r for r, found in enumerate(calls) if found and not ended[r]]
    stats["calling"] = float(len(active))
    rounds = 0
    while active and rounds < box.max_iterations:
        contexts, row_keys, going = [], [], []
        for r in active:
            tools = episodes[r][0]
            results = [run_call(tools, call, box.timeout) for call in calls[r]]
            stats["calls"] += len(results)
            stats["failed"] += sum(failed for _, failed in results)
            said = [{"role": "tool", "name": call.name or "unknown", "content": content}
                    for call, (content, _) in zip(calls[r], results, strict=True)]
            suffix = tool_turn_ids(tok, said, end_of_turn)
            if len(completions[r]) + len(suffix) > limit:
                continue  # no room for the tool's turn: the episode ends with the call (it ran, as in TRL)
            messages[r] += said
            completions[r] += suffix
            trainable[r] += [0] * len(suffix)
            logps[r] += [0.0] * len(suffix)
            if len(completions[r]) < limit:
                contexts.append(ids[r // group] + completions[r])
                row_keys.append(turn_key(keys[r // group], r % group, rounds + 1))
                going.append(r)
        if not going:
            break
        budget = max(limit - len(completions[r]) for r in going)
        more = sampler.sample(contexts, row_keys, replace(params, group=1, max_tokens=budget))
        active = []
        for k, r in enumerate(going):
            new = list(more.completions[k][:limit - len(completions[r])])
            completions[r] += new
            trainable[r] += [1] * len(new)
            logps[r] += list(more.logps[k][:len(new)]) if more.logps else [0.0] * len(new)
            stats["turns"] += 1
            message, calls[r] = assistant_turn(tok, new, box.format)
            messages[r].append(message)
            if calls[r] and new and new[-1] in params.stop:
                active.append(r)
        rounds += 1
    truncated = [not c or c[-1] not in params.stop for c in completions]
    rollout = Rollout(ids, completions, truncated, group, logps, trainable, stats)
    return Episodes(rollout, messages, [env for _, env in episodes])


def assistant_turn(tok, ids: list[int], fmt: str) -> tuple[dict, list]:
    """A model turn as a message (its calls as `tool_calls`, TRL's shape) and the calls it makes."""
    text = tok.decode(ids, skip_special_tokens=True)
    found = parse_calls(text, fmt)
    message: dict = {"role": "assistant", "content": text}
    if found:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in found]
    return message, found

"""Online RL's inputs that used to fail silently or misleadingly: a null `answer` (scored against the text
"None"), rewards that return None for everything (loss and gradient 0 for the whole run), a reward that returns a
string, a field a few records lack (named without a path:line), and sample lines that ran past a screen's width."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from shardlm import ShardlmError
from shardlm.config import DataConfig, GrpoConfig
from shardlm.data.prompt_cache import build_prompts, load_prompts
from shardlm.data.prompts import RLPrompt, prompt_rows, rl_prompt
from shardlm.data.sources import resolve
from shardlm.objectives.rl.rewards import Reward, RewardSet, exact_match, load_rewards, numeric, partial_match
from shardlm.objectives.rl.rollout import round_metrics, sampling_params, score_round
from shardlm.objectives.rl.sampling import Rollout
from shardlm.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _records(n: int = 40, null_at: int = 16, drop: bool = False) -> list[dict]:
    out = [{"prompt": f"Say {i}", "answer": str(i)} for i in range(n)]
    if drop:
        del out[null_at]["answer"]
    else:
        out[null_at]["answer"] = None
    return out


# ---- 1. a null answer is no answer -------------------------------------------------------------------------------


def test_a_null_answer_is_no_answer():
    """`"answer": null` is left out of the fields (so a completion or the chat's last answer stands in), and the
    built-ins never compare with the text 'None'."""
    assert "answer" not in rl_prompt({"prompt": "Q", "answer": None}, "p.jsonl:1").fields
    assert rl_prompt({"prompt": "Q", "completion": "A", "answer": None}, "p.jsonl:2").fields == {"answer": "A"}
    chat = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "answer": None}
    assert rl_prompt(chat, "c.jsonl:1").fields == {"answer": "A"}
    assert exact_match(["None", "x"], [None, "x"]) == [None, 1.0]
    assert partial_match(["None"], [None]) == [None] and numeric(["1"], [None]) == [None]


@pytest.mark.parametrize("drop", [False, True], ids=["null", "missing"])
def test_a_record_without_answer_is_named_with_its_place(tok, tmp_path, drop):
    """One record of 40 with a null (or no) answer: exact_match is refused naming that record's path:line and how
    many lack it, from the prompt cache and from records in memory alike."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(drop=drop)))
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    cached = load_prompts(build_prompts(resolve(str(path), "train", None), tok, cfg, tmp_path / "cache",
                                        log=lambda _: None))
    for rows, where in ((cached, f"{path}:17"), (prompt_rows(_records(drop=drop), tok, cfg, where="mem"), "mem:17")):
        assert "answer" not in rows.field_names
        with pytest.raises(ShardlmError) as e:
            load_rewards(GrpoConfig(rewards=["exact_match"]), rows.field_names)
        message = str(e.value)
        assert "reward 'exact_match' needs the field 'answer', which 1 of the 40 prompts lack" in message
        assert f"(the first: {where}" in message and "add it to every record" in message and "\n" not in message
    held_out = cached.share(30)  # a split of the set keeps what the set lacks
    with pytest.raises(ShardlmError, match=f"the first: {path}:17"):
        load_rewards(GrpoConfig(rewards=["exact_match"]), held_out.field_names)


# ---- 2. rewards that are all None ---------------------------------------------------------------------------------


class FixedSampler:
    """Hands back the same completions whatever it is asked (a round's rewards are all that matter here)."""

    def __init__(self, completions: list[list[int]], group: int):
        self.completions, self.group = completions, group

    def sample(self, prompts, keys, params) -> Rollout:  # noqa: ARG002
        return Rollout([list(p) for p in prompts], self.completions, [False] * len(self.completions), self.group)


def _round(rewards: RewardSet, n: int = 4, group: int = 2, scale: str = "group", all_reduce=None):
    """A training round of `n` completions of `n / group` prompts, scored by `rewards`."""
    prompts = [RLPrompt(f"p{k}", {}) for k in range(n // group)]
    completions = [list(b"ab"[: 1 + i % 2]) for i in range(n)]
    g = GrpoConfig(group=group, max_completion_length=4, scale_rewards=scale)
    return score_round(FixedSampler(completions, group), byte_tokenizer(), prompts, [list(b"p") for _ in prompts],
                       range(len(prompts)), rewards, g, sampling_params(g, [], 0), all_reduce=all_reduce)


def _fixed(values: list) -> RewardSet:
    """One reward that gives completion i `values[i]` (None where it does not apply)."""
    return RewardSet([Reward("fixed", lambda completions, **_: list(values)[:len(completions)], ())], [1.0])


def test_rewards_all_none_stop_the_first_round_and_warn_later(capsys):
    """Every reward None for every completion of the first round: the run would learn nothing, so it stops in one
    line naming the functions; a later such round (after rounds that scored) warns once."""
    none = Reward("rewards:never", lambda completions, **_: [None] * len(completions), ())
    nothing = Reward("rewards:nothing", lambda completions, **_: [None] * len(completions), ())
    with pytest.raises(ShardlmError) as e:
        _round(RewardSet([none, nothing], [1.0, 1.0]))
    message = str(e.value)
    assert "every reward (rewards:never, rewards:nothing) returned None for all 4 completions of the first " \
           "generation round" in message and "\n" not in message and ": make " in message
    _round(RewardSet([none], [1.0]), all_reduce=lambda t, op: t.add_(1))  # another rank's completions scored
    switch = {"on": True}
    sometimes = Reward("rewards:sometimes", lambda completions, **_: [1.0 if switch["on"] else None] * len(
        completions), ())
    rewards = RewardSet([sometimes], [1.0])
    _round(rewards)
    switch["on"] = False
    _round(rewards)
    _round(rewards)
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "rewards:sometimes" in warnings[0] and "returned None for all 4" in warnings[0]


def test_one_reward_all_none_in_the_first_round_warns(capsys):
    """One reward None everywhere while another scores: the run learns from the other, with one warning."""
    none = Reward("rewards:never", lambda completions, **_: [None] * len(completions), ())
    some = Reward("rewards:some", lambda completions, **_: [float(len(c)) for c in completions], ())
    rewards = RewardSet([some, none], [1.0, 1.0])
    _round(rewards)
    _round(rewards)
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "reward 'rewards:never' returned None for all 4 completions" in warnings[0]


def _trl_frac_zero_std(per_func: torch.Tensor, group: int, scale: str) -> float:
    """TRL 1.16's `frac_reward_zero_std` (GRPOTrainer._generate_and_score_completions, sum_then_normalize)."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = per_func.nansum(dim=1)
    rewards[unscorable] = torch.nan
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
    return torch.isclose(std, torch.zeros_like(std)).float().mean().item()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("values", [
    [1.0, None, None, None, 2.0, 2.0],  # a group with one scored completion, one all None, one with equal rewards
    [1.0, 0.0, None, None, 0.5, 0.5],
    [None, 3.0, None, None, None, None],  # one scored completion in the whole batch
    [None] * 6,  # none at all (a later round: it warns, and is measured)
], ids=["one-scored", "mixed", "batch-of-one", "all-none"])
def test_frac_reward_zero_std_is_trls(scale, values):
    """TRL's definition: a group (or batch) whose std is undefined (fewer than 2 scored completions) does not count
    as zero std; the all-None round is caught by check_applied instead."""
    rewards = _fixed(values)
    rewards.rounds = 1
    r = _round(rewards, n=len(values), scale=scale)
    got = round_metrics(r, rewards.metric_names)["frac_reward_zero_std"]
    assert got == pytest.approx(_trl_frac_zero_std(r.per_func, 2, scale))


# ---- 3. messages that named the wrong thing -----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0.5", "abc"])
def test_a_reward_that_returns_text_says_so(value):
    rewards = RewardSet([Reward("rewards:text", lambda completions, **_: value, ())], [1.0])
    with pytest.raises(ShardlmError) as e:
        rewards.score(["a", "b"], ["x", "y"], [[1], [2]], {})
    assert f"reward 'rewards:text' returned a str ({value!r}), not a list of numbers: it must return one float" \
           in str(e.value) and "values for" not in str(e.value)


# ---- 4. the sample lines a run prints ------------------------------------------------------------------------------


def test_sample_lines_are_bounded(tok):
    """A long completion (or a prompt whose tail repr escapes) is cut to a bounded line, with an ellipsis."""
    from shardlm.objectives.rl.step import RLStep

    prompt = list(("\x01" * 100).encode())  # each byte's repr is 4 characters
    long = "é" * 100 + "\x02" * 100
    scored = SimpleNamespace(rollout=SimpleNamespace(prompts=[prompt]), per_func=torch.tensor([[1.0, math.nan]] * 2))
    step = SimpleNamespace(round=SimpleNamespace(scored=scored, texts=[long, "ok"]), g=SimpleNamespace(group=2),
                           tok=tok, rewards=SimpleNamespace(metric_names=["exact_match", "fmt"]))
    lines = RLStep.sample_lines(step)  # type: ignore[arg-type]
    assert len(lines) == 1 and len(lines[0]) <= 200, lines
    assert "..." in lines[0] and "exact_match 1.00" in lines[0] and "fmt nan" in lines[0]
    step.round.texts = ["short", "ok"]
    assert "'short'" in RLStep.sample_lines(step)[0]  # type: ignore[arg-type]


def test_the_closing_answers_of_an_rl_run_are_as_long_as_its_completions():
    """A run ends with greedy answers to held-out prompts; online RL's are capped at its completions' length
    (train.sample_tokens=200 answers ran on past what grpo.max_completion_length=16 trained)."""
    from shardlm.config import load_config
    from shardlm.objectives import objective_family

    cfg = load_config(None, ["train.objective=grpo", "grpo.max_completion_length=16"])
    assert objective_family("grpo").answer_tokens(cfg) == 16
    assert objective_family("sft").answer_tokens(load_config(None, [])) == 200

"""Online RL from rewards (objectives.rl): the loss and advantages equal TRL 1.16's (`GRPOTrainer._compute_loss` and
`RLOOTrainer._compute_loss` called on fixed inputs; the advantage lines of `_generate_and_score_completions`
mirrored), the rewards and their one-line errors, and the sampler (seeded per prompt and sample, KV cache,
stop tokens; FSDP2 gathered once per round on 2 gloo ranks)."""

from __future__ import annotations

import json
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from helpers import run_script
from shardlm import ShardlmError
from shardlm.config import GrpoConfig
from shardlm.objectives.rl.loss import (
    clip_counts,
    group_advantages,
    rloo_advantages,
    rloo_loss,
    step_loss,
    token_loss,
)
from shardlm.objectives.rl.rewards import load_rewards
from shardlm.objectives.rl.sampling import Rollout, SamplingParams, TransformersSampler, pick

# ---- the loss and the advantages against TRL ------------------------------------------------------------------


def _inputs(seed: int = 0, rows: int = 6, length: int = 5):
    """Log-probabilities (policy, old, reference), a mask of completions of different lengths, and advantages with
    a zero-advantage group (rows 4-5) and ratios far enough from 1 that both clip sides bite."""
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(rows, length, generator=g) * 3).requires_grad_()
    old = logps.detach() + (torch.rand(rows, length, generator=g) - 0.5) * 0.8
    ref = logps.detach() + (torch.rand(rows, length, generator=g) - 0.5) * 0.4
    mask = torch.ones(rows, length)
    for i, n in enumerate([5, 3, 1, 4, 2, 5]):
        mask[i, n:] = 0
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.0, 0.0])
    return logps, old, ref, mask, advantages


def _trl_grpo_loss(logps, old, ref, mask, advantages, **args):
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    me = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, aux_loss_enabled=False, use_vllm=False,
        _entropy_bonus_enabled=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=args["delta"], steps_per_generation=1),
        epsilon_low=args["epsilon"], epsilon_high=args["epsilon_high"], beta=args["beta"],
        loss_type=args["loss_type"], importance_sampling_level=args["level"],
        max_completion_length=args["max_completion_length"])
    zeros = torch.zeros(mask.shape[0], 1, dtype=torch.long)
    inputs = {"prompt_ids": zeros, "prompt_mask": zeros, "completion_ids": mask.long(), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    return GRPOTrainer._compute_loss(me, None, inputs), me._metrics["train"]


@pytest.mark.parametrize("loss_type,beta,level,delta", [("dapo", 0.0, "token", None), ("grpo", 0.04, "token", None),
                                                        ("dr_grpo", 0.0, "sequence", None),
                                                        ("dapo", 0.1, "token", 1.5)])
def test_loss_and_gradient_are_trls(loss_type, beta, level, delta):
    logps, old, ref, mask, advantages = _inputs()
    args = {"loss_type": loss_type, "beta": beta, "level": level, "delta": delta, "epsilon": 0.2,
            "epsilon_high": 0.28, "max_completion_length": 7}
    theirs, metrics = _trl_grpo_loss(logps, old, ref, mask, advantages, **args)
    (want,) = torch.autograd.grad(theirs, logps)
    parts = token_loss(logps, old, advantages, mask, 0.2, 0.28, beta, ref, delta, level)
    # two micro-batches of 3 completions: their shares add up to the step's loss
    mine = sum(step_loss(parts.per_token[rows], mask[rows], loss_type, completions=6, tokens=mask.sum().item(),
                         max_completion_length=7) for rows in (slice(0, 3), slice(3, 6)))
    (got,) = torch.autograd.grad(mine, logps)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(got, want)
    counts = clip_counts(parts.ratio, advantages, mask, 0.2, 0.28)
    assert counts.low / counts.tokens == pytest.approx(metrics["clip_ratio/low_mean"][0])
    assert counts.high / counts.tokens == pytest.approx(metrics["clip_ratio/high_mean"][0])
    assert level == "sequence" or counts.low > 0 and counts.high > 0  # tokens clip, on both sides
    if beta:
        kl = (parts.kl * mask).sum() / mask.sum()
        assert kl.item() == pytest.approx(metrics["kl"][0])


def test_first_step_ratio_is_one_kl_zero_and_the_gradient_is_the_policy_gradient():
    """μ = 1: old log-probabilities are the current ones detached, and the reference is the initial policy."""
    logps, _, _, mask, advantages = _inputs(seed=1)
    parts = token_loss(logps, None, advantages, mask, beta=0.04, ref_logps=logps.detach())
    assert torch.equal(parts.ratio, torch.ones_like(parts.ratio)) and torch.equal(parts.kl, torch.zeros_like(mask))
    loss = step_loss(parts.per_token, mask, "dapo", completions=6, tokens=mask.sum().item(), max_completion_length=5)
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(grad, -advantages[:, None] * mask / mask.sum())
    assert grad[4:].abs().sum() == 0  # a group whose rewards are all equal teaches nothing


def _trl_grpo_advantages(rewards_per_func, reward_weights, num_generations, scale_rewards):
    """The lines of TRL 1.16's GRPOTrainer._generate_and_score_completions ("sum_then_normalize"), as written."""
    from trl.trainer.utils import nanstd

    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return torch.nan_to_num(advantages, nan=0.0), is_std_zero


def _trl_rloo_advantages(rewards_per_func, reward_weights, num_generations, normalize, kl, beta):
    """The lines of TRL 1.16's RLOOTrainer._generate_and_score_completions, as written."""
    from trl.trainer.utils import nanstd

    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    rewards = rewards - beta * kl
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    advantages = rewards - baselines.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


NAN = math.nan
# 3 groups of 4 completions, 2 functions: a group with a None (NaN) and an unscorable completion, a group whose
# rewards are all equal, an ordinary one
PER_FUNC = torch.tensor([[1.0, NAN], [0.0, 0.5], [NAN, NAN], [1.0, 1.0],
                         [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0],
                         [0.0, 0.2], [1.0, 0.9], [0.5, 0.1], [0.0, 0.0]])
WEIGHTS = torch.tensor([1.0, 0.5])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_are_trls(scale):
    pytest.importorskip("trl")
    want, zero_std = _trl_grpo_advantages(PER_FUNC.clone(), WEIGHTS, 4, scale)
    got = group_advantages(PER_FUNC, WEIGHTS, 4, scale)
    torch.testing.assert_close(got.advantages, want)
    assert torch.equal(got.std_zero, zero_std)
    assert got.advantages[2] == 0 and torch.isnan(got.rewards[2])  # unscorable: no advantage, out of the mean
    if scale != "batch":
        assert got.advantages[4:8].abs().sum() == 0 and got.std_zero[4:8].all()


@pytest.mark.parametrize("normalize,beta", [(False, 0.0), (True, 0.05)])
def test_rloo_advantages_are_trls(normalize, beta):
    pytest.importorskip("trl")
    kl = torch.linspace(0.0, 2.2, 12)
    want = _trl_rloo_advantages(PER_FUNC.clone(), WEIGHTS, 4, normalize, kl, beta)
    got = rloo_advantages(PER_FUNC, WEIGHTS, 4, normalize, kl, beta)
    torch.testing.assert_close(got.advantages, want)
    if not normalize:  # leave-one-out: r - mean of the other scorable completions of the group
        assert got.advantages[9].item() == pytest.approx(1.45 - (0.1 + 0.55 + 0.0) / 3)


def test_rloo_loss_is_trls():
    pytest.importorskip("trl")
    from trl.trainer.rloo_trainer import RLOOTrainer

    logps, old, _, mask, advantages = _inputs(seed=2)
    old_seq = (logps.detach() * mask).sum(1) + torch.tensor([0.3, -0.3, 0.1, -0.05, 0.0, 0.2])
    me = SimpleNamespace(_get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
                         aux_loss_enabled=False, epsilon_low=0.2, epsilon_high=0.2,
                         model=SimpleNamespace(training=True), _metrics=defaultdict(lambda: defaultdict(list)),
                         accelerator=SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x))
    zeros = torch.zeros(6, 1, dtype=torch.long)
    theirs = RLOOTrainer._compute_loss(me, None, {"prompt_ids": zeros, "prompt_mask": zeros, "completion_ids":
                                                  mask.long(), "completion_mask": mask, "old_logps": old_seq,
                                                  "advantages": advantages})
    mine, ratio = rloo_loss(logps, old_seq, advantages, mask, completions=6)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(mine, logps)[0], torch.autograd.grad(theirs, logps)[0])
    assert ((ratio > 1.2) | (ratio < 0.8)).any()  # clipped completions are among them


# ---- rewards -----------------------------------------------------------------------------------------------------


def _score(names, fields, completions, **g):
    rewards = load_rewards(GrpoConfig(rewards=names, **g), list(fields))
    ids = [[0] * len(str(c)) for c in completions]
    return rewards.score(["p"] * len(completions), completions, ids, fields)


def test_builtin_rewards():
    from shardlm.inference.exact_match import Scored

    answers = ["cba", "HELLO", "7", "12"]
    completions = [" cba\n", "HELlo", "It is 7.", "1,2 or 13"]
    scores = _score(["exact_match", "partial_match", "numeric"], {"answer": answers}, completions)
    assert scores[:, 0].tolist() == [float(Scored("", a, c).exact) for a, c in zip(answers, completions, strict=True)]
    assert scores[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert scores[:, 1].tolist() == pytest.approx([1.0, (3 + 2 * 0.5) / 5, 0.0, 1 / 9])
    assert scores[2:, 2].tolist() == [1.0, 0.0] and scores[:2, 2].isnan().all()  # no number in the answer: None
    conversational = [[{"role": "assistant", "content": "cba"}]]
    assert _score(["exact_match"], {"answer": ["cba"]}, conversational).item() == 1.0
    fmt = _score(["format"], {}, ["<a>1</a>", "1"], format_pattern=r"<a>\d+</a>")
    assert fmt[:, 0].tolist() == [1.0, 0.0]


def test_length_reward_is_trls_soft_overlong_punishment():
    from trl.rewards import get_soft_overlong_punishment

    ids = [[0] * n for n in (2, 6, 7, 9, 10, 11)]
    rewards = load_rewards(GrpoConfig(rewards=["length"], max_completion_length=10, length_cache=4), [])
    got = rewards.score(["p"] * 6, ["c"] * 6, ids, {})[:, 0].tolist()
    assert got == pytest.approx(get_soft_overlong_punishment(10, 4)(completion_ids=ids))


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def short(prompts, completions, **kwargs):
            return [1.0 if len(c) < 3 else None for c in completions]

        def needs_solution(prompts, completions, solution, **kwargs):
            return [float(c == s) for c, s in zip(completions, solution)]

        def no_kwargs(prompts, completions):
            return [0.0] * len(completions)

        def too_few(prompts, completions, **kwargs):
            return [0.0]

        def nan(prompts, completions, **kwargs):
            return [float("nan") if c == "bad" else 0.0 for c in completions]

        def text(prompts, completions, **kwargs):
            return ["1"] * len(completions)

        def numpy_floats(prompts, completions, **kwargs):
            import numpy
            return [numpy.float32(0.5), numpy.int64(1), None][:len(completions)]

        def raises(prompts, completions, **kwargs):
            return [1.0 / len(c) for c in completions]
        """))
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.chdir(tmp_path)


def test_user_rewards_weighted_with_none(reward_module):
    rewards = load_rewards(GrpoConfig(rewards=["my_rewards:short", "exact_match"], reward_weights=[2.0, 1.0]),
                           ["answer"])
    per_func = rewards.score(["p", "q"], ["ab", "abcd"], [[1, 2], [1, 2, 3, 4]], {"answer": ["ab", "x"]})
    assert per_func[0].tolist() == [1.0, 1.0] and math.isnan(per_func[1, 0]) and per_func[1, 1] == 0.0
    advantages = group_advantages(per_func, rewards.weight_tensor, 2)
    assert advantages.rewards.tolist() == [3.0, 0.0]


@pytest.mark.parametrize("names,fields,message", [
    (["broken:f"], [], "reward 'broken:f': module 'broken' does not import (ModuleNotFoundError"),
    (["my_rewards:shrot"], [], "has no 'shrot'. Did you mean 'short'?"),
    (["my_rewards:no_kwargs"], ["answer"], "cannot be called with prompts, completions, completion_ids"),
    (["my_rewards:needs_solution"], ["answer"], "needs the field 'solution', which the prompt data lacks (its "
                                                "fields: answer)"),
    (["exact_match"], ["solution"], "reward 'exact_match' needs the field 'answer'"),
    (["exact"], [], "neither a built-in (exact_match, partial_match, numeric, format, length) nor module:function."
                    " Did you mean 'exact_match'?"),
    (["format"], [], "grpo.format_pattern, which is not set"),
])
def test_reward_errors_at_load(reward_module, names, fields, message):
    with pytest.raises(ShardlmError) as e:
        load_rewards(GrpoConfig(rewards=names), fields)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name,message", [
    ("too_few", "reward 'my_rewards:too_few' returned 1 values for 3 completions"),
    ("nan", "reward 'my_rewards:nan' returned nan for completion 1 (prompt 'b?')"),
    ("text", "returned '1' (str) for completion 0 (prompt 'a?'): return a float"),
    ("raises", "reward 'my_rewards:raises' raised ZeroDivisionError: float division by zero on completion 2 "
               "(prompt 'c?')"),
])
def test_reward_errors_when_scoring(reward_module, name, message):
    rewards = load_rewards(GrpoConfig(rewards=[f"my_rewards:{name}"]), [])
    with pytest.raises(ShardlmError) as e:
        rewards.score(["a?", "b?", "c?"], ["ok", "bad", ""], [[1], [2], []], {})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_numpy_rewards_are_numbers(reward_module):
    rewards = load_rewards(GrpoConfig(rewards=["my_rewards:numpy_floats"]), [])
    assert rewards.score(["a", "b", "c"], ["x", "y", "z"], [[1]] * 3, {})[:2, 0].tolist() == [0.5, 1.0]


def test_reward_weights_must_match():
    with pytest.raises(ShardlmError, match="grpo.reward_weights has 1 weights for 2 rewards"):
        load_rewards(GrpoConfig(rewards=["exact_match", "numeric"], reward_weights=[1.0]), ["answer"])


# ---- sampling ----------------------------------------------------------------------------------------------------


def _model(seed: int = 0, vocab_size: int = 40, eos: int = 39):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=64, n_layer=2, n_embd=32, n_head=2, bos_token_id=eos,
                     eos_token_id=eos, initializer_range=0.3)
    return GPT2LMHeadModel(cfg).eval()


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [12]]


def test_greedy_equals_generate_and_stops_at_a_stop_token():
    model = _model()
    sampler = TransformersSampler(model, pad=39)
    out = sampler.sample(PROMPTS, range(4), SamplingParams(group=2, max_tokens=6, temperature=0, stop=(39,)))
    for p, prompt in enumerate(PROMPTS):  # generate stops at the model's EOS, 39
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=39)
        assert out.completions[2 * p] == out.completions[2 * p + 1] == want[0, len(prompt):].tolist()
    assert len({tuple(c) for c in out.completions}) > 1
    longest = max(out.completions, key=len)
    stop = {39, longest[1]}  # a second stop token, met inside at least the longest completion
    cut = sampler.sample(PROMPTS, range(4), SamplingParams(group=2, max_tokens=6, temperature=0, stop=tuple(stop)))
    for full, short, truncated in zip(out.completions, cut.completions, cut.truncated, strict=True):
        n = next((i + 1 for i, t in enumerate(full) if t in stop), len(full))
        assert short == full[:n] and truncated == (short[-1] not in stop)
    assert sum(map(len, cut.completions)) < sum(map(len, out.completions))


def test_samples_depend_only_on_prompt_key_and_index():
    """The same (key, sample) gives the same completion whatever the batch around it, its order and the rows
    decoded at once; another key or seed gives others."""
    sampler = TransformersSampler(_model(), pad=39)
    params = SamplingParams(group=3, max_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=5)
    whole = sampler.sample(PROMPTS, [10, 11, 12, 13], params)
    alone = sampler.sample(PROMPTS[2:3], [12], params)
    reordered = TransformersSampler(_model(), pad=39, max_rows=3).sample(PROMPTS[::-1], [13, 12, 11, 10], params)
    assert alone.completions == whole.completions[6:9]
    assert reordered.completions == [c for p in (3, 2, 1, 0) for c in whole.completions[3 * p:3 * p + 3]]
    assert len({tuple(c) for c in whole.completions}) == 12  # samples of a prompt differ
    other = sampler.sample(PROMPTS[2:3], [12], SamplingParams(**{**params.__dict__, "seed": 6}))
    assert other.completions != alone.completions


def test_pick_follows_the_distribution_top_k_and_top_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)
    uniforms = (torch.arange(4000) + 0.5) / 4000
    counts = torch.bincount(pick(logits, uniforms, 1.0, 0, 1.0), minlength=4) / 4000
    torch.testing.assert_close(counts, probs, atol=1e-3, rtol=0)
    top_k = torch.bincount(pick(logits, uniforms, 1.0, 2, 1.0), minlength=4) / 4000
    torch.testing.assert_close(top_k, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-3, rtol=0)
    top_p = torch.bincount(pick(logits, uniforms, 1.0, 0, 0.8), minlength=4) / 4000  # 0.5 + 0.3 reach 0.8
    torch.testing.assert_close(top_p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-3, rtol=0)
    assert pick(logits[:2], uniforms[:2], 0.0, 0, 1.0).tolist() == [0, 0]


def test_rollout_is_trls_layout():
    rollout = Rollout([[5, 6, 7], [8]], [[1, 2], [3], [4, 4, 9], []], [True, False, False, True], group=2)
    t = rollout.padded(pad=0)
    assert t["prompt_ids"].tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 8], [0, 0, 8]]
    assert t["prompt_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert t["completion_ids"].tolist() == [[1, 2, 0], [3, 0, 0], [4, 4, 9], [0, 0, 0]]
    assert t["completion_mask"].sum(1).tolist() == [2, 1, 3, 0]


def test_fsdp2_gathers_once_per_round_and_two_ranks_equal_one(tmp_path):
    """2 gloo ranks, each sampling half the prompts from an FSDP2-sharded model: the completions equal one unsharded
    process's; each unit is all-gathered once per round, not once per token; training afterwards is unchanged."""
    out = tmp_path / "result.json"
    run_script("grpo_gather.py", str(out))
    result = json.loads(out.read_text())
    assert result["completions"] == result["reference"]
    # once each in a round of 6 forwards (the prompts, then 5 new tokens), where a forward alone gathers every unit
    assert result["all_gathers"] == result["per_forward"] == result["units"] == 4 and result["forwards"] == 6
    assert result["resharded"] and result["loss"] == pytest.approx(result["reference_loss"], rel=1e-5)
    assert result["grad_close"]


def test_completion_logps_score_each_row_as_alone():
    """Left padding changes nothing: a row's log-probabilities (at the sampling temperature) are those of its prompt
    and completion forwarded alone."""
    from shardlm.objectives.rl.logps import completion_logps

    model = _model()
    rollout = Rollout([[5, 6, 7], [8]], [[1, 2], [3], [4, 4, 9], [10]], [False] * 4, group=2)
    logps, entropy = completion_logps(model, rollout.padded(pad=39), temperature=0.7, with_entropy=True)
    for i, completion in enumerate(rollout.completions):
        ids = torch.tensor([rollout.prompt_of(i) + completion])
        logits = model(ids).logits[0, -len(completion) - 1:-1] / 0.7
        want = torch.log_softmax(logits, -1)[torch.arange(len(completion)), completion]
        torch.testing.assert_close(logps[i, :len(completion)], want, atol=1e-5, rtol=1e-5)
        assert logps[i, len(completion):].abs().sum() == 0 and entropy[i, len(completion):].abs().sum() == 0
    assert (entropy[:, 0] > 0).all()


def test_a_tiny_model_learns_a_rule_based_reward():
    """Sample, score, normalize in groups, take the clipped-surrogate step: a tiny random model learns to say 7
    (reward: the share of 7s in its completion) in a few steps."""
    from shardlm.objectives.rl.logps import completion_logps
    from shardlm.objectives.rl.rewards import Reward, RewardSet

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend
    try:
        model = _model()
        model.config.initializer_range = 0.02
        model.init_weights()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        sevens = RewardSet([Reward("sevens", lambda completions, **_: [c.count(7) / len(c) for c in completions],
                                   ())], [1.0])
        sampler, means = TransformersSampler(model, pad=39), []
        for step in range(15):
            rollout = sampler.sample(PROMPTS, [4 * step + i for i in range(4)], SamplingParams(group=8, max_tokens=4))
            per_func = sevens.score([], rollout.completions, rollout.completions, {})
            means.append(per_func.mean().item())
            batch = rollout.padded(pad=39)
            logps, _ = completion_logps(model, batch)
            advantages = group_advantages(per_func, sevens.weight_tensor, 8).advantages
            parts = token_loss(logps, None, advantages, batch["completion_mask"])
            loss = step_loss(parts.per_token, batch["completion_mask"], "dapo", completions=32,
                             tokens=batch["completion_mask"].sum().item(), max_completion_length=4)
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    assert means[0] < 0.1 and sum(means[-3:]) / 3 > 0.5, means


# ---- the grpo: section -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,message", [
    (["grpo.group=1"], "grpo.group must be >= 2, got 1"),
    (["train.batch_size=6", "grpo.group=4"], "train.batch_size=6 counts completions, 1.5 prompts' worth at "
                                             "grpo.group=4: set train.batch_size to a multiple of 4 (e.g. 4) or "
                                             "grpo.group to 2 or 3 or 6."),
    (["grpo.loss_type=dr-grpo"], "grpo.loss_type='dr-grpo' is not one of dapo, grpo, dr_grpo. Did you mean 'dr_grpo'?"),
    (["grpo.max_completion_length=128"], "grpo.max_completion_length=128 leaves no room for a prompt in "
                                         "data.seq_len=128"),
    (["grpo.temperature=0"], "grpo.temperature must be > 0 (greedy completions"),
    (["grpo.delta=1.1"], "grpo.delta must be > 1 + epsilon_high = 1.2 (null = off), got 1.1."),
    (["grpo.steps_per_generation=4", "grpo.generation_batch_size=16"], "grpo.steps_per_generation and "
                                                                       "grpo.generation_batch_size are two ways"),
    (["train.grad_accum=2", "grpo.steps_per_generation=3"], "grpo.steps_per_generation=3 counts micro-batches, and "
                                                            "a round feeds whole optimizer steps of "
                                                            "train.grad_accum=2: set it to a multiple of 2"),
])
def test_grpo_section_errors(overrides, message):
    from shardlm.config import load_config
    from shardlm.config.grpo import check_grpo

    cfg = load_config(None, ["train.batch_size=8", "grpo.max_completion_length=64", *overrides])
    with pytest.raises(ShardlmError) as e:
        check_grpo(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_prompt_longer_than_its_room():
    from shardlm.config import load_config
    from shardlm.config.grpo import check_grpo, check_prompt_fits

    cfg = load_config(None, ["data.seq_len=96", "grpo.max_completion_length=64", "train.batch_size=16"])
    check_grpo(cfg)
    check_prompt_fits(32, cfg, "prompts.jsonl:3")
    with pytest.raises(ShardlmError, match=r"prompts.jsonl:3: the prompt has 33 tokens, more than the 32 that "
                                           r"data.seq_len=96 leaves beside grpo.max_completion_length=64"):
        check_prompt_fits(33, cfg, "prompts.jsonl:3")


# ---- prompt records ----------------------------------------------------------------------------------------------


def test_prompt_records_and_their_token_ids():
    """TRL's prompt records, chat data (the last answer is the reference) and prompt/completion data; a chat prompt's
    ids are the ones `eval --exact-match` generates from."""
    from shardlm.data.formats import BadExample, Example
    from shardlm.data.prompts import completion_for_rewards, prompt_token_ids, rl_prompt
    from shardlm.inference.exact_match import prompt_and_reference
    from shardlm.tokenizer import byte_tokenizer, set_chat_template

    tok = byte_tokenizer()
    set_chat_template(tok, "chatml")
    chat = {"messages": [{"role": "user", "content": "Reverse: abc"}, {"role": "assistant", "content": "cba"}],
            "task": "reverse"}
    p = rl_prompt(chat, "heldout.jsonl:1")
    assert p.prompt == chat["messages"][:1] and p.fields == {"answer": "cba", "task": "reverse"}
    ids, reference = prompt_and_reference(tok, Example(messages=chat["messages"]))
    assert prompt_token_ids(tok, p) == ids and reference == p.fields["answer"]
    assert completion_for_rewards("cba", p) == [{"role": "assistant", "content": "cba"}]
    text = rl_prompt({"prompt": "2+2=", "solution": "4"}, "a.jsonl:1", system="Be brief.")
    assert text.prompt == "2+2=" and text.fields == {"solution": "4"} and not text.conversational
    assert prompt_token_ids(tok, text) == list(b"2+2=") and completion_for_rewards("4", text) == "4"
    with_system = rl_prompt({"prompt": [{"role": "user", "content": "hi"}]}, "a.jsonl:2", system="Be brief.")
    assert with_system.prompt[0] == {"role": "system", "content": "Be brief."}
    assert rl_prompt({"prompt": "Q", "completion": "A"}, "b.jsonl:1").fields == {"answer": "A"}
    with pytest.raises(BadExample, match=r"c.jsonl:4: no 'prompt' \(nor chat 'messages'\) in this record \(fields "
                                         r"found: question, answer\)"):
        rl_prompt({"question": "Q", "answer": "A"}, "c.jsonl:4")
    with pytest.raises(BadExample, match="message 0 of 'prompt' has role 'bot'"):
        rl_prompt({"prompt": [{"role": "bot", "content": "x"}]}, "c.jsonl:5")


def test_a_scored_round():
    """Sample, decode, score and normalize one round: the advantages are those of the rewards the completions got,
    batch scaling from sums equals TRL's nanstd, and the metrics are TRL's."""
    from shardlm.data.prompts import RLPrompt
    from shardlm.objectives.rl.rewards import Reward, RewardSet
    from shardlm.objectives.rl.rollout import round_metrics, sampling_params, score_round
    from shardlm.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    model = _model(vocab_size=257, eos=256)
    prompts = [RLPrompt("ab", {"answer": "x"}), RLPrompt("cd", {"answer": "y"})]
    odd = Reward("odd", lambda completion_ids, **_: [len(c) % 2 or None for c in completion_ids], ())
    has_a = Reward("has_a", lambda completions, answer, **_: [float("a" in c) + (a == "y") for c, a in
                                                              zip(completions, answer, strict=True)], ("answer",))
    rewards = RewardSet([odd, has_a], [1.0, 0.5])
    for scale in ("group", "batch"):
        g = GrpoConfig(group=4, max_completion_length=5, scale_rewards=scale, top_k=8)
        params = sampling_params(g, [256, *range(0, 256, 3)], seed=1)  # a third of the bytes stop: lengths vary
        r = score_round(TransformersSampler(model, pad=256), tok, prompts, [list(b"ab"), list(b"cd")], [0, 1],
                        rewards, g, params)
        assert r.texts == [tok.decode(c, skip_special_tokens=True) for c in r.rollout.completions]
        assert r.per_func[4:, 1].min() >= 1.0 and r.per_func[:4, 1].max() <= 1.0  # each prompt's own answer
        want = group_advantages(r.per_func, rewards.weight_tensor, 4, scale)
        torch.testing.assert_close(r.scored.advantages, want.advantages)
    m = round_metrics(r, rewards.names)
    weighted = torch.nansum(r.per_func * torch.tensor([1.0, 0.5]), 1)
    assert m["reward"] == pytest.approx(weighted.mean().item())
    assert m["rewards/has_a/mean"] == pytest.approx(r.per_func[:, 1].mean().item())
    assert m["rewards/odd/mean"] == pytest.approx(torch.nanmean(r.per_func[:, 0]).item())
    lengths = [len(c) for c in r.rollout.completions]
    assert m["completions/max_length"] == max(lengths) and m["completions/min_length"] == min(lengths)
    assert m["completions/clipped_ratio"] == pytest.approx(sum(r.rollout.truncated) / 8)
    assert 0 < sum(r.rollout.truncated) < 8  # some completions stop, others are cut
    masked = score_round(TransformersSampler(model, pad=256), tok, prompts, [list(b"ab"), list(b"cd")], [0, 1],
                         rewards, GrpoConfig(group=4, max_completion_length=5, mask_truncated_completions=True),
                         params)
    kept = masked.batch(pad=256)["completion_mask"].sum(1)
    assert kept.tolist() == [0 if cut else len(c) for c, cut in zip(r.rollout.completions, r.rollout.truncated,
                                                                      strict=True)]


def trl_sampling_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's correction, as GRPOTrainer._generate_and_score_completions computes it (its code, verbatim but
    for the names)."""
    per_token_logps_diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min,clip_max", [(None, 3.0), (0.5, 2.0)])
def test_sampling_correction_is_trls(mode, clip_min, clip_max):
    """The importance-sampling weights of the sampler/trainer mismatch are TRL's, in each mode and bound (a NaN
    sampler log-probability weighs as no difference), and they multiply the surrogate but not the KL term."""
    from shardlm.objectives.rl.loss import sampling_correction

    torch.manual_seed(0)
    old, sampling = torch.randn(6, 5) * 0.5, torch.randn(6, 5) * 0.5
    sampling[0, 1] = math.nan
    mask = (torch.rand(6, 5) > 0.3).float()
    got, diff = sampling_correction(old, sampling, mask, mode, clip_min, clip_max)
    torch.testing.assert_close(got, trl_sampling_ratio(old, sampling, mask, mode, clip_min, clip_max))
    assert (got == 0).any() if mode.endswith("mask") else (got > 0).all()
    assert diff[0, 1] == 0 and torch.equal(diff[1], ((old[1] - sampling[1]) * mask[1]).abs())
    logps, ref, adv = torch.randn(6, 5), torch.randn(6, 5), torch.randn(6)
    plain = token_loss(logps, None, adv, mask, beta=0.1, ref_logps=ref)
    weighted = token_loss(logps, None, adv, mask, beta=0.1, ref_logps=ref, sampling_weights=got)
    assert plain.kl is not None
    torch.testing.assert_close(weighted.per_token - 0.1 * plain.kl, (plain.per_token - 0.1 * plain.kl) * got)

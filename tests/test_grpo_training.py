"""Online RL in the training loop (shardlm.objectives.rl.step): the completions' log-probabilities through the chunked
head, a tiny model that learns a rule-based reward through `shardlm.train`, 2 ranks = 1 process, and a kill -9
resume = the uninterrupted run (with a KL reference and num_iterations 2, whose first step has KL 0 and ratio 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from faults import fault

from helpers import by_step, records, shardlm_cli, tiny, train_in_process


def rl_args(data: tuple[Path, str], cache_dir: Path, out: Path, **extra) -> list[str]:
    return tiny(data[0], cache_dir, out, **{
        "train.objective": "grpo", "grpo.rewards": data[1], "grpo.group": 4, "grpo.max_completion_length": 4,
        "train.batch_size": 8, "train.max_steps": 4, "train.warmup_steps": 0, "train.lr": 3e-2,
        "model.dropout": 0.0, **extra})


def test_completion_logps_are_the_padded_references():
    """Through the chunked head (chunks smaller than the targets), the log-probabilities, entropies and gradients
    are those of the whole logits on TRL's padded layout (objectives.rl.logps), at the sampling temperature; so are
    those of the rows that hold a prompt once with its group's completions under a 4D mask (shared_batch)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.models.attention import attention
    from shardlm.models.causal_lm import CausalLM, shares_prefix
    from shardlm.objectives.rl.logps import completion_logps, micro_batch, shared_batch
    from shardlm.objectives.rl.sampling import Rollout

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=64, n_layer=2, n_embd=32, n_head=2, bos_token_id=39,
                     eos_token_id=39, initializer_range=0.3)
    cfg._attn_implementation = attention(cfg)  # as shardlm builds it (its SDPA)
    hf = GPT2LMHeadModel(cfg).eval()
    rollout = Rollout([[5, 6, 7], [8]], [[1, 2], [3], [4, 4, 9], [10]], [False] * 4, group=2)
    padded = rollout.padded(pad=39)
    lengths = padded["completion_mask"].bool()
    want, want_entropy = completion_logps(hf, padded, temperature=0.7, with_entropy=True)
    tokens, positions, targets, got_lengths = micro_batch([rollout.prompt_of(i) for i in range(4)],
                                                          rollout.completions, 39, torch.device("cpu"))
    assert torch.equal(got_lengths, lengths)
    model = CausalLM(hf, loss_chunk_size=3)
    got, entropy = model.completion_logps(tokens, positions, targets, 0.7, True)
    torch.testing.assert_close(got, want[lengths], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want_entropy[lengths], atol=1e-5, rtol=1e-5)
    *shared, shared_lengths, mask = shared_batch(rollout.prompts, rollout.completions, 2, 39, torch.device("cpu"))
    assert shares_prefix(model) and torch.equal(shared_lengths, lengths) and shared[0].numel() < tokens.numel()
    with torch.no_grad():
        together, together_entropy = model.completion_logps(*shared, 0.7, True, mask)
    torch.testing.assert_close(together, want[lengths], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together_entropy, want_entropy[lengths], atol=1e-5, rtol=1e-5)
    weights = torch.randn(got.shape)
    (got * weights).sum().backward()
    grads = [p.grad.clone() for p in hf.parameters()]
    hf.zero_grad()
    (completion_logps(hf, padded, temperature=0.7)[0][lengths] * weights).sum().backward()
    for g, p in zip(grads, hf.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)


def test_the_padding_vocabulary_is_neither_sampled_nor_scored():
    """model.vocab_multiple pads the head with ids of no token: the sampler never draws them and the scores are
    normalized over the tokenizer's ids alone, as the sampler's distribution is."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.models.causal_lm import CausalLM
    from shardlm.objectives.rl.logps import micro_batch
    from shardlm.objectives.rl.sampling import SamplingParams, TransformersSampler

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=64, n_layer=1, n_embd=16, n_head=2,
                                    initializer_range=2.0)).eval()  # wide logits: padded ids would be drawn
    model = CausalLM(hf)
    model.vocab = 8
    prompts = [[1, 2, 3], [4]]
    out = TransformersSampler(hf, pad=0, vocab=8).sample(prompts, [0, 1], SamplingParams(group=8, max_tokens=6))
    assert max(max(c) for c in out.completions) < 8
    assert max(max(c) for c in TransformersSampler(hf, pad=0).sample(prompts, [0, 1], SamplingParams(
        group=8, max_tokens=6)).completions) >= 8
    tokens, positions, targets, _ = micro_batch([out.prompt_of(i) for i in range(16)], out.completions, 0,
                                                torch.device("cpu"))
    with torch.no_grad():
        got, _ = model.completion_logps(tokens, positions, targets)
        logits = hf(tokens).logits[..., :8].log_softmax(-1)
    keep = targets != -100
    torch.testing.assert_close(got, logits[keep].gather(1, targets[keep][:, None]).squeeze(1))


@pytest.mark.parametrize("objective,precision,rises_to,val_to", [
    pytest.param("grpo", "bf16", 0.8, 0.75, marks=pytest.mark.cuda), ("rloo", "fp32", 0.6, 0.5)])
def test_a_tiny_model_learns_a_rule_based_reward(rl_data, cache_dir, tmp_path, capsys, objective, precision, rises_to,
                                                 val_to):
    """`shardlm.train` with train.objective=grpo in bf16 (autocast: sampling too; on CUDA where there is one), and
    rloo (its KL in the reward): the train reward rises from chance (~0.25) to > 0.8 (0.6) in 12 steps of 4 prompts
    x 8 completions (measured: 0.27 -> 0.92, 0.27 -> 0.74); the validation's sampled reward rises with it; the
    records hold TRL's metrics and each log step prints samples with their rewards."""
    torch.set_num_threads(1)
    summary = train_in_process(rl_args(rl_data, cache_dir, tmp_path, **{
        "train.objective": objective, "parallel.precision": precision, "grpo.group": 8, "train.batch_size": 32,
        "train.max_steps": 12, "train.eval_every": 2, "checkpoint.save_final": False}))
    rewards = [r["reward"] for r in records(tmp_path)]
    assert rewards[0] < 0.4 and sum(rewards[-3:]) / 3 > rises_to, rewards
    val = records(tmp_path, "val")
    assert val[0]["reward"] < 0.4 < val_to < summary["val"]["reward"], val
    assert summary["val"]["prompts"] == 7 and summary["val"]["exact_match"] == 0.0
    name = "low_ids"  # the function's name, as TRL records it
    assert {"reward_std", f"rewards/{name}/mean", f"rewards/{name}/std", "frac_reward_zero_std",
            "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "entropy",
            "completions_per_s"} <= set(records(tmp_path)[-1])
    if objective == "rloo":  # RLOOConfig's beta 0.05 (the task default): the KL of the round, 0 at step 1
        assert records(tmp_path)[0]["kl"] == 0 < records(tmp_path)[-1]["kl"]
        return
    out = capsys.readouterr().out
    assert out.count("  sample: ...") == 24 and f"({name} " in out
    from shardlm.observe.plot import plot_runs

    written = {p.name for p in plot_runs([str(tmp_path)])}
    assert {"rl_reward.png", "rl_shares.png", "rl_entropy.png", "rl_rewards_by_function.png"} <= written
    assert "rl_kl.png" not in written and "an online RL run's validation samples" in capsys.readouterr().err


@pytest.fixture(scope="module")
def uninterrupted(rl_data, cache_dir, tmp_path_factory):
    """One process, 4 steps: a KL reference (the frozen initial model), num_iterations 2, validation at 2 and 4."""
    out = tmp_path_factory.mktemp("rl_one")
    shardlm_cli(["train", *rl_args(rl_data, cache_dir, out, **KL_MU)])
    return out


KL_MU = {"grpo.beta": 0.1, "grpo.num_iterations": 2, "train.eval_every": 2, "train.grad_accum": 2,
         "train.batch_size": 4, "grpo.epsilon": 0.05}


def test_two_ranks_train_what_one_process_trains(uninterrupted, rl_data, cache_dir, tmp_path):
    """2 ranks (FSDP2, each half the prompts, keyed samples, the reference sharded as the policy) give the one
    process's completions, rewards, losses and validation; at step 1 the policy is the reference and its own
    old policy: KL 0 and no ratio clipped; the round's second step trains against the stored old log-probabilities."""
    shardlm_cli(["train", *rl_args(rl_data, cache_dir, tmp_path, **{**KL_MU, "train.grad_accum": 1})], nproc=2)
    got, want = records(tmp_path), records(uninterrupted)
    assert len(got) == len(want) == 4
    assert want[0]["kl"] == pytest.approx(0, abs=1e-7) and want[0]["clip_ratio/region_mean"] == 0
    assert want[1]["kl"] > 0 and want[1]["clip_ratio/region_mean"] > 0
    # shardlm's own sampler gives its log-probabilities: in fp32 they are the trainer's, the correction weighs ~1
    assert want[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert want[0]["sampling/importance_sampling_ratio/min"] == pytest.approx(1, abs=1e-4)
    assert "reward" in want[0] and "reward" not in want[1] and "reward" in want[2]  # a round every 2 steps
    for a, b in zip(got, want, strict=True):
        for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length"):
            assert a.get(key) == b.get(key), key
        assert (a["loss"], a["kl"], a["entropy"], a["grad_norm"]) == pytest.approx(
            (b["loss"], b["kl"], b["entropy"], b["grad_norm"]), rel=1e-4, abs=1e-6)
    for a, b in zip(records(tmp_path, "val"), records(uninterrupted, "val"), strict=True):
        assert (a["reward"], a["exact_match"], a["prompts"]) == pytest.approx(
            (b["reward"], b["exact_match"], b["prompts"]), rel=1e-6)


def test_a_killed_run_resumes_exactly(uninterrupted, rl_data, cache_dir, tmp_path):
    """SIGTERM after step 1 stops the run at its round's end (step 2), whose checkpoint is followed by a kill -9;
    rerun: the uninterrupted run's records (the sampling keys are the prompts' places in the data order: no sampling
    state is saved). A stop at step 1 would leave a clean exit and no kill."""
    args = ["train", *rl_args(rl_data, cache_dir, tmp_path, **KL_MU)]
    assert shardlm_cli([*args, fault("SigtermAt(1)"), fault("KillAfterSave(2)")], check=False).returncode != 0
    shardlm_cli(args)
    got, want = by_step(tmp_path), by_step(uninterrupted)
    assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), rel=1e-5, abs=1e-7)
    assert [r["reward"] for r in records(tmp_path) if "reward" in r] == \
        [r["reward"] for r in records(uninterrupted) if "reward" in r]


def test_eval_reports_the_runs_validation(uninterrupted, capsys):
    """`shardlm eval RUN` of an online RL run: its validation (the same seeded samples and greedy completions) on
    the saved model, the numbers of the run's last validation record."""
    from shardlm.inference.evaluate import evaluate_path

    result = evaluate_path(str(uninterrupted), [])
    last = records(uninterrupted, "val")[-1]
    assert (result["reward"], result["exact_match"], result["prompts"]) == (last["reward"], last["exact_match"], 7)
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["reward"] == last["reward"]
    assert f"val reward {last['reward']:.4f} exact_match 0.000 on 7 of 7 prompts" in err


def test_a_round_for_two_steps_on_two_ranks_is_one_process(rl_data, cache_dir, tmp_path):
    """grpo.steps_per_generation=4 at grad_accum 2 (TRL's meaning): one round of 8 prompts x 2 feeds two optimizer
    steps, each on its half, the second against the log-probabilities at sampling time (the policy moved); 2
    ranks saying it as grpo.generation_batch_size=16 train the same."""
    one, two = tmp_path / "one", tmp_path / "two"
    base = {"train.grad_accum": 2, "train.batch_size": 4, "grpo.group": 2, "train.max_steps": 4, "grpo.epsilon": 0.05}
    shardlm_cli(["train", *rl_args(rl_data, cache_dir, one, **base, **{"grpo.steps_per_generation": 4})])
    shardlm_cli(["train", *rl_args(rl_data, cache_dir, two, **{**base, "train.batch_size": 2},
                                   **{"grpo.generation_batch_size": 16})], nproc=2)
    got, want = records(two), records(one)
    assert ["reward" in r for r in want] == [True, False, True, False]  # a round every 2 steps
    assert want[1]["clip_ratio/region_mean"] > 0  # the second slice's ratios moved off 1
    for a, b in zip(got, want, strict=True):
        assert a.get("reward") == b.get("reward")
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-4, abs=1e-6)


def test_dynamic_sampling_drops_equal_groups_alike_on_one_and_two_ranks(rl_data, cache_dir, tmp_path):
    """grpo.dynamic_sampling (DAPO): groups whose completions all got the same reward are dropped and the next
    prompts sampled until the round is full of groups that teach; 2 ranks (each sampling its share of every
    candidate round, the groups gathered) keep the same groups as one process."""
    base = {"train.batch_size": 8, "grpo.group": 2, "train.max_steps": 4, "grpo.dynamic_sampling": True,
            "grpo.max_completion_length": 2}
    shardlm_cli(["train", *rl_args(rl_data, cache_dir, tmp_path / "one", **base)])
    shardlm_cli(["train", *rl_args(rl_data, cache_dir, tmp_path / "two", **{**base, "train.batch_size": 4})],
                nproc=2)
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert sum(r["dynamic_sampling/dropped_groups"] for r in one) > 0
    assert all(r["frac_reward_zero_std"] == 0 for r in one if r["dynamic_sampling/filled_groups"] == 0)
    for a, b in zip(two, one, strict=True):
        assert a["reward"] == b["reward"]
        assert a["dynamic_sampling/dropped_groups"] == b["dynamic_sampling/dropped_groups"]
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-4, abs=1e-6)

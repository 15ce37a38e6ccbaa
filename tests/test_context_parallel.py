"""Context parallelism (`parallel.context`, shardlm.distributed.context): rows split over ranks train what one
process trains. A tiny Llama from scratch (RoPE, grouped-query attention), fp32, gloo, real spawned ranks."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardlm.data.blocks import Batch
from shardlm.distributed import context
from tests.helpers import assert_same_curve, curve, records, save_lora_base, shardlm_cli, tiny

# 30 tokens: not a multiple of 2 x context, so every split pads (the padding must never be scored)
LLAMA = {"model.arch": "llama", "model.n_layer": 2, "model.n_embd": 32, "model.n_head": 4, "model.n_kv_head": 2,
         "data.seq_len": 30, "train.batch_size": 4, "train.max_steps": 4, "checkpoint.every": 2,
         "train.eval_batches": 1}
CHAT = {"data.train": "chat_tasks", "data.val": "chat_tasks_val", "model.tokenizer": "bytes",
        "model.chat_template": "chatml", "data.seq_len": 64}


@pytest.fixture(scope="module")
def one_process(corpus, cache_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cp") / "one"
    shardlm_cli(["train", *tiny(corpus, cache_dir, out, **LLAMA)])
    return out


def test_head_tail_order_is_pytorchs_and_the_split_mask_is_one_processs_mask():
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    assert torch.equal(context.head_tail(24, 3), _HeadTailLoadBalancer(24, 3, "cpu")._generate_indices()[0])
    # two packed examples whose boundary (position 8 -> 0) falls on the split's chunk boundary, then padding
    positions = torch.tensor([list(range(8)) + list(range(6))])
    targets = torch.arange(14)[None]
    full = torch.tensor([list(range(8)) + list(range(6)) + [0, 0]])
    docs = context.documents(full)
    docs[0, 14:] = torch.tensor([3, 4])  # padding: each its own example
    causal = torch.tril(torch.ones(16, 16, dtype=torch.bool)) & (docs[0, :, None] == docs[0, None, :])
    order = context.head_tail(16, 2)
    for rank in range(2):
        ctx = SimpleNamespace(size=2, rank=rank)
        segments = torch.tensor([[0] * 8 + [1] * 6])
        mine_batch, mask = context.split(ctx, Batch(targets.clone(), targets, positions, segments))  # type: ignore[arg-type]
        inputs, tg, pos, seg = mine_batch.inputs, mine_batch.targets, mine_batch.positions, mine_batch.segments
        mine = order.view(2, -1)[rank]
        assert torch.equal(mask[0, 0], causal[mine][:, order])
        assert torch.equal(pos[0], full[0, mine])
        assert torch.equal(inputs[0], torch.cat([targets[0], torch.zeros(2, dtype=torch.long)])[mine])
        assert (tg[0][mine >= 14] == -100).all() and (tg[0][mine < 14] == mine[mine < 14]).all()
        assert torch.equal(seg[0], torch.cat([segments[0], torch.tensor([-1, -1])])[mine])


def test_context_2_on_2_ranks_trains_what_one_process_trains(corpus, cache_dir, one_process, tmp_path):
    out = tmp_path / "cp2"
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, out, **LLAMA, **{"parallel.context": 2})], nproc=2)
    assert "rows split by context: mesh data 1 x context 2" in proc.stdout
    assert_same_curve(curve(out), curve(one_process))


def test_data_2_x_context_2_equals_one_process_and_resumes_on_one_rank(corpus, cache_dir, one_process, tmp_path):
    out = tmp_path / "dp2cp2"
    shardlm_cli(["train", *tiny(corpus, cache_dir, out, **{**LLAMA, "train.batch_size": 2, "parallel.context": 2})],
                nproc=4, timeout=400)
    assert_same_curve(curve(out), curve(one_process))
    again = tmp_path / "again"
    shardlm_cli(["train", *tiny(corpus, cache_dir, again, **LLAMA),
                 f"checkpoint.resume={out / 'checkpoints' / 'step_000000002'}"])
    assert_same_curve(curve(again), curve(one_process)[2:])


def test_packed_examples_split_over_2_ranks_train_what_one_process_trains(cache_dir, tmp_path):
    """With LoRA and activation checkpointing (the recompute attends inside the split too)."""
    base = save_lora_base(tmp_path / "base", "llama", seed=0)
    train = {k: v for k, v in LLAMA.items() if not k.startswith("model.")}  # the base's shape: Llama with GQA
    chat = {**train, **CHAT, "model.chat_template": "plain", "checkpoint.every": 0, "model.name": base, "lora.r": 4,
            "parallel.activation_checkpointing": "full"}
    curves = []
    for name, nproc, extra in (("one", 0, {}), ("cp2", 2, {"parallel.context": 2})):
        shardlm_cli(["train", *tiny(Path("unused"), cache_dir, tmp_path / name, **chat, **extra)], nproc=nproc)
        curves.append(curve(tmp_path / name))
    assert_same_curve(*curves)


def test_preference_pairs_split_over_2_ranks_train_what_one_process_trains(cache_dir, tmp_path):
    """DPO against a live reference (a frozen copy of the initial model, which attends inside the split too): each
    sequence's log-probability is summed over the ranks holding its tokens before the pair's loss."""
    dpo = {**LLAMA, **CHAT, "data.train": "chat_pairs", "data.val": "chat_pairs_val", "data.seq_len": 90,
           "model.n_positions": 96, "train.objective": "dpo", "preference.reference": "live", "checkpoint.every": 0}
    curves = []
    for name, nproc, extra in (("one", 0, {}), ("cp2", 2, {"parallel.context": 2})):
        shardlm_cli(["train", *tiny(Path("unused"), cache_dir, tmp_path / name, **dpo, **extra)], nproc=nproc)
        curves.append([(r["step"], r["loss"], r["grad_norm"], r["rewards/margin"]) for r in records(tmp_path / name)])
    # step 1 agrees to 1e-7; AdamW then magnifies the pair sums' fp32 summation order (split vs whole) step by step
    assert curves[1][0][2] == pytest.approx(curves[0][0][2], rel=1e-6)
    assert_same_curve([c[:3] for c in curves[1]], [c[:3] for c in curves[0]], tol=1e-4)
    assert [c[3] for c in curves[1]] == pytest.approx([c[3] for c in curves[0]], abs=1e-5)
    assert curves[0][-1][3] != curves[0][0][3]  # the policy moved away from its reference


@pytest.mark.parametrize("extra, message", [
    ({}, r"parallel.context=2 does not divide the world size \(1 ranks\)"),
])
def test_bad_context_settings_are_one_line_errors(corpus, cache_dir, tmp_path, extra, message):
    out = tmp_path / "bad"
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, out, **LLAMA, **{"parallel.context": 2}, **extra)],
                       check=False)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.count("error:") == 1
    import re
    assert re.search(message, proc.stderr)


def test_family_attention_and_objective_the_split_cannot_run_are_refused(monkeypatch):
    from transformers import GPT2Config, LlamaConfig, MistralConfig

    from shardlm import ShardlmError
    from shardlm.config import load_config

    cfg = load_config(None, ["parallel.context=2"])
    with pytest.raises(ShardlmError, match="model family 'gpt2' is not supported by context parallelism"):
        context.check_model(GPT2Config(), cfg)
    eager = LlamaConfig()
    eager._attn_implementation = "eager"
    with pytest.raises(ShardlmError, match="with model.attention=eager: the split attends through SDPA"):
        context.check_model(eager, cfg)
    with pytest.raises(ShardlmError, match="attends through a sliding window"):
        context.check_model(MistralConfig(sliding_window=16), cfg)
    with pytest.raises(ShardlmError, match="with train.objective=grpo: rows are split"):
        context.check_plan(load_config(None, ["parallel.context=2", "train.objective=grpo",
                                       "grpo.max_completion_length=16"]), 2, torch.device("cpu"))
    with pytest.raises(ShardlmError, match="parallel.context=2 is not supported on XLA"):
        context.check_plan(cfg, 2, torch.device("xla"))
    # torch 2.9 (the lowest declared) has no _context_parallel module: a None entry makes its import fail alike
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor.experimental._context_parallel", None)
    with pytest.raises(ShardlmError, match="needs PyTorch's context-parallel module .* or set parallel.context=1"):
        context.check_plan(cfg, 2, torch.device("cpu"))


def test_estimate_counts_each_ranks_share_of_the_row_and_the_split():
    from shardlm.config import load_config
    from shardlm.preflight.estimate import estimate
    from shardlm.tokenizer import model_tokenizer

    keys = ["model.arch=llama", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.n_kv_head=2",
            "model.tokenizer=bytes", "data.seq_len=2048", "train.batch_size=1"]
    one, two = (estimate(cfg, model_tokenizer(cfg.model), 2) for cfg in
                (load_config(None, [*keys, f"parallel.context={n}"]) for n in (1, 2)))
    assert two.components["activations"] == pytest.approx(one.components["activations"] / 2)
    # the mask (1024 x 2048 in fp32) and 2 layers' gathered keys and values at the 2 key/value heads (x 16 x 4):
    # on CPU, not repeated to the 4 query heads
    assert two.components["context: the split's mask, gathered keys/values"] == 1024 * 2048 * 4 + 2 * 2048 * 2 * 32 * 4

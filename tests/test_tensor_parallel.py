"""Tensor parallelism (`parallel.tensor=N`): a block's heads and MLP split over N ranks train what one process
trains, alone, under FSDP2 (data 2 x tensor 2) and beside context parallelism (context 2 x tensor 2); a run killed
-9 resumes exactly, and its checkpoint resumes on one process. A tiny Llama (grouped-query attention), fp32, gloo,
real spawned ranks."""

from pathlib import Path

import pytest
from faults import fault

from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.distributed import tensor
from tests.helpers import assert_same_curve, curve, records, shardlm_cli, tiny

# 32 tokens a row (context 2 splits it without padding); 4 heads and 2 key/value heads, both split by 2
LLAMA = {"model.arch": "llama", "model.n_layer": 2, "model.n_embd": 32, "model.n_head": 4, "model.n_kv_head": 2,
         "data.seq_len": 32, "train.batch_size": 4, "train.max_steps": 4, "checkpoint.every": 2,
         "train.eval_batches": 1, "train.eval_every": 4}


def val_loss(out: Path) -> float:
    return next(r["loss"] for r in records(out, split="val"))


@pytest.fixture(scope="module")
def one_process(corpus, cache_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp") / "one"
    shardlm_cli(["train", *tiny(corpus, cache_dir, out, **LLAMA, **{"checkpoint.export_final": True})])
    return out


def test_tensor_2_trains_what_one_process_trains_and_exports_it(corpus, cache_dir, one_process, tmp_path):
    """The curve and the validation loss; the exported folder (the split weights gathered whole) holds one process's
    weights, and transformers generates the same tokens from both."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tp2"
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, out, **LLAMA, **{"parallel.tensor": 2,
                                                                           "checkpoint.export_final": True})], nproc=2)
    assert "FSDP2 full, mesh (1,) x tensor 2" in proc.stdout, proc.stdout
    assert_same_curve(curve(out), curve(one_process))
    assert val_loss(out) == pytest.approx(val_loss(one_process), abs=1e-5)  # both ranks score the same rows
    split, whole = (AutoModelForCausalLM.from_pretrained(o / "hf") for o in (out, one_process))
    for (name, a), (_, b) in zip(split.state_dict().items(), whole.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), name
    prompt = torch.tensor([[72, 101, 108, 108, 111]])
    assert torch.equal(*(m.generate(prompt, max_new_tokens=8, do_sample=False) for m in (split, whole)))


def test_qwen3_head_norms_are_summed_over_the_tensor_ranks(corpus, cache_dir, tmp_path):
    """Qwen3 normalizes each head's queries and keys with one weight: each tensor rank holds half the heads, so its
    gradient is half the sum (without the replicated DTensor weight, the grad norm is off by 3e-4 by step 4)."""
    qwen3 = {**LLAMA, "model.arch": "qwen3", "checkpoint.every": 0}
    for name, nproc, extra in (("one", 0, {}), ("tp2", 2, {"parallel.tensor": 2})):
        shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path / name, **qwen3, **extra)], nproc=nproc)
    assert_same_curve(curve(tmp_path / "tp2"), curve(tmp_path / "one"))


def test_data_2_x_tensor_2_resumes_exactly_and_on_one_process(corpus, cache_dir, one_process, tmp_path):
    """Killed -9 after its step-2 save, resumed on 4 ranks: the uninterrupted curve; that checkpoint (2-D
    placements: rows over data, heads over tensor) resumed on one process: the same steps 3 and 4 (DCP reshards)."""
    out, args = tmp_path / "dp2tp2", {**LLAMA, "train.batch_size": 2, "parallel.tensor": 2}
    killed = shardlm_cli(["train", *tiny(corpus, cache_dir, out, **args), fault("KillAfterSave(2)")], nproc=4,
                         check=False, timeout=400)
    assert killed.returncode != 0 and max(s for s, *_ in curve(out)) == 2
    resumed = shardlm_cli(["train", *tiny(corpus, cache_dir, out, **args)], nproc=4, timeout=400)
    assert "resumed from" in resumed.stdout
    assert "mesh (2,) x tensor 2, reduce-scatter by all-to-all or all-reduce" in resumed.stdout
    assert_same_curve(curve(out), curve(one_process))
    again = tmp_path / "again"
    shardlm_cli(["train", *tiny(corpus, cache_dir, again, **LLAMA),
                 f"checkpoint.resume={out / 'checkpoints' / 'step_000000002'}"])
    assert_same_curve(curve(again), curve(one_process)[2:])


def test_gpt2_data_2_x_tensor_2_equals_one_process_resumes_and_exports(corpus, cache_dir, tmp_path):
    """GPT-2's fused q|k|v Conv1D split by heads (a strided shard, stored as a plain one for DCP): 4 ranks train
    what one process trains, their step-2 checkpoint resumes on one process exactly, and their export holds one
    process's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    gpt2 = {**LLAMA, "model.arch": "gpt2", "checkpoint.export_final": True}
    del gpt2["model.n_kv_head"]
    one, four, again = tmp_path / "one", tmp_path / "dp2tp2", tmp_path / "again"
    shardlm_cli(["train", *tiny(corpus, cache_dir, one, **gpt2)])
    shardlm_cli(["train", *tiny(corpus, cache_dir, four, **{**gpt2, "train.batch_size": 2, "parallel.tensor": 2})],
                nproc=4, timeout=400)
    assert_same_curve(curve(four), curve(one))
    shardlm_cli(["train", *tiny(corpus, cache_dir, again, **{**gpt2, "checkpoint.export_final": False}),
                 f"checkpoint.resume={four / 'checkpoints' / 'step_000000002'}"])
    assert_same_curve(curve(again), curve(one)[2:])
    split, whole = (AutoModelForCausalLM.from_pretrained(o / "hf") for o in (four, one))
    for (name, a), (_, b) in zip(split.state_dict().items(), whole.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-4), name


def test_lora_under_tensor_2_trains_resumes_and_exports_as_one_process(cache_dir, corpus, tmp_path):
    """Adapters split with their base layers (B column-wise beside a column-wise base, A row-wise beside a row-wise
    one; the other replicated) and the frozen norms kept frozen (torch's sequence-parallel norms come back
    trainable): the curve, the merged export and a resume of the split run's checkpoint on one process."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers import save_lora_base

    base = save_lora_base(tmp_path / "base", "llama", seed=0)
    lora = {k: v for k, v in LLAMA.items() if not k.startswith("model.")} | {
        "model.name": base, "model.tokenizer": "bytes", "lora.r": 4, "checkpoint.export_final": True}
    one, split, again = tmp_path / "one", tmp_path / "tp2", tmp_path / "again"
    shardlm_cli(["train", *tiny(corpus, cache_dir, one, **lora)])
    shardlm_cli(["train", *tiny(corpus, cache_dir, split, **lora, **{"parallel.tensor": 2})], nproc=2)
    assert_same_curve(curve(split), curve(one))
    merged, whole = (AutoModelForCausalLM.from_pretrained(o / "hf") for o in (split, one))
    for (name, a), (_, b) in zip(merged.state_dict().items(), whole.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), name
    shardlm_cli(["train", *tiny(corpus, cache_dir, again, **{**lora, "checkpoint.export_final": False}),
                 f"checkpoint.resume={split / 'checkpoints' / 'step_000000002'}"])
    assert_same_curve(curve(again), curve(one)[2:])


def test_context_2_x_tensor_2_trains_what_one_process_trains(corpus, cache_dir, one_process, tmp_path):
    out = tmp_path / "cp2tp2"
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, out, **LLAMA, **{"parallel.tensor": 2,
                                                                           "parallel.context": 2})],
                       nproc=4, timeout=400)
    assert "rows split by context: mesh data 1 x context 2 x tensor 2" in proc.stdout, proc.stdout
    assert_same_curve(curve(out), curve(one_process))


def test_what_tensor_parallelism_cannot_run_is_refused_in_one_line(corpus, cache_dir, tmp_path):
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    cfg = load_config(None, ["parallel.tensor=2"])
    with pytest.raises(ShardlmError, match=r"model family 'opt' has no tensor-parallel plan here \(families with "
                                           "one: gpt2, llama, qwen2, qwen3, mistral\\)"):
        tensor.check_model(OPTConfig(), cfg)
    with pytest.raises(ShardlmError, match=r"does not divide the model's attention heads \(25\)"):
        tensor.check_model(GPT2Config(n_head=25, n_embd=1600), cfg)
    with pytest.raises(ShardlmError, match=r"does not divide the model's key/value heads \(1\)"):
        tensor.check_model(LlamaConfig(num_attention_heads=4, num_key_value_heads=1), cfg)
    import torch

    for overrides, message in ((["train.objective=dpo"], "trains the next-token loss"),
                               (["parallel.sharding=hybrid_full"], "use parallel.sharding=full or grad_op"),
                               (["parallel.cpu_offload=true"], "not with split weights yet"),
                               (["data.seq_len=33"], "splits each row's 33 positions between blocks over 2 ranks"),
                               (["parallel.activation_checkpointing=full"], "Use one of the two")):
        with pytest.raises(ShardlmError, match=message):
            tensor.check_plan(load_config(None, ["parallel.tensor=2", *overrides]), 2, torch.device("cpu"),
                              compiled=True)
    out = tmp_path / "bad"  # the whole path once: a run of 1 process cannot split over 2
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, out, **LLAMA, **{"parallel.tensor": 2})], check=False)
    assert proc.returncode == 2 and not out.exists() and proc.stderr.count("error:") == 1
    assert "parallel.tensor=2 (x parallel.context=1) does not divide the world size (1 ranks)" in proc.stderr

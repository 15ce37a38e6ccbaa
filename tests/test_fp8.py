"""float8 training (parallel.precision=fp8) on CPU: which layers convert, that state dicts are unchanged,
that float8 forward/backward stays close to fp32, FSDP2's float8 all-gather on a 1-rank gloo group, and the
clear errors where float8 cannot run. Tiny random GPT-2 and Llama models, no hub."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.distributed.parallelize import compile_mode
from shardlm.models.causal_lm import CausalLM, transformer_blocks
from shardlm.models.fp8 import (
    _torchao_float8,
    after_optimizer_step,
    check_float8,
    compile_time_note,
    convert_to_float8,
    float8_conv1d_class,
    is_float8,
    plain_state_dict,
)

GPT2_LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# the tests that convert need torchao; the error tests run without it
needs_torchao = pytest.mark.usefixtures("torchao")


@pytest.fixture
def torchao():
    return pytest.importorskip("torchao")


def gpt2(n_layer: int = 4, device: str = "cpu") -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_layer=n_layer, n_embd=64, n_head=2, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device(device):
        return GPT2LMHeadModel(cfg)


def llama(device: str = "cpu") -> nn.Module:
    """head_dim 8 with one KV head: k_proj/v_proj have 8 out features, too few for float8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def converted(hf: nn.Module, fsdp: bool = False, emulate: bool = False) -> tuple[nn.Module, list[str]]:
    return hf, convert_to_float8(hf, transformer_blocks(hf), fsdp=fsdp, emulate=emulate)


def cpu_scaled_mm() -> bool:
    """Whether this torch runs float8 matmuls (torch._scaled_mm) on CPU (2.13 does)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.tensor(1.0), torch.tensor(1.0), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- which modules convert ----------------------------------------------------------------------------
@needs_torchao
def test_gpt2_converts_conv1d_of_middle_blocks_only():
    hf, names = converted(gpt2())
    assert names == [f"transformer.h.{i}.{layer}" for i in (1, 2) for layer in GPT2_LAYERS]
    conv1d = float8_conv1d_class()
    for name, module in hf.named_modules():
        assert isinstance(module, conv1d) == (name in names)
    from transformers.pytorch_utils import Conv1D

    assert all(type(hf.get_submodule(f"transformer.h.{i}.{layer}")) is Conv1D for i in (0, 3) for layer in GPT2_LAYERS)
    assert type(hf.lm_head) is nn.Linear and hf.lm_head.weight is hf.transformer.wte.weight  # still tied


@needs_torchao
def test_llama_converts_linears_of_middle_blocks_divisible_by_16():
    hf, names = converted(llama())
    wide = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert names == [f"model.layers.{i}.{layer}" for i in (1, 2) for layer in wide]
    assert all(type(hf.get_submodule(n)).__name__ == "Float8Linear" for n in names)
    kept = [n for n, m in hf.named_modules() if type(m) is nn.Linear]
    assert "lm_head" in kept and "model.layers.1.self_attn.k_proj" in kept  # 8 out features
    assert all(f"model.layers.{i}.{layer}" in kept for i in (0, 3) for layer in wide)


@needs_torchao
def test_too_few_blocks_is_a_clear_error_and_a_second_conversion_is_a_no_op():
    with pytest.raises(ShardlmError, match="no layer .* 3\\+ blocks"):
        converted(gpt2(n_layer=2))
    hf, names = converted(gpt2(n_layer=3))
    assert len(names) == 4 and converted(hf)[1] == []


# ---- state dicts are unchanged ---------------------------------------------------------------------------
@needs_torchao
@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("make", [gpt2, llama])
def test_state_dict_keys_shapes_values_unchanged_both_ways(make, fsdp):
    reference = make().state_dict()
    hf, _ = converted(make(), fsdp=fsdp)
    state = plain_state_dict(hf.state_dict())
    assert list(state) == list(reference)
    for key, value in reference.items():
        assert type(state[key]) is torch.Tensor and state[key].shape == value.shape and torch.equal(state[key], value)
    plain = make()
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    hf.load_state_dict(plain.state_dict())  # plain HF -> float8
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in plain_state_dict(hf.state_dict()).items())
    fresh = make()
    fresh.load_state_dict(plain_state_dict(hf.state_dict()))  # float8 -> plain HF
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in fresh.state_dict().items())


@needs_torchao
def test_meta_model_converts_then_materializes_like_a_real_one():
    real, _ = converted(gpt2())
    meta, names = converted(gpt2(device="meta"))
    assert all(p.is_meta for n in names for p in meta.get_submodule(n).parameters())
    meta.to_empty(device="cpu")
    meta.load_state_dict(gpt2().state_dict())
    tokens = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(meta(tokens).logits, real(tokens).logits, rtol=0, atol=0)


# ---- numerics ------------------------------------------------------------------------------------------
@needs_torchao
@pytest.mark.parametrize("emulate", [True, False])
@pytest.mark.parametrize("make", [gpt2, llama])
def test_float8_forward_and_backward_close_to_fp32(make, emulate):
    if not emulate and not cpu_scaled_mm():
        pytest.skip("this torch has no float8 matmul (torch._scaled_mm) on CPU")
    reference, (hf, names) = CausalLM(make()), converted(make(), emulate=emulate)
    model, tokens = CausalLM(hf), torch.randint(0, 64, (4, 17))
    losses = [m(tokens[:, :-1], tokens[:, 1:])[0] for m in (reference, model)]
    for loss in losses:
        loss.backward()
    assert rel_err(losses[1], losses[0]) < 0.02
    weight = f"hf.{names[0]}.weight"
    assert rel_err(model.get_parameter(weight).grad, reference.get_parameter(weight).grad) < 0.1
    assert rel_err(model.hf.lm_head.weight.grad, reference.hf.lm_head.weight.grad) < 0.1


@needs_torchao
def test_float8_conv1d_computes_in_the_autocast_dtype():
    if not cpu_scaled_mm():
        pytest.skip("this torch has no float8 matmul (torch._scaled_mm) on CPU")
    hf, names = converted(gpt2())
    layer, x = hf.get_submodule(names[0]), torch.randn(2, 5, 64)
    expected = x @ layer.weight + layer.bias
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 192) and rel_err(out, expected) < 0.1


@needs_torchao
def test_fsdp_float8_all_gather_on_one_gloo_rank():
    """meta -> convert -> fully_shard -> to_empty -> rank 0's weights, as shardlm builds FSDP models; the
    weights are cast to float8 before FSDP's all-gather; after_optimizer_step precomputes their scales."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not cpu_scaled_mm():
        pytest.skip("this torch has no float8 matmul (torch._scaled_mm) on CPU")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a multi-rank process group is already running")
    try:
        hf, names = converted(gpt2(device="meta"), fsdp=True)
        model, kwargs = CausalLM(hf), {"mesh": init_device_mesh("cpu", (1,)), "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        for block in transformer_blocks(hf):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        model.to_empty(device="cpu")
        reference = CausalLM(gpt2())
        full = {k: v.clone() for k, v in reference.state_dict().items()}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        weight = hf.get_submodule(names[0]).weight
        assert type(weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
        gathered = []  # what FSDP hands the layer after its all-gather: float8 data with its scale
        hf.get_submodule(names[0]).register_forward_pre_hook(lambda m, _: gathered.append(type(m.weight).__name__))
        tokens = torch.randint(0, 64, (4, 17))
        loss = model(tokens[:, :-1], tokens[:, 1:])[0]
        assert gathered == ["Float8TrainingTensor"]
        assert rel_err(loss, reference(tokens[:, :-1], tokens[:, 1:])[0]) < 0.02
        loss.backward()
        torch.optim.AdamW(model.parameters(), lr=1e-3).step()
        after_optimizer_step(model)
        assert weight._local_tensor._precomputed_scale is not None
        assert torch.isfinite(model(tokens[:, :-1], tokens[:, 1:])[0])
        state = plain_state_dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
        assert set(state) == set(full) and all(type(v) is torch.Tensor for v in state.values())
    finally:
        if owned:
            dist.destroy_process_group()


@needs_torchao
def test_after_optimizer_step_is_a_no_op_without_fsdp():
    after_optimizer_step(gpt2())  # no float8 layer
    after_optimizer_step(converted(gpt2())[0])  # float8 without the FSDP all-gather
    hf, names = converted(gpt2(), fsdp=True)
    after_optimizer_step(hf)  # float8 all-gather configured but not sharded: nothing to precompute
    assert is_float8(hf.get_submodule(names[0])) and hf.get_submodule(names[0]).weight._precomputed_scale is None


# ---- where float8 cannot run ---------------------------------------------------------------------------
def fake_gpu(monkeypatch, name: str, capability: tuple[int, int]) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return torch.device("cuda", 0)


def test_fp8_config_is_accepted_but_cpu_is_refused():
    cfg = load_config(None, ["parallel.precision=fp8"])
    cpu = torch.device("cpu")
    with pytest.raises(ShardlmError, match="Hopper \\(sm90\\) or newer GPU, not cpu; use parallel.precision=bf16"):
        check_float8(cpu, compile_mode(cfg.parallel.compile, cpu))


def test_check_float8_names_an_older_gpu_and_the_fix(monkeypatch):
    with pytest.raises(ShardlmError, match="NVIDIA A100-SXM4-80GB is sm80. Use parallel.precision=bf16"):
        check_float8(fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0)), "model")

@needs_torchao
def test_check_float8_wants_compile_on_hopper_and_newer(monkeypatch):
    hopper = fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    with pytest.raises(ShardlmError, match="without torch.compile .* set parallel.compile=model or"):
        check_float8(hopper, "false")
    check_float8(hopper, "model")
    check_float8(fake_gpu(monkeypatch, "NVIDIA B200", (10, 0)), "blocks")


def test_check_float8_without_torchao(monkeypatch):
    hopper = fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # `import torchao.float8` raises ImportError
    _torchao_float8.cache_clear()
    try:
        with pytest.raises(ShardlmError, match="needs torchao .*pip install torchao"):
            check_float8(hopper, "model")
    finally:
        _torchao_float8.cache_clear()


def test_a_deep_fp8_model_compiled_whole_is_told_of_compile_blocks():
    note = compile_time_note("model", per_block=False, n_blocks=48)
    assert note.startswith("note: parallel.precision=fp8 with parallel.compile=model compiles all 48 blocks")
    assert "parallel.compile=blocks" in note
    assert compile_time_note("model", per_block=False, n_blocks=12) is None  # GPT-2 124M: compiles in time
    assert compile_time_note("model", per_block=True, n_blocks=48) is None  # under FSDP it is per block already
    assert compile_time_note("blocks", per_block=True, n_blocks=48) is None

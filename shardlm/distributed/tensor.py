"""Tensor parallelism (`parallel.tensor=N`): each block's attention heads and MLP columns split over N ranks, so one
rank holds 1/N of a block's projection weights and of the activations between them (and, between blocks, 1/N of
the positions: sequence parallelism).

PyTorch's own tensor parallelism (`parallelize_module` with Megatron's plan, as torchtitan's Llama): q, k, v and
the MLP's gate and up projections column-wise (each rank computes its heads and its slice of the MLP), the attention
output and down projections row-wise (their partial sums reduce-scattered to the rank's positions). The modules keep
their local shards as plain tensors (`use_local_output`), so transformers' attention runs unchanged on the rank's
heads: its `view(..., -1, head_dim)` takes the local head count. The first block cuts the hidden states to the
rank's positions and the last gathers them again: embeddings, final norm, head and loss run whole on every tensor
rank, which computes the same loss, exactly, from the same rows. GPT-2's Conv1D layers and Qwen3's per-head norms
take styles of shardlm's own (shardlm.distributed.tensor_styles).

The ranks form (data x context x tensor), tensor innermost: the N ranks of a block's split are consecutive (on a
GPU node, NVLink neighbours), and FSDP2 shards every parameter over the data (and context) ranks on top, its 2-D
placements (Shard over data, Shard or Replicate over tensor) what DCP saves and reshards on resume; a strided shard
(GPT-2's q|k|v), which DCP refuses, is stored as a plain one (`storable`, `restored`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardlm import ShardlmError
from shardlm.config import Config, objectives
from shardlm.config.checks import ac_mode
from shardlm.distributed.tensor_styles import (
    Conv1DColwise,
    Conv1DRowwise,
    HeadNorm,
    Replicated,
    check_strided_shards,
)

# Families whose blocks hold q/k/v/o and gate/up/down projections with heads read from `-1` (transformers' Llama
# attention): tests/test_tensor_parallel.py checks llama and qwen3 (per-head norms) against one process; qwen2 and
# mistral share llama's layer code. GPT-2 has a plan of its own (gpt2_plan): HF's Conv1D layers, q|k|v fused.
TENSOR_FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "mistral")
COLUMNWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # Qwen3's RMSNorm over each head's features


def check_plan(cfg: Config, world_size: int, device: torch.device, compiled: bool) -> None:
    """What the config and the launch allow, before any work: N divides the ranks, a next-token objective."""
    p, n = cfg.parallel, cfg.parallel.tensor
    if n < 1:
        raise ShardlmError(f"parallel.tensor={n}: the ranks each block is split over is a whole number >= 1 "
                           "(1 = no tensor parallelism).")
    if n == 1:
        return
    if device.type == "xla":
        raise ShardlmError(f"parallel.tensor={n} is not supported on XLA; use parallel.tensor=1 there.")
    if world_size % (n * p.context):
        raise ShardlmError(f"parallel.tensor={n} (x parallel.context={p.context}) does not divide the world size "
                           f"({world_size} ranks): each block is split over {n} consecutive ranks. Launch a multiple "
                           f"of {n * p.context} ranks, or set parallel.tensor to a divisor of {world_size}.")
    from shardlm.distributed.context import share

    positions = share(cfg.data.seq_len, p.context)  # a rank's part of each row, split again between blocks
    if positions % n:
        raise ShardlmError(f"parallel.tensor={n} splits each row's {positions} positions"
                           + (f" (data.seq_len={cfg.data.seq_len} over parallel.context={p.context})"
                              if p.context > 1 else "")
                           + f" between blocks over {n} ranks (sequence parallelism): set data.seq_len to a "
                           f"multiple of {n * p.context * (2 if p.context > 1 else 1)}.")
    if objectives.spec(cfg).family != "lm":
        raise ShardlmError(f"parallel.tensor={n} with train.objective={cfg.train.objective}: tensor parallelism "
                           "trains the next-token loss (text and examples) only so far; use parallel.tensor=1.")
    if p.sharding not in ("full", "grad_op"):
        raise ShardlmError(f"parallel.tensor={n} with parallel.sharding={p.sharding}: FSDP2 shards over the data "
                           "ranks of a (data x tensor) mesh here; use parallel.sharding=full or grad_op.")
    if compiled and ac_mode(p.activation_checkpointing)[0] != "none":
        raise ShardlmError(f"parallel.tensor={n} with parallel.compile and parallel.activation_checkpointing="
                           f"{p.activation_checkpointing} together: torch 2.13 cannot compile a checkpointed block "
                           "whose weights are split (dynamo saves the split's device mesh with its tensors). Use "
                           "one of the two: parallel.compile=false, or parallel.activation_checkpointing=none.")
    for key, value, why in (("lora.quantize", cfg.lora.quantize if cfg.lora.r else None, "4-bit bases are not split"),
                            ("parallel.precision", "fp8" if p.precision == "fp8" else 0, "float8 linears are not "
                             "split yet"), ("parallel.cpu_offload", p.cpu_offload, "not with split weights yet")):
        if value:
            raise ShardlmError(f"parallel.tensor={n} with {key}={value}: {why}; use parallel.tensor=1 for it.")


def check_model(hf_cfg: Any, cfg: Config) -> None:
    """The family has a plan, and N divides what is split: query and key/value heads, the MLP's width."""
    n = cfg.parallel.tensor
    if n == 1:
        return
    family = getattr(hf_cfg, "model_type", None)
    if family not in TENSOR_FAMILIES:
        raise ShardlmError(f"parallel.tensor={n}: model family {family!r} has no tensor-parallel plan here "
                           f"(families with one: {', '.join(TENSOR_FAMILIES)}); use parallel.tensor=1 and FSDP2 "
                           "alone (parallel.sharding).")
    if family == "gpt2" and cfg.lora.r:
        raise ShardlmError(f"parallel.tensor={n} with lora.r={cfg.lora.r} on GPT-2: its Conv1D split takes no "
                           "adapters yet (Llama, Qwen and Mistral bases do); use parallel.tensor=1 for GPT-2 LoRA.")
    heads = hf_cfg.num_attention_heads
    width = (getattr(hf_cfg, "n_inner", None) or 4 * hf_cfg.hidden_size) if family == "gpt2" else \
        hf_cfg.intermediate_size
    split = {"attention heads": heads, "key/value heads": getattr(hf_cfg, "num_key_value_heads", None) or heads,
             "MLP width (intermediate_size)": width}
    for what, count in split.items():
        if count % n:
            raise ShardlmError(f"parallel.tensor={n} does not divide the model's {what} ({count}): each rank holds "
                               f"1/{n} of them. Set parallel.tensor to a divisor of {count}.")


def local_config(hf_cfg: Any, n: int) -> Any:
    """The config of one tensor rank's blocks: 1/n of the heads (query and key/value) and of the MLP's width, the
    same head size. A model built from it holds what a rank holds (its embeddings, norms and head whole): what
    `shardlm estimate` counts and measures a block of."""
    if n == 1:
        return hf_cfg
    import copy

    local = copy.deepcopy(hf_cfg)
    heads = hf_cfg.num_attention_heads
    if hf_cfg.model_type == "gpt2":  # heads of width n_embd / n_head: n_embd itself is the residual stream's
        raise ShardlmError("shardlm estimate does not count GPT-2 under parallel.tensor yet; estimate it with "
                           "parallel.tensor=1 (an upper bound: the split divides the blocks' weights and "
                           "activations).")
    local.head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads
    local.num_attention_heads = heads // n
    local.num_key_value_heads = (getattr(hf_cfg, "num_key_value_heads", None) or heads) // n
    local.intermediate_size = hf_cfg.intermediate_size // n
    return local


def block_plan(block: nn.Module) -> dict[str, Any]:
    """Megatron's split of one block with sequence parallelism, as `parallelize_module` takes it (names under the
    block; torchtitan's Llama plan). Between blocks each rank holds 1/N of the rows' positions (Shard(1)): its norms
    run on those (their weights replicated DTensors, whose partial gradients FSDP2 sums over the tensor ranks);
    attention and MLP all-gather their input once (PrepareModuleInput) and hand it to the column-wise projections,
    and the row-wise ones reduce-scatter their sums back to the positions' shards."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1)
    plan: dict[str, Any] = {
        "input_layernorm": SequenceParallel(use_local_output=True),
        "post_attention_layernorm": SequenceParallel(use_local_output=True),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
    }
    for name in COLUMNWISE:
        plan |= _with_adapters(block, name, ColwiseParallel(), Replicated(), ColwiseParallel())
    for name in ROWWISE:
        plan |= _with_adapters(block, name, RowwiseParallel(output_layouts=seq),
                               RowwiseParallel(output_layouts=seq), SequenceParallel(use_local_output=True))
    return {**plan, **{name: HeadNorm() for name in HEAD_NORMS if _has(block, name)}}


def _with_adapters(block: nn.Module, name: str, base: Any, lora_a: Any, lora_b: Any) -> dict[str, Any]:
    """The projection's style, or under LoRA (PEFT's wrapper: base_layer, lora_A, lora_B) the base layer's and its
    adapters', split so their sum is the base's layout. Column-wise base: A (in x r) replicated on the replicated
    input, B split by output columns like the base. Row-wise base: A split by input features like the base, its
    partial sums reduce-scattered to the rank's positions, B (r x out) replicated on them. Whichever adapter is
    replicated gets partial gradients (each rank's share), which FSDP2 sums over the tensor ranks."""
    if not _has(block, f"{name}.base_layer"):
        return {name: base}
    adapters = [a for a, _ in block.get_submodule(f"{name}.lora_A").named_children()]
    return {f"{name}.base_layer": base, **{f"{name}.lora_A.{a}": lora_a for a in adapters},
            **{f"{name}.lora_B.{a}": lora_b for a in adapters}}


def gpt2_plan() -> dict[str, Any]:
    """GPT-2's block as Llama's (sequence parallel between blocks), on HF's Conv1D layers: c_attn and c_fc split by
    output columns, the two c_proj by input rows. c_attn holds q|k|v side by side: a rank's columns are its heads of
    each, a strided shard (`Conv1DColwise(fused=3)`)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    seq = Shard(1)
    return {"ln_1": SequenceParallel(use_local_output=True), "ln_2": SequenceParallel(use_local_output=True),
            **{name: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
               for name in ("attn", "mlp")},
            "attn.c_attn": Conv1DColwise(fused=3), "mlp.c_fc": Conv1DColwise(),
            "attn.c_proj": Conv1DRowwise(), "mlp.c_proj": Conv1DRowwise()}


def parallelize_blocks(blocks: nn.ModuleList, mesh: Any) -> None:
    """Split each block over the tensor mesh (before FSDP2 shards the result over the data ranks); the first block
    takes its rank's positions of the hidden states, the last gives them all back (the final norm, head and loss
    run whole, the same on every tensor rank)."""
    if _is_gpt2(blocks[0]):
        check_strided_shards(mesh)  # collectively, once: every GPT-2 block splits its q|k|v the same way
    for block in blocks:
        # torch's SequenceParallel and distribute_module register new parameters, trainable: LoRA's frozen norms
        # would train (checked: the norms of a LoRA run had gradients)
        frozen = {name for name, p in block.named_parameters() if not p.requires_grad}
        _split_block(block, mesh)
        for name, p in block.named_parameters():
            p.requires_grad_(name not in frozen)
    blocks[0].register_forward_pre_hook(_to_positions(mesh), with_kwargs=True)
    blocks[-1].register_forward_hook(_from_positions(mesh))


def _split_block(block: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    if _is_gpt2(block):
        parallelize_module(block, mesh, gpt2_plan())
        attn: Any = block.attn
        attn.split_size //= mesh.size()  # its q, k, v: each the rank's heads
    else:
        parallelize_module(block, mesh, block_plan(block))


def _to_positions(mesh: Any):
    """The hidden states entering the first block, cut to this rank's positions: differentiably (a DTensor
    redistribution), so the backward all-gathers their gradients and the embeddings get every position's."""
    from torch.distributed.tensor import Replicate

    def cut(x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)]) \
            .to_local()

    def hook(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (cut(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": cut(kwargs["hidden_states"])}

    return hook


def _from_positions(mesh: Any):
    """The last block's output, all positions again (an all-gather whose backward keeps this rank's share)."""
    from torch.distributed.tensor import Replicate

    def whole(x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()]) \
            .to_local()

    def hook(_m: nn.Module, _args: tuple, out: Any) -> Any:
        return whole(out) if torch.is_tensor(out) else (whole(out[0]), *out[1:])

    return hook


def _is_gpt2(block: nn.Module) -> bool:
    return _has(block, "attn.c_attn")


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _strided(t: Any) -> bool:
    """A DTensor split by tensor parallelism as a strided shard (GPT-2's q|k|v): past mesh dim 0, FSDP2's own."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements[1:])


def storable(state: Any) -> Any:
    """A (nested) state dict as DCP can save it: each strided shard moved to a plain shard of the same dim (DCP
    refuses strided ones: "overlapping chunks"). `restored` moves them back after a load."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(state, dict):
        return {k: storable(v) for k, v in state.items()}
    if _strided(state):
        placements = state.placements
        return state.redistribute(placements=[placements[0], *(
            Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements[1:])])
    return state


def restored(state: Any, like: Any) -> Any:
    """`state` (loaded into `storable`'s layout) with each tensor placed as its counterpart in `like` again."""
    if isinstance(state, dict) and isinstance(like, dict):
        return {k: restored(v, like[k]) if k in like else v for k, v in state.items()}
    if _strided(like) and isinstance(state, DTensor) and state.placements != like.placements:
        return state.redistribute(placements=like.placements)
    return state


def strided_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of the parameters split as strided shards (GPT-2's q|k|v under parallel.tensor)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return [k for k, v in get_model_state_dict(model).items() if _strided(v)]


def place_strided(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Rank 0's whole weights (`full`, empty elsewhere) into the strided shards, which torch's full-state-dict
    loading slices as if they were plain ones (each rank would get columns of other heads): broadcast whole, then
    each rank takes its piece (a replicated DTensor redistributed to the parameter's placements: a local slice)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import Replicate

    params: dict[str, Any] = dict(get_model_state_dict(model))
    for key, param in params.items():
        if _strided(param):
            whole = full[key].to(param.device, param.dtype) if key in full else \
                torch.empty(param.shape, dtype=param.dtype, device=param.device)
            torch.distributed.broadcast(whole, src=0)
            mesh = param.device_mesh
            mine = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False) \
                .redistribute(placements=param.placements).to_local()
            with torch.no_grad():
                param.to_local().copy_(mine)

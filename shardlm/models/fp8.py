"""float8 training (`parallel.precision=fp8`): torchao's float8 linears, FSDP2's float8 all-gather.

What runs in float8: the matmuls of the linear layers of the middle transformer blocks (tensorwise dynamic
scaling, torchao's default recipe). Their weights stay fp32 masters; under FSDP they are cast to float8
*before* the all-gather (half the bytes of bf16 on the wire), with one all-reduce of the scales per step
after the optimizer (`after_optimizer_step`). Everything else computes in bf16.

What stays in bf16, and why:
- the lm_head (output embedding): its input feeds the softmax directly, so its quantization error is not
  averaged away by later layers; it is usually tied to the input embedding, whose weight must stay a
  plain tensor; and shardlm's chunked loss multiplies by `head.weight` itself, never calling the module.
- every layer of the first and the last block: the ends of the network are the most sensitive to float8
  error (the first block sees the raw embeddings, the last one feeds the head), so torchao's example
  leaves the last layer unconverted and accelerate's torchao recipe keeps the first and the last linears
  in high precision for stability. Whole blocks are kept here: 2 of N blocks cost little speed.
- linears whose in or out features are not multiples of 16: `torch._scaled_mm` needs them, and such
  layers are too small to gain anyway. Weights shared between modules are kept too (tying survives).

GPT-2's layers are `transformers.pytorch_utils.Conv1D`, a linear whose weight is stored transposed, as
(in, out), computing `x @ W + b`; torchao converts only `nn.Linear`, so GPT-2 would get no float8 at all.
`Float8Conv1D` is a `Float8Linear` that keeps Conv1D's own parameter, shape and name: torchao's float8
matmul takes the weight as its already-transposed (in, out) operand (`Float8Linear` passes
`self.weight.t()`), so Conv1D's weight is passed as is. State-dict keys, shapes and values are unchanged
(checkpoints, DCP resume, HF export and plain HF state dicts all work both ways), the FSDP float8 weight
wrapper applies as for any `Float8Linear`, tensorwise scales do not depend on the layout, and the
transposed fp8 copy `torch._scaled_mm` needs moves from the backward (Linear) to the forward (Conv1D):
one per step either way.

Float8 needs `torch._scaled_mm` on an NVIDIA Hopper (sm90) or newer GPU, and `torch.compile` to fuse the
amax/scale/cast kernels: eager float8 is slower than bf16, so `check_float8` refuses it.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from shardlm import ShardlmError

if TYPE_CHECKING:
    from torchao.float8.float8_linear import Float8Linear
    from transformers import PreTrainedModel
    from transformers.pytorch_utils import Conv1D

MIN_CAPABILITY = (9, 0)  # Hopper: the first NVIDIA GPUs with float8 tensor cores usable by torch._scaled_mm
ALIGN = 16  # torch._scaled_mm needs both matrix dimensions to be multiples of 16


def check_float8(device: torch.device, compile_mode: str) -> None:
    """Raise a one-line ShardlmError naming what stops float8 training here and how to fix it."""
    if device.type != "cuda":
        raise ShardlmError(f"parallel.precision=fp8 needs an NVIDIA Hopper (sm90) or newer GPU, not {device.type}; "
                           "use parallel.precision=bf16.")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ShardlmError(
            f"parallel.precision=fp8 needs an NVIDIA Hopper (sm90) or newer GPU; {torch.cuda.get_device_name(device)} "
            f"is sm{capability[0]}{capability[1]}. Use parallel.precision=bf16.")
    _torchao_float8()
    if compile_mode == "false":
        raise ShardlmError("parallel.precision=fp8 without torch.compile is slower than bf16 (the float8 casts run "
                           "as separate kernels): set parallel.compile=model or parallel.compile=blocks.")


DEEP = 24  # blocks from which one whole-model fp8 graph takes minutes to compile


def compile_time_note(compile_mode: str, per_block: bool, n_blocks: int) -> str | None:
    """fp8's whole-model graph compiles for minutes at depth: torchao's scaling adds ops to every block, and
    `compile=model` traces each block anew (on CPU, 12 fp8 blocks: 94 s against 34 s with `compile=blocks`,
    which compiles one block's graph and reuses it; benchmarks/compile_time.py). GPT-2 XL's 48 had not
    compiled after 211 s on an H200, the GPU idle."""
    if compile_mode != "model" or per_block or n_blocks < DEEP:
        return None
    return (f"note: parallel.precision=fp8 with parallel.compile=model compiles all {n_blocks} blocks as one graph, "
            "which takes minutes at this depth before the first step; parallel.compile=blocks compiles one block "
            "and reuses it (on CPU, 12 fp8 blocks: 34 s against 94 s).")


def convert_to_float8(hf_model: PreTrainedModel, blocks: nn.ModuleList, fsdp: bool, emulate: bool = False) -> list[str]:
    """Swap, in place, the eligible linears of `hf_model` for torchao float8 training layers.

    Call it before activation checkpointing, torch.compile and fully_shard; it works on a `meta` model.
    `fsdp` turns on FSDP2's float8 all-gather (then call `after_optimizer_step` after each step).
    `emulate` computes the float8 matmuls in fp32 (for tests on machines without float8 matmuls).
    Returns the names (in `hf_model`) of the modules it converted; raises ShardlmError when the model would
    have no float8 layer at all (e.g. 2 blocks: both stay bf16).
    """
    config = float8_config(fsdp, emulate)
    keep = kept_in_high_precision(hf_model, blocks)
    converted = []
    for name, module in list(hf_model.named_modules()):
        if id(module) not in keep and eligible(module):
            parent, _, child = name.rpartition(".")
            setattr(hf_model.get_submodule(parent), child, _to_float8(module, config))
            converted.append(name)
    if not any(is_float8(m) for m in hf_model.modules()):
        raise ShardlmError(
            f"parallel.precision=fp8 finds no layer of {type(hf_model).__name__} to run in float8: the first and "
            f"last blocks stay bf16 (it has {len(blocks)}) and linears need in/out features that are multiples of "
            f"{ALIGN}. Use parallel.precision=bf16 or a model with 3+ blocks.")
    return converted


def after_optimizer_step(model: nn.Module) -> None:
    """After each optimizer step: one all-reduce computes every float8 weight's scale for the next
    all-gather (torchao's precompute). A no-op without FSDP's float8 all-gather or without float8 layers.

    The scales are kept until the next call, so call it too after anything else rewrites the weights of a
    model that has stepped (e.g. loading a checkpoint into it); a model that never stepped scales on the fly.
    """
    if not any(is_float8(m) and m.config.enable_fsdp_float8_all_gather for m in model.modules()):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def plain_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` with FSDP's float8 weight wrappers replaced by the plain tensors they hold: a full state dict
    of a float8 FSDP model holds `WeightWithDynamicFloat8CastTensor`s, which must not end up in a plain
    HF model (load_state_dict(assign=True)) or in safetensors."""
    return {k: _unwrap(v) for k, v in state.items()}


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    inner = getattr(t, "_tensor", None)
    if isinstance(inner, torch.Tensor) and type(t).__name__ == "WeightWithDynamicFloat8CastTensor":
        return inner.detach()  # outside FSDP the wrapper holds the original nn.Parameter
    return t


def float8_config(fsdp: bool, emulate: bool = False):
    """torchao's tensorwise recipe (the fastest; the only one FSDP's float8 all-gather supports)."""
    return _torchao_float8().Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp, emulate=emulate)


def kept_in_high_precision(hf_model: PreTrainedModel, blocks: nn.ModuleList) -> set[int]:
    """ids of the modules that must not convert: the lm_head, all of the first and the last block, and
    every module whose weight is shared with another module or place (tied embeddings stay tied)."""
    keep = {id(m) for end in (blocks[:1], blocks[-1:]) for block in end for m in block.modules()}
    head = hf_model.get_output_embeddings()
    if head is not None:
        keep.add(id(head))
    users: dict[int, list[nn.Module]] = {}  # a module reachable under two names counts twice
    for _, module in hf_model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), []).append(module)
    keep.update(id(m) for shared in users.values() if len(shared) > 1 for m in shared)
    return keep


def eligible(module: nn.Module) -> bool:
    """A plain `nn.Linear` or GPT-2 `Conv1D` whose in and out features are multiples of 16."""
    if is_float8(module):
        return False
    if type(module) is nn.Linear:
        return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0
    if _is_conv1d(module):
        return module.nx % ALIGN == 0 and module.nf % ALIGN == 0
    return False


def is_float8(module: nn.Module) -> TypeGuard[Float8Linear]:
    """Whether `module` is a torchao float8 training layer (Float8Linear or Float8Conv1D)."""
    return any(c.__name__ == "Float8Linear" and c.__module__.startswith("torchao.") for c in type(module).__mro__)


def _is_conv1d(module: nn.Module) -> TypeGuard[Conv1D]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, Conv1D)


def _to_float8(module: nn.Module, config) -> nn.Module:
    if _is_conv1d(module):
        return float8_conv1d_class().from_conv1d(module, config)
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear.from_float(module, config=config)


@functools.cache
def _torchao_float8():
    """torchao.float8, imported quietly (its CUDA extension loader and pytree log warnings on import), or a
    one-line ShardlmError saying how to install it."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for lg in quiet:
                lg.setLevel(logging.ERROR)
            import torchao.float8 as ao_float8
    except ImportError as e:
        raise ShardlmError(f"parallel.precision=fp8 needs torchao ({e}): pip install torchao "
                           "(or pip install 'shardlm[fp8]').") from None
    finally:
        for lg, level in zip(quiet, levels, strict=True):
            lg.setLevel(level)
    return ao_float8


@functools.cache
def float8_conv1d_class() -> type[Float8Linear]:
    """`Float8Conv1D`, built on first use so that shardlm imports without torchao."""
    _torchao_float8()
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    class Float8Conv1D(Float8Linear):
        """GPT-2's Conv1D (weight (in, out), y = x @ W + b) with torchao's float8 matmul. The weight keeps
        Conv1D's layout, so it is the already-transposed operand torchao's matmul expects."""

        @classmethod
        def from_conv1d(cls, mod: Conv1D, config) -> Float8Conv1D:
            with torch.device("meta"):
                new = cls(mod.nx, mod.nf, bias=False, config=config)
            new.nf, new.nx = mod.nf, mod.nx
            new.weight, new.bias = mod.weight, mod.bias
            if config.enable_fsdp_float8_all_gather:  # as Float8Linear.from_float: cast before FSDP's all-gather
                wrapped = WeightWithDynamicFloat8CastTensor(new.weight, new.linear_mm_config,
                                                            config.cast_config_weight.target_dtype)
                new.weight = nn.Parameter(wrapped, requires_grad=mod.weight.requires_grad)
            return new

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled(input.device.type):  # what F.linear would compute in
                input = input.to(torch.get_autocast_dtype(input.device.type))
            output = matmul_with_hp_or_float8_args.apply(input, self.weight, self.linear_mm_config, self.config)
            return output if self.bias is None else output + self.bias.to(output.dtype)

    return Float8Conv1D

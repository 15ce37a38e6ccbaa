"""QLoRA's torchao backend (`lora.quant_backend=torchao`, auto's choice when sharded or off CUDA): the frozen linears
of the blocks held as torchao `NF4Tensor`s (4-bit NormalFloat in blocks of 64 weights, each block's scale in int8,
the scales quantized again per group: torchtune's QLoRA), which FSDP2 shards and all-gathers in 4 bits (NF4Tensor
implements `fsdp_pre_all_gather` / `fsdp_post_all_gather`) and which dequantizes per matmul on any device, the CPU
included. bitsandbytes cannot be sharded: its 4-bit state lives on the parameter object, which FSDP2's sharded
parameters do not carry (bitsandbytes#1945, accelerate#3874).

Design:
- GPT-2's Conv1D layers of the blocks become nn.Linear (weight transposed) before PEFT injects the adapters, as
  bitsandbytes' Linear4bit does; `lora.inference_state` puts the dequantized weights back in Conv1D's layout.
- Each weight is quantized whole, once, where the starting weights are: one process in place (`quantize`); under
  FSDP2 rank 0 quantizes and broadcasts the 4-bit codes and scales and every rank keeps its rows (`load_sharded`).
  One process and N ranks so hold the same codes and compute the same model; a weight quantized shard by shard
  would get other scales (the double quantization subtracts the mean of all of the weight's scales).
- The group of scales is 256 (torchtune's) where the weight allows and smaller where it does not, chosen from the
  weight's size alone (a choice by world size would change the quantization): small enough that the weight splits
  into SHARDABLE equal parts of whole groups, as FSDP2's row split of an NF4Tensor needs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.models.causal_lm import transformer_blocks
from shardlm.models.state_keys import state_key

BLOCK = 64  # weights per 4-bit block (one int8 scale each)
MAX_SCALER_BLOCK = 256  # block scales per fp32 factor, at most
SHARDABLE = 8  # a weight's groups of scales are made small enough to split over this many ranks where possible
NEEDS = "lora.quant_backend=torchao"


def nf4_module() -> Any:
    """torchao's NF4 module (its path moved in torchao 0.18)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        from torchao.dtypes import nf4tensor as nf4_tensor  # torchao 0.17
    return nf4_tensor


def import_problem() -> str | None:
    """Why torchao's NF4 does not import here, None when it does (a torchao built for another torch fails at import,
    so the import itself is the check)."""
    try:
        nf4_module()
    except Exception as e:  # noqa: BLE001 - whatever a library's import raises, the answer is the same
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None


def is_nf4(t: Any) -> bool:
    """`t` (a parameter, a DTensor or a plain tensor) holds an NF4Tensor."""
    local = getattr(t, "_local_tensor", t)
    return type(local).__name__ == "NF4Tensor"


def scaler_block(numel: int) -> int:
    """Scales per fp32 factor for a weight of `numel` weights: 256 at most, and small enough that the weight's
    number of groups is a multiple of SHARDABLE where its number of blocks allows."""
    blocks = numel // BLOCK
    twos = (blocks & -blocks).bit_length() - 1  # the power of two in the number of blocks
    return 2 ** max(0, min(int(math.log2(MAX_SCALER_BLOCK)), twos - int(math.log2(SHARDABLE))))


def block_linears(hf_model: nn.Module) -> dict[str, nn.Module]:
    """The Linear / Conv1D layers of the blocks by their name in `hf_model`; with adapters injected, the layers
    under them (PEFT's `base_layer`) and not the adapters' own."""
    from transformers.pytorch_utils import Conv1D

    blocks = {id(b) for b in transformer_blocks(hf_model)}
    out: dict[str, nn.Module] = {}
    for name, module in hf_model.named_modules():
        if id(module) in blocks:
            out.update({f"{name}.{n}": m for n, m in module.named_modules()
                        if isinstance(m, (nn.Linear, Conv1D)) and n and ".lora_" not in f".{n}"})
    return out


def check(linears: dict[str, nn.Module], mesh: tuple[int, ...] = ()) -> None:
    """Refuse the weights this backend cannot hold: blocks of 64 weights, and under FSDP2 (`mesh`: its shape)
    rows and groups of scales that split evenly over the ranks that share a copy."""
    from transformers.pytorch_utils import Conv1D

    shards = mesh[-1] if mesh else 1

    sizes = {n.replace(".base_layer", ""): (m.nf, m.nx) if isinstance(m, Conv1D) else
             tuple(m.get_parameter("weight").shape) for n, m in linears.items()}
    for name, (rows, cols) in sizes.items():
        if (rows * cols) % BLOCK:
            raise ShardlmError(f"lora.quantize=nf4 ({NEEDS}) holds weights in blocks of {BLOCK}, but {name} has "
                               f"{rows}x{cols} = {rows * cols} weights, not a multiple of {BLOCK}. Use "
                               "lora.quantize=null (LoRA on the full-precision base), or lora.quant_backend="
                               "bitsandbytes in one process on a CUDA GPU.")
    if shards <= 1:
        return
    splits = {n: math.gcd(r, r * c // BLOCK // scaler_block(r * c)) for n, (r, c) in sizes.items()}
    bad = next((n for n, s in splits.items() if s % shards), None)
    if bad is not None:
        rows, cols = sizes[bad]
        fits = math.gcd(*splits.values())
        fix = (f"Shard over a number of ranks that divides {fits} (fewer ranks, or parallel.sharding=hybrid_full "
               "with parallel.shard_size)" if fits > 1 else "This model's 4-bit weights split over no number of "
               "ranks: train it in one process")
        raise ShardlmError(f"lora.quantize=nf4 ({NEEDS}) under FSDP2 splits each 4-bit weight by rows over the "
                           f"{shards} ranks that share a copy, but {bad} ({rows}x{cols}) does not split into {shards} "
                           f"equal parts of whole groups of scales. {fix}, or use lora.quantize=null.")


def as_linears(hf_model: nn.Module) -> dict[str, nn.Module]:
    """Replace the blocks' Conv1D layers by nn.Linear holding the transposed weight (on the device they are on,
    meta included); returns every Linear of the blocks by name."""
    from transformers.pytorch_utils import Conv1D

    out = {}
    for name, module in block_linears(hf_model).items():
        if isinstance(module, Conv1D):
            linear = nn.Linear(module.nx, module.nf, bias=module.bias is not None, device=module.weight.device)
            with torch.no_grad():
                linear.weight = nn.Parameter(module.weight.detach().T.contiguous(), requires_grad=False)
                if module.bias is not None:
                    linear.bias = nn.Parameter(module.bias.detach(), requires_grad=module.bias.requires_grad)
            hf_model.set_submodule(name, linear)
            module = linear
        out[name] = module
    return out


def conv1d_names(hf_config) -> set[str]:
    """The names of the layers a plain model of `hf_config` holds as Conv1D (GPT-2's)."""
    from transformers.pytorch_utils import Conv1D

    from shardlm.models.instantiate import empty_model

    return {n for n, m in empty_model(hf_config, "meta").named_modules() if isinstance(m, Conv1D)}


def to_nf4(weight: torch.Tensor) -> Any:
    return nf4_module().to_nf4(weight.detach(), BLOCK, scaler_block(weight.numel()))


def quantize(hf_model: nn.Module, mesh: tuple[int, ...] = ()) -> int:
    """The blocks' linears in 4 bits, in place, frozen (their weights may be on meta: FSDP2 shards them next over
    `mesh`, and `load_sharded` fills them); checked first, so a refused model is left as it was. Returns how many."""
    check(block_linears(hf_model), mesh)
    linears = as_linears(hf_model)
    for linear in linears.values():
        linear.weight = nn.Parameter(to_nf4(linear.get_parameter("weight")), requires_grad=False)
    return len(linears)


SHARDED = ("quantized_data", "quantized_scalers", "quantization_factor")  # split by rows; scaler_mean, nf4: whole


def split_off(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The full-precision weights of `model`'s NF4 parameters, taken out of rank 0's `full` state dict (None on the
    other ranks, whose `full` is empty), by state-dict key: they load apart (`load_sharded`), the rest as usual."""
    return {key: full.pop(key, None) for key in (state_key(n) for n, p in model.named_parameters() if is_nf4(p))}


def load_sharded(model: nn.Module, weights: dict[str, torch.Tensor | None], dist) -> None:
    """Fill the NF4 weights of a sharded `model` (after `to_empty`) from rank 0's full-precision `weights`
    (`split_off`'s): rank 0 quantizes each weight whole and broadcasts its codes and scales, every rank keeps its
    rows (or, where FSDP2 leaves a weight unsharded, all of it, on the compute device)."""
    for name, param in [(n, p) for n, p in model.named_parameters() if is_nf4(p)]:
        parts = _broadcast_parts(weights[state_key(name)], param, dist)
        if hasattr(param, "_local_tensor"):
            _keep_rows(param, parts)
        else:  # a shard group of one rank: FSDP2 ignores it (shardlm.distributed.parallelize), it is whole here
            module, leaf = name.rsplit(".", 1)
            setattr(model.get_submodule(module), leaf, nn.Parameter(_whole(parts, param), requires_grad=False))


def _broadcast_parts(weight: torch.Tensor | None, param: torch.Tensor, dist) -> list[torch.Tensor]:
    """The codes, block scales, group factors, the scales' mean and the NF4 table of `weight` quantized whole on
    rank 0 (`weight` None elsewhere), on every rank, on the compute device (NCCL broadcasts from there)."""
    local: Any = getattr(param, "_local_tensor", param)
    dtype, device = local.quantization_factor.dtype, dist.device
    if weight is not None:
        whole = to_nf4(weight)
        parts = [t.to(device) for t in (whole.quantized_data, whole.quantized_scalers, whole.quantization_factor,
                                        whole.scaler_mean.reshape(1), whole.nf4)]
    else:
        numel = math.prod(param.shape)
        parts = [torch.empty(numel // 2, dtype=torch.uint8, device=device),
                 torch.empty(numel // BLOCK, dtype=torch.int8, device=device),
                 torch.empty(numel // BLOCK // local.scaler_block_size, dtype=dtype, device=device),
                 torch.empty(1, dtype=dtype, device=device), torch.empty(16, dtype=dtype, device=device)]
    if dist.distributed:
        for t in parts:
            torch.distributed.broadcast(t, src=0)
    return parts


def _keep_rows(param: Any, parts: list[torch.Tensor]) -> None:
    """This rank's rows of a DTensor's NF4 shard, copied into the storage FSDP2 allocated for it."""
    local, mesh = param._local_tensor, param.device_mesh  # mesh (shard,) or (replicate, shard): the last splits
    shards, index = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    for attr, t in zip(SHARDED, parts[:3], strict=True):
        rows = t.numel() // shards
        getattr(local, attr).copy_(t[index * rows:(index + 1) * rows])
    device = local.quantized_data.device
    local.scaler_mean, local.nf4 = parts[3].reshape(()).to(device), parts[4].to(device)


def _whole(parts: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """A whole NF4 weight from its broadcast parts."""
    module = nf4_module()
    data, scalers, factors, mean, table = parts
    meta = module.SubclassTensorArgs(param.shape, param.stride(), 0, param.dtype, data.device, False)
    return module.NF4Tensor(meta, BLOCK, scalers.numel(), scaler_block(param.numel()), scalers, factors,
                            mean.reshape(()), data, table)


def dequantized(value: torch.Tensor) -> torch.Tensor:
    """A (gathered) NF4 weight as the float tensor it computes with."""
    local: Any = getattr(value, "_local_tensor", value)
    return local.get_original_weight().float().cpu()


def base_bytes(model: nn.Module) -> int:
    """Bytes this rank holds of the 4-bit weights: codes, scales, factors (each storage once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if not is_nf4(p):
            continue
        local = getattr(p, "_local_tensor", p)
        for attr in (*SHARDED, "scaler_mean"):
            t = getattr(local, attr)
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def bytes_per_weight(numel: int) -> float:
    """What `quantize` holds per weight of a `numel`-weight linear: 4 bits, an int8 scale per block, an fp32 factor
    per group of scales."""
    return 0.5 + 1 / BLOCK + 4 / (BLOCK * scaler_block(numel))

"""The PyTorch/XLA backend (TPUs; XLA:CPU through PJRT for tests): device, sharding, step boundaries.

Everything XLA-specific lives here, behind the calls the rest of shardlm already makes (`pick_device`,
`plan`, `parallelize`, the trainer's batches and step boundary, the checkpoint's host copies), so the
backend can be swapped for PyTorch/XLA's successor without touching the loop.

Which FSDP: SPMD "FSDPv2" (`torch_xla.experimental.spmd_fully_sharded_data_parallel`), not the
one-process-per-device `XlaFullyShardedDataParallel`. SPMD is what maps onto shardlm's strategies: one
process drives a device mesh, and a strategy is a mesh plus where each tensor is sharded -- `full` shards
every parameter over all devices, `hybrid_full` shards within a group and replicates across groups
(FSDPv2's `extra_data_axis`), `no_shard` replicates -- while the batch is always split over every device.
The compiler inserts the all-gathers and reduce-scatters, so parameter names, the optimizer and the
checkpoint see whole logical tensors, exactly as on one CPU. It is also the path PyTorch/XLA recommends on
TPUs. What SPMD decides itself is refused rather than faked: when parameters are re-gathered (`grad_op`,
`hybrid_grad`), CPU offload, and torch.compile (XLA compiles every step's graph anyway).

FSDPv2 is applied the way `SpmdFullyShardedDataParallel` applies it (`mark_sharding` of each parameter on
its largest dimension over the `fsdp` axis, the batch dimension of each block's output over the data axes,
an optimization barrier on each block's backward), but with hooks rather than its wrapper class: the
wrapper renames every parameter (`_orig_module.`), and shardlm's checkpoints, exports and LoRA adapters are
keyed by the Hugging Face names. The checkpoint stays DCP's format, written from host copies of the full
tensors, so a run saved on XLA resumes on a CPU or GPU and exports with the same code (one host only).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from torch import nn

from shardlm import ShardlmError

INSTALL = ("pip install torch==2.9.0 torch-xla==2.9.0 (torch-xla pins its torch release; on a TPU VM add "
           "'torch-xla[tpu]'), then pip install -e . -- or `make test-xla`, which builds .venv-xla that way")
# Peak dense bf16 FLOP/s of one XLA device by TPU type: v2/v3 expose each TensorCore as a device, v4 and newer
# one device per chip (Google Cloud's published per-chip figures).
TPU_PEAK_FLOPS = {"v2": 22.5e12, "v3": 61.5e12, "v4": 275e12, "v5litepod": 197e12, "v5e": 197e12, "v5p": 459e12,
                  "v6e": 918e12}
UNSUPPORTED = {  # parallel.* value on XLA -> why, and what to use
    ("sharding", "grad_op"): "XLA's SPMD compiler decides when parameters are gathered; use parallel.sharding=full",
    ("sharding", "hybrid_grad"): "XLA's SPMD compiler decides when parameters are gathered; use "
                                 "parallel.sharding=hybrid_full",
    ("precision", "fp16"): "fp16 needs loss scaling that XLA devices do not use; use parallel.precision=bf16",
    ("precision", "fp8"): "float8 training is a CUDA (Hopper) feature here; use parallel.precision=bf16",
    ("compile", "model"): "XLA compiles every step's graph itself; use parallel.compile=auto (or false)",
    ("compile", "blocks"): "XLA compiles every step's graph itself; use parallel.compile=auto (or false)",
    ("cpu_offload", True): "parameters live on the XLA devices; use parallel.cpu_offload=false "
                           "(or parallel.sharding=full over more devices)",
    ("activation_checkpointing", "selective"): "torch_xla's checkpoint recomputes whole blocks; use "
                                               "parallel.activation_checkpointing=full (or every:N)",
    ("activation_checkpointing", "offload"): "torch_xla's checkpoint recomputes whole blocks; use "
                                             "parallel.activation_checkpointing=full (or every:N)",
}


def importable() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def wanted(kind: str) -> bool:
    """`parallel.device`: xla, or auto when PJRT_DEVICE names an accelerator (TPU, CUDA, NEURON) and torch_xla is
    installed. PJRT_DEVICE=CPU takes `xla` explicitly: importing torch_xla sets PJRT_DEVICE=CPU where it is unset
    (transformers imports it merely to ask whether it is there), and XLA:CPU is a test vehicle, not a fast path."""
    pjrt = os.environ.get("PJRT_DEVICE", "").upper()
    return kind == "xla" or (kind == "auto" and pjrt not in ("", "CPU") and importable())


def start() -> torch.device:
    """The XLA device of this process, in SPMD mode. SPMD must be switched on before the runtime creates any
    tensor, so this comes first in a run."""
    if not importable():
        raise ShardlmError(f"parallel.device=xla but torch_xla is not installed. Install it: {INSTALL}.")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's per-compilation GSPMD deprecation notice
    import torch_xla
    import torch_xla.runtime as xr

    if xr.process_count() > 1:
        raise ShardlmError(f"parallel.device=xla over {xr.process_count()} hosts is not supported yet: run on one "
                           "host (up to its 4-8 TPU chips), or use CUDA/CPU with torchrun for several nodes.")
    xr.use_spmd()
    return torch_xla.device()


def device_count() -> int:
    """The devices this process drives (SPMD: all of the host's)."""
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count()


def check(parallel: Any, world_size: int) -> None:
    """What XLA cannot do, refused before any work (config values only: no torch_xla needed)."""
    for (key, value), why in UNSUPPORTED.items():
        if getattr(parallel, key) == value:
            raise ShardlmError(f"parallel.{key}={str(value).lower()} is not supported on XLA: {why}.")
    if parallel.wrap not in ("auto", "block"):
        raise ShardlmError(f"parallel.wrap={parallel.wrap} is not supported on XLA: SPMD shards each parameter on its "
                           "own, with no FSDP2 units; use parallel.wrap=block.")
    if world_size > 1:
        raise ShardlmError(f"parallel.device=xla with {world_size} launched processes: on XLA one process drives "
                           "every device of the host (SPMD). Start `shardlm train` once, without a launcher "
                           "(torchrun, srun, mpiexec).")


def mesh(strategy: str, devices: int, shard_size: int | None):
    """The device mesh of a strategy: axes ('replicate', 'fsdp'); parameters are sharded on 'fsdp' only."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    shard = {"full": devices, "no_shard": 1}.get(strategy, shard_size or devices)
    if devices % shard:
        raise ShardlmError(f"parallel.sharding={strategy} needs parallel.shard_size to divide the {devices} XLA "
                           f"devices: {shard} does not. Set parallel.shard_size to a divisor of {devices}.")
    return xs.Mesh(np.arange(devices), (devices // shard, shard), ("replicate", "fsdp"))


def _largest_dim_spec(tensor: torch.Tensor) -> tuple[str | None, ...]:
    spec: list[str | None] = [None] * tensor.dim()
    if spec:
        spec[list(tensor.shape).index(max(tensor.shape))] = "fsdp"
    return tuple(spec)


BATCH_SPEC = (("replicate", "fsdp"),)  # the batch dimension is split over every device


def parallelize(model: nn.Module, blocks: nn.ModuleList, device: torch.device, strategy: str,
                shard_size: int | None, devices: int, activation_checkpointing: str) -> nn.Module:
    """Move to the device (keeping tied weights tied), then FSDPv2: AC -> shard parameters -> shard activations."""
    import torch_xla.distributed.spmd as xs
    from torch_xla.distributed.spmd.xla_sharding import apply_backward_optimization_barrier

    from shardlm.models.state_keys import tied_keys

    tied = tied_keys(model)  # each other name of a shared parameter -> the name it is shared with
    model.to(device)
    for alias, name in tied.items():  # moving to XLA gives every parameter its own tensor: a tied head would untie
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(name))
    the_mesh = mesh(strategy, devices, shard_size)
    xs.set_global_mesh(the_mesh)
    from shardlm.distributed.checkpointing import checkpointed as recomputed  # full and every:N

    for i, block in enumerate(blocks):
        if i in recomputed(activation_checkpointing, len(blocks)):
            blocks[i] = block = checkpointed(block)
        apply_backward_optimization_barrier(block)
        block.register_forward_hook(_shard_batch_of_output)
    shard_parameters(model)
    return model


def shard_parameters(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Each parameter (and its optimizer state) sharded on its largest dimension over the 'fsdp' axis. Also
    after a checkpoint load: copying host tensors into parameters leaves them replicated on every device."""
    import torch_xla.distributed.spmd as xs

    the_mesh = xs.get_global_mesh()
    for param in model.parameters():
        spec = _largest_dim_spec(param)
        xs.mark_sharding(param, the_mesh, spec)
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.device.type == "xla" and value.shape == param.shape:
                xs.mark_sharding(value, the_mesh, spec)


def checkpointed(block: nn.Module) -> nn.Module:
    """torch_xla's checkpoint puts an optimization barrier around the recomputation; plain torch.utils.checkpoint
    would let XLA's common-subexpression pass merge it with the forward, saving nothing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT, checkpoint_fn=_xla_checkpoint)


def _xla_checkpoint(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """torch_xla's checkpoint (reentrant only) takes positional inputs: HF blocks get their masks and positions
    as keywords, bound here."""
    import functools

    from torch_xla.utils.checkpoint import checkpoint

    return checkpoint(functools.partial(module, **kwargs), *args)


def _shard_batch_of_output(_module: nn.Module, _inputs: Any, output: Any) -> None:
    hidden = output[0] if isinstance(output, tuple) else output
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
        shard_batch(hidden)


def shard_batch(tensor: torch.Tensor) -> torch.Tensor:
    """Split dimension 0 over every device of the global mesh (the per-device micro-batches, in rank order)."""
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(tensor, xs.get_global_mesh(), BATCH_SPEC + (None,) * (tensor.dim() - 1))
    return tensor


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    return shard_batch(batch.to(device))


def sync() -> None:
    """Cut the traced graph here and run it: one graph for forward+backward, one for the optimizer step."""
    import torch_xla

    torch_xla.sync()


def compilations() -> int:
    """Graphs XLA has compiled in this process (a step that keeps recompiling is the XLA performance trap)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def peak_flops_per_device() -> float | None:
    """A TPU device's dense bf16 peak, None where it is not known (XLA:CPU, GPUs through XLA, Neuron)."""
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        return None
    from torch_xla._internal import tpu

    try:
        return TPU_PEAK_FLOPS.get(tpu.get_tpu_type())
    except (OSError, KeyError):
        return None


def peak_memory_bytes(device: torch.device) -> int | None:
    """The device's peak bytes in use (TPU); None where the runtime keeps no allocator statistics (XLA:CPU)."""
    import torch_xla.core.xla_model as xm

    try:
        return int(xm.get_memory_info(device)["peak_bytes_used"])
    except (RuntimeError, KeyError, TypeError):
        return None


def host_copy(state: Any) -> Any:
    """A state dict with every XLA tensor copied to the host as the whole logical tensor (DCP writes host
    tensors; a checkpoint saved on XLA resumes anywhere)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: _to_host(v) if isinstance(v, torch.Tensor) and v.device.type == "xla" else v, state)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Assembled from the device shards: `tensor.cpu()` of a sharded tensor compiles a gather graph, anew at
    every save (measured: 29 compilations for a 2-layer model's weights, each checkpoint)."""
    from torch_xla.distributed.spmd import XLAShardedTensor

    shards = XLAShardedTensor(tensor.detach()).local_shards
    if shards[0].indices is Ellipsis:  # replicated: every device holds the whole tensor
        return shards[0].data.clone()
    full = torch.empty(tensor.shape, dtype=tensor.dtype)
    for shard in shards:  # a shard's data may carry padding beyond the tensor's end
        full[tuple(shard.indices)] = shard.data[tuple(slice(0, s.stop - s.start) for s in shard.indices)]
    return full


def rng_state() -> int:
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state())


def set_rng_state(seed: int) -> None:
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(seed)

"""The one place that decides how the model is spread over devices.

`parallelize` applies, in this order: float8 conversion (`parallel.precision=fp8`) -> activation
checkpointing per block (shardlm.distributed.checkpointing) -> torch.compile per block -> `fully_shard` per
block (or per subtree past `parallel.wrap=size:N` parameters), then the root -> torch.compile of the whole
model or of the loss (see `parallelize` for which). Every sharding strategy is a row of
STRATEGIES; nothing else in the code depends on which one is chosen.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.config import Config, ParallelConfig, objectives
from shardlm.config.checks import ac_mode, wrap_size
from shardlm.distributed import checkpointing, context, cpu_comms, tensor, wrapping
from shardlm.distributed.process_group import Dist
from shardlm.models import lora, nf4
from shardlm.models.causal_lm import FORWARDS, CausalLM, transformer_blocks

# strategy -> (hybrid 2-D mesh?, reshard_after_forward). no_shard is a 2-D mesh whose shard dim is 1.
STRATEGIES = {
    "full": (False, True),
    "grad_op": (False, False),
    "no_shard": (True, False),
    "hybrid_full": (True, True),
    "hybrid_grad": (True, False),
}
# fp8 computes the linears of the blocks in float8 and everything else in bf16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclass
class Plan:
    """What parallelize will do, decided (and checked) before any work starts."""

    use_fsdp: bool
    mesh_shape: tuple[int, ...]
    reshard_after_forward: bool
    dtype: torch.dtype
    compile: str  # "model", "blocks" or "false" (auto resolved)
    tensor: int = 1  # parallel.tensor: FSDP2's mesh_shape covers the world's ranks divided by it


def plan(cfg: Config, world_size: int, local_world_size: int, device: torch.device) -> Plan:
    p = cfg.parallel
    if device.type == "xla":
        from shardlm.distributed import xla

        xla.check(p, world_size)
        if what := objectives.spec(cfg).samples(cfg):  # a KV-cache decode of changing length, one graph per token
            raise ShardlmError(f"{what} is not supported on XLA yet: its sampling decodes token by token with a "
                               "growing KV cache, which XLA would recompile at every length. Run it on CUDA or CPU "
                               "(parallel.device=cuda/cpu).")
        return Plan(use_fsdp=False, mesh_shape=(), reshard_after_forward=True, dtype=DTYPES[p.precision],
                    compile="false")
    if p.precision == "fp16" and device.type == "cpu":
        raise ShardlmError("parallel.precision=fp16 needs a GPU: CPUs have no fast fp16 math. "
                           "Use parallel.precision=fp32 (or bf16) on CPU.")
    if p.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ShardlmError(f"parallel.precision=bf16 is not supported by {torch.cuda.get_device_name(device)}. "
                           "Use parallel.precision=fp16 or fp32.")
    if cfg.model.attention in ("flash_attention_2", "flash_attention_3", "flex_attention") and device.type != "cuda":
        raise ShardlmError(f"model.attention={cfg.model.attention} trains on CUDA GPUs only (on {device.type} it "
                           "has no kernels or no backward); use model.attention=auto.")
    compile_ = compile_mode(p.compile, device)
    if p.compile == "auto" and lora.quantized(cfg.lora):
        compile_ = "false"  # bitsandbytes' 4-bit matmuls are not verified under torch.compile here
    if p.precision == "fp8":
        from shardlm.models.fp8 import check_float8

        check_float8(device, compile_)
    use_fsdp = fsdp_enabled(cfg, world_size)
    if not use_fsdp and (world_size > 1 or p.cpu_offload):
        what = "CPU offload" if p.cpu_offload else f"{world_size} ranks"
        raise ShardlmError(f"parallel.fsdp=false cannot run {what}: FSDP2 is the only data-parallel engine. "
                           "Use parallel.fsdp=null (or true) and parallel.sharding=no_shard to replicate.")
    tensor.check_plan(cfg, world_size, device, compiled=compile_ != "false")
    shape = mesh_shape(cfg, world_size, local_world_size)
    context.check_plan(cfg, world_size, device)
    warn_once(gpu_config_warning(cfg, device))  # after the refusals: a config that cannot run says only that
    warn_once(one_rank_per_node_note(cfg, device, use_fsdp, world_size, local_world_size))
    warn_once(memory_notes(cfg, device, use_fsdp))
    return Plan(use_fsdp=use_fsdp, mesh_shape=shape, reshard_after_forward=STRATEGIES[p.sharding][1],
                dtype=DTYPES[p.precision], compile=compile_, tensor=p.tensor)


def gpu_config_warning(cfg: Config, device: torch.device) -> str | None:
    """A config written for a GPU (bf16 or an explicit compile) runs on a CPU: it works, but at sizes chosen for a
    GPU the first thing the user sees is an ETA of hours, with nothing saying why or what to change."""
    p = cfg.parallel
    if device.type != "cpu":
        return None
    found = []  # (the GPU setting, what a CPU run sets instead)
    if p.precision != "fp32":
        found.append((f"parallel.precision={p.precision}",
                      "parallel.precision=fp32 (CPUs without AVX-512 BF16 or AMX emulate bf16)"))
    if p.compile in ("model", "blocks"):
        found.append((f"parallel.compile={p.compile}",
                      "parallel.compile=false (a first compile on a CPU takes 10-60 s)"))
    if not found:
        return None
    return (f"warning: this config was written for a GPU ({', '.join(s for s, _ in found)}) and runs on a CPU, where "
            f"each step takes many times longer; for a CPU run set {' and '.join(f for _, f in found)}, or use a "
            "smaller config such as shakespeare_tiny (shardlm configs lists them).")


def one_rank_per_node_note(cfg: Config, device: torch.device, use_fsdp: bool, world_size: int,
                           local_world_size: int) -> str | None:
    """Full sharding frees each block's gathered weights after its forward and gathers them again for its
    backward. With one rank per node that second gather is a copy (one rank) or crosses the network (one GPU
    per node) for a saving of one block's weights: measured on an H200 (GPT-2 124M, batch 32, compiled, one
    rank), full ran at 0.82x one process's tokens/s and grad_op at 0.95x (on another H200 later, full 0.94x at
    batch 32 and 0.49x at 16: host-bound, docs/distributed.md)."""
    if not (use_fsdp and device.type == "cuda" and cfg.parallel.sharding == "full"
            and (world_size == 1 or local_world_size == 1)):
        return None
    where = "one rank" if world_size == 1 else "one rank per node"
    return (f"note: with {where}, parallel.sharding=grad_op keeps each block's gathered weights from its forward to "
            "its backward instead of gathering them twice: ~15% more tokens/s (measured: 0.82x -> 0.95x of one "
            "process), for one block's weights more memory at the peak.")


def memory_notes(cfg: Config, device: torch.device, use_fsdp: bool) -> str | None:
    """Settings that would do nothing in this run, said once rather than trained silently as if they did."""
    p, notes = cfg.parallel, []
    if wrap_size(p.wrap) and not use_fsdp:
        notes.append(f"parallel.wrap={p.wrap} shapes FSDP2's units and this run has no FSDP (one process): it changes "
                     "nothing (parallel.fsdp=true shards one rank too)")
    if ac_mode(p.activation_checkpointing)[0] == "offload" and device.type == "cpu":
        notes.append("parallel.activation_checkpointing=offload moves saved activations to CPU memory, where a CPU "
                     "run keeps them already: it trains as none (full or selective save memory here)")
    return "\n".join(f"note: {n}." for n in notes) or None


@functools.cache
def warn_once(message: str | None) -> None:
    """On rank 0 only, and once per process (`shardlm tune` plans every trial)."""
    from shardlm.distributed.process_group import launch_rank

    if message and launch_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def mesh_shape(cfg: Config, world_size: int, local_world_size: int) -> tuple[int, ...]:
    """(ranks,) for full/grad_op; (replicas, shard) for the hybrid strategies and no_shard (shard 1).
    The last dimension is how many ranks share one copy of the parameters. Under parallel.tensor=N, FSDP2's
    ranks are the world's divided by N (the tensor ranks split each block instead)."""
    p = cfg.parallel
    world_size, local_world_size = world_size // p.tensor, max(1, local_world_size // p.tensor)
    hybrid, _ = STRATEGIES[p.sharding]
    if p.sharding == "no_shard":
        return (world_size, 1)
    if not hybrid:
        return (world_size,)
    shard = p.shard_size or local_world_size
    if shard > world_size or world_size % shard:
        raise ShardlmError(
            f"parallel.sharding={p.sharding} needs parallel.shard_size to divide the world size: "
            f"{shard} does not divide {world_size} ranks. Set parallel.shard_size to a divisor of "
            f"{world_size} (ranks per node is the usual choice).")
    return (world_size // shard, shard)


def fsdp_enabled(cfg: Config, world_size: int) -> bool:
    """`parallel.fsdp`, with null resolved: FSDP2 when there are several ranks or parameters live on the CPU."""
    p = cfg.parallel
    return world_size > 1 or p.cpu_offload if p.fsdp is None else p.fsdp


def compile_mode(configured: str, device: torch.device) -> str:
    """`auto`: the whole model on CUDA (fastest measured there); off on CPU, where the first compile
    (10-60 s) costs more than short runs and small models gain back."""
    if configured == "auto":
        return "model" if device.type == "cuda" else "false"
    return configured


def device_mesh(pl: Plan, device: torch.device):
    """FSDP2's mesh and, under parallel.tensor, the tensor ranks' (one mesh, tensor innermost, which FSDP2 needs
    to place parameters that are already split)."""
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(pl.mesh_shape) == 2 else ("shard",)
    if pl.tensor == 1:
        return init_device_mesh(device.type, pl.mesh_shape, mesh_dim_names=names), None
    mesh = init_device_mesh(device.type, (*pl.mesh_shape, pl.tensor), mesh_dim_names=(*names, "tensor"))
    return mesh[names], mesh["tensor"]


def parallelize(model: CausalLM, cfg: Config, pl: Plan, dist: Dist) -> nn.Module:
    """fp8 conversion -> AC -> compile blocks -> fully_shard (per block, then root) -> compile. Returns `model`.

    `compile=model` without FSDP compiles the whole model, loss included, as one graph (fastest measured).
    Under FSDP2 the hooks between blocks break a whole-model graph into many and the identical blocks
    recompile, so there it follows FSDP2's recommended pattern (torchtitan's): each block compiled inside
    its FSDP unit, and the loss compiled on its own.
    """
    blocks = transformer_blocks(model.hf)
    check_model(model.hf, cfg, pl)
    if dist.device.type == "xla":  # SPMD FSDPv2: the mesh and shardings of shardlm.distributed.xla, no fully_shard
        from shardlm.distributed import xla

        p = cfg.parallel
        return xla.parallelize(model, blocks, dist.device, p.sharding, p.shard_size or None, dist.devices,
                               p.activation_checkpointing)
    if cfg.parallel.precision == "fp8":
        from shardlm.models.fp8 import convert_to_float8

        converted = convert_to_float8(model.hf, blocks, fsdp=pl.use_fsdp)
        dist.print(f"fp8: {len(converted)} linear layers in float8 (the first and last block and the head in bf16)")
    per_block = pl.compile == "blocks" or (pl.compile == "model" and pl.use_fsdp)
    if cfg.parallel.precision == "fp8":
        from shardlm.models.fp8 import compile_time_note

        warn_once(compile_time_note(pl.compile, per_block, len(blocks)))
    meshes = device_mesh(pl, dist.device) if pl.use_fsdp else (None, None)
    if meshes[1] is not None:  # torchtitan's order: split the blocks, then checkpoint, compile and shard them
        tensor.parallelize_blocks(blocks, meshes[1])
    for i, block in enumerate(blocks):
        blocks[i] = checkpointing.prepare_block(block, i, cfg.parallel.activation_checkpointing, len(blocks),
                                                preserve_rng=cfg.model.dropout > 0, compile_block=per_block)
    if pl.use_fsdp:
        shard(model, blocks, cfg.parallel, pl, meshes[0])
    elif pl.dtype == torch.bfloat16 and cfg.parallel.bf16_residual:
        blocks[0].register_forward_pre_hook(cast_hidden_states(pl.dtype), with_kwargs=True)
    if pl.compile == "model" and model.loss_chunk_size and dist.device.type == "cuda":
        # torch 2.11 + CUDA: inductor's code for the chunked loss launched a Triton kernel on a CPU buffer
        # (triton_poi_fused_zeros: "Pointer argument cannot be accessed from Triton"). The chunked loss is
        # matmul-bound, so it runs eager there; the plain loss (auto's choice on CUDA) is still compiled.
        model.loss_fn = torch.compiler.disable(model.loss_fn)
    elif pl.compile == "model" and pl.use_fsdp:
        model.loss_fn = torch.compile(model.loss_fn, dynamic=False)
    if pl.compile == "model" and not pl.use_fsdp:
        model.compile(dynamic=False)
        model.sequence_logps = torch.compile(model.sequence_logps, dynamic=False)  # type: ignore[method-assign]
    return model


def check_model(hf: nn.Module, cfg: Config, pl: Plan) -> str | None:
    """The memory settings against the model (the run's and its dry run's, on a meta model): every:N within its
    blocks, and size:N forming at least one unit where FSDP2 shards. What they will do, in a line (the dry run's)."""
    p, n_blocks = cfg.parallel, len(transformer_blocks(hf))
    checkpointing.check(p.activation_checkpointing, n_blocks)
    context.check_model(hf.config, cfg)
    tensor.check_model(hf.config, cfg)
    if lora.backend(cfg.lora, None, pl.use_fsdp) == "torchao":  # QLoRA's 4-bit weights: blocks of 64, even shards
        nf4.check(nf4.block_linears(hf), pl.mesh_shape if pl.use_fsdp else ())
    said = [checkpointing.describe(p.activation_checkpointing, n_blocks) or ""]
    if pl.use_fsdp and wrap_size(p.wrap):
        units = wrapping.check_size(hf, wrap_size(p.wrap), pl.compile != "false", p.wrap)
        said.append(f"{len(units)} FSDP2 units of parallel.wrap={p.wrap} and the root")
    return "memory: " + "; ".join(filter(None, said)) if any(said) else None


def cast_hidden_states(dtype: torch.dtype):
    """A pre-hook for the first block that casts the hidden state entering it to `dtype`.

    Without FSDP, bf16 runs under autocast, which casts matmul inputs but leaves the embeddings, and so the
    residual stream that every block adds to, in fp32: twice the bytes of each residual add, norm input and
    saved activation. FSDP's mixed-precision policy runs blocks on bf16 parameters, so its stream is bf16;
    this gives one process the same (the blocks' adds keep bf16, norms still compute in fp32)."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and torch.is_floating_point(args[0]):
            args = (args[0].to(dtype), *args[1:])
        elif torch.is_tensor(kwargs.get("hidden_states")):
            kwargs = {**kwargs, "hidden_states": kwargs["hidden_states"].to(dtype)}
        return args, kwargs

    return hook


def shard(model: CausalLM, blocks: nn.ModuleList, p: ParallelConfig, pl: Plan, mesh) -> None:
    """`fully_shard` each unit of consecutive blocks (`parallel.wrap`: auto, block, blocks:K) or of size:N, then the
    root (embeddings, final norm, head), with explicit prefetch between units of blocks. As in torchtitan, the last
    unit stays gathered after its forward (its backward comes next). Units by size prefetch implicitly: their order
    of use is not known here."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    kwargs = {"mesh": mesh, "reshard_after_forward": pl.reshard_after_forward}
    if pl.dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=pl.dtype, reduce_dtype=torch.float32)
    if p.cpu_offload:  # pinning needs an accelerator; on CPU-only hosts it raises
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if pl.mesh_shape[-1] == 1:  # torch's one-rank shortcut passes a tensor subclass only its first all-gather input
        kwargs["ignored_params"] = {q for q in model.parameters() if nf4.is_nf4(q)}  # QLoRA's NF4 base: held whole
    sharded: list[FSDPModule] = []  # each unit's first block, as fully_shard returns it (a group shares one state)
    if wrap_size(p.wrap):
        for name in wrapping.check_size(model.hf, wrap_size(p.wrap), pl.compile != "false", p.wrap):
            fully_shard(model.hf.get_submodule(name), **kwargs)
    k = wrapping.blocks_per_unit(p.wrap, blocks)
    groups = [list(blocks[i: i + k]) for i in range(0, len(blocks), k)] if k else []
    for i, group in enumerate(groups):
        # the last unit's backward starts right after its forward: keeping it gathered saves re-gathering it
        last = i == len(groups) - 1
        unit = fully_shard(group if len(group) > 1 else group[0],
                           **{**kwargs, "reshard_after_forward": pl.reshard_after_forward and not last})
        sharded.append(unit[0] if isinstance(unit, list) else unit)
    # torch's rule for the root (None): kept gathered after forward, since backward starts with the head it holds
    fully_shard(model, **{**kwargs, "reshard_after_forward": None})
    cpu_comms.use_on_cpu(model, mesh)  # gloo's reduce-scatter is its slowest way to the result
    for name in FORWARDS:  # forwards too (preference pairs', online RL's, distillation's): the root's gathers
        register_fsdp_forward_method(model, name)
    if p.prefetch > 0 and len(sharded) > 1:
        depth = p.prefetch
        for i, unit in enumerate(sharded):
            unit.set_modules_to_forward_prefetch(sharded[i + 1: i + 1 + depth])
            unit.set_modules_to_backward_prefetch(list(reversed(sharded[max(0, i - depth): i])))


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip reduce-scatter/all-reduce on non-final micro-steps of gradient accumulation."""
    sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2's; an unsharded model has none
    if sync is not None:
        sync(enabled)


def reshard(model: torch.nn.Module) -> None:
    """FSDP2 keeps some units gathered after a forward (for the backward that follows): a frozen model has none."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()

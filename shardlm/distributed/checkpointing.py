"""Activation checkpointing of the transformer blocks: what `parallel.activation_checkpointing` keeps for backward.

- `full` (every:1): each block keeps its input only and runs its forward again in backward (~1/3 more compute).
- `every:N`: every N-th block as `full`, the others keep everything (torchtitan's `ac_freq`): memory and compute
  in between.
- `selective`: per op, as torchtitan's op-level policy: each block keeps the outputs of its matmuls and attention
  kernels and recomputes the rest in backward (norms, activations, dropout, residual adds, the attention's
  softmax where it is not fused): most of full's saving of the cheap-to-recompute tensors for few of its flops.
- `offload`: nothing is recomputed; the tensors a block saves for backward go to pinned CPU memory as they are
  made and come back for its backward (torch.autograd.graph.save_on_cpu's hooks, minus the weights and their
  views, which FSDP2 gathers again anyway). On a CPU run they are in CPU memory already: it trains as `none`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper, checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode

from shardlm import ShardlmError
from shardlm.config.checks import ac_mode

# the ops whose outputs `selective` keeps: every matmul and fused attention kernel (on any device) that exists in
# this torch; the others' outputs are recomputed
SAVED_OP_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward")
OFFLOAD_MIN_BYTES = 1024  # smaller saved tensors (scalars, shapes' worth) stay where they are: a copy costs more


@functools.cache
def saved_ops() -> frozenset:
    return frozenset(getattr(torch.ops.aten, name).default for name in SAVED_OP_NAMES
                     if hasattr(torch.ops.aten, name))


def checkpointed(mode: str, n_blocks: int) -> list[int]:
    """The blocks a mode wraps (full, every:N and selective recompute them; offload moves what they save)."""
    name, every = ac_mode(mode)
    if name == "none":
        return []
    if name in ("selective", "offload"):
        return list(range(n_blocks))
    return [i for i in range(n_blocks) if (i + 1) % every == 0]  # torchtitan's: every N-th, counted from 1


def check(mode: str, n_blocks: int) -> None:
    """every:N past the number of blocks would checkpoint none of them: a run the user thinks saves memory."""
    name, every = ac_mode(mode)
    if name == "every" and every > n_blocks:
        raise ShardlmError(f"parallel.activation_checkpointing={mode} checkpoints one block in {every}, and the model "
                           f"has {n_blocks}: none would be. Set N <= {n_blocks} (every:1 is full), or none.")


def describe(mode: str, n_blocks: int) -> str | None:
    """The run header's words for the mode; None for none."""
    name, every = ac_mode(mode)
    if name == "none":
        return None
    if name == "every":
        return f"activation checkpointing every:{every} ({len(checkpointed(mode, n_blocks))} of {n_blocks} blocks)"
    return f"activation checkpointing {name}" if name != "offload" else "activations offloaded to CPU"


def prepare_block(block: nn.Module, index: int, mode: str, n_blocks: int, preserve_rng: bool,
                  compile_block: bool) -> nn.Module:
    """The block as the mode wraps it, compiled if asked. Checkpointed blocks are compiled with their recompute
    inside (the wrapper is compiled); offload's hooks stay outside the compiled block, where they see what its
    graph saves."""
    name, _ = ac_mode(mode)
    if index not in checkpointed(mode, n_blocks):
        name = "none"
    if name == "offload":
        if compile_block:
            block.compile(dynamic=False)
        return OffloadWrapper(block)
    if name == "selective":
        block = checkpoint_wrapper(block, context_fn=selective_contexts, preserve_rng_state=preserve_rng)
    elif name != "none":
        block = checkpoint_wrapper(block, preserve_rng_state=preserve_rng)
    if compile_block:
        block.compile(dynamic=False)
    return block


def selective_policy(_ctx: Any, func: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> Any:
    """A fresh (forward, recompute) pair of contexts per checkpointed call, as torch.utils.checkpoint asks."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy)


class OffloadWrapper(ActivationWrapper):
    """A block whose saved tensors live in pinned CPU memory between its forward and its backward. An
    ActivationWrapper, so state-dict keys lose its `_checkpoint_wrapped_module.` as checkpoint_wrapper's do."""

    @torch.compiler.disable(recursive=False)  # the hooks run eagerly; a whole-model compile still compiles the block
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the weights as this forward sees them (FSDP2's gathered ones by now): saved as they are, or as views
        # (a linear saves its weight transposed), they are not activations
        weights = {p.untyped_storage().data_ptr() for p in self.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_to_cpu, weights), _back):
            return self._checkpoint_wrapped_module(*args, **kwargs)


def _to_cpu(weights: set[int], tensor: torch.Tensor) -> Any:
    """Pack: a device tensor into pinned CPU memory (the copy queued on the stream, as save_on_cpu's). The weights
    stay: they are there anyway (FSDP2's gathered ones are freed and gathered again for backward)."""
    if tensor.device.type == "cpu" or tensor.numel() * tensor.element_size() < OFFLOAD_MIN_BYTES or \
            tensor.untyped_storage().data_ptr() in weights:
        return tensor
    packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
    packed.copy_(tensor, non_blocking=True)
    return tensor.device, packed


def _back(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    device, tensor = packed
    return tensor.to(device, non_blocking=True)


class SelectiveSaved(TorchDispatchMode):
    """Counts the bytes `selective` keeps of a forward run under it: the outputs of the saved ops (what the
    estimate measures one block with)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in saved_ops():
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return out

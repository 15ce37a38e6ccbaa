"""Context parallelism (`parallel.context=N`): each row's tokens split over N ranks, so one rank holds 1/N of a
row's activations.

The ranks form a 2-D mesh (data x context): the N consecutive ranks of a data index read the same rows and each
keeps 2 of the row's 2N chunks, PyTorch's head-tail load balancing for causal attention (the first and last chunk
on rank 0, ...), so every rank attends over as many keys. FSDP2 shards the weights over every rank, data x context
flattened, as torchtitan does: only activations are split by context.

Why not `torch.distributed.tensor.experimental.context_parallel` itself: in PyTorch 2.13 its ring SDPA runs the
CUDA flash / efficient / cuDNN kernels only (on CPU: "Operator aten._scaled_dot_product_flash_attention_for_cpu.
default does not have a sharding strategy registered"), and its flex-attention path has no backward on CPU
("FlexAttention does not support backward on CPU"); and neither keeps packed examples apart under SDPA. So shardlm
takes the flex path's algorithm with SDPA as the kernel: keys and values all-gathered by PyTorch's own op
(`flex_cp_allgather`, whose backward reduce-scatters their gradients), each rank's queries attending to them
through a mask built from global positions (causal, and each packed example alone). The mask is (rows, S/N, S)
per step, the gathered keys and values (rows, S) per layer: what the split does not divide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from shardlm import ShardlmError
from shardlm.config import Config, objectives
from shardlm.data.blocks import Batch
from shardlm.distributed.process_group import Dist

CONTEXT_ATTENTION = "shardlm_context"
# Families whose attention layers call transformers' attention interface with RoPE from position ids and no
# window, verified equal to one process by tests/test_context_parallel.py (llama) and the prototype (the others)
CONTEXT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
SDPA_NAMES = ("sdpa", "shardlm_sdpa")  # models.attention.CAUSAL_SDPA is "shardlm_sdpa"
IGNORE = -100

_active: list[Any] = [None]  # (Context, masks by dtype) while a split step runs


def check_plan(cfg: Config, world_size: int, device: torch.device) -> None:
    """What the config and the launch allow, before any work: N divides the ranks; a text or example objective."""
    n = cfg.parallel.context
    if n == 1:
        return
    if device.type == "xla":
        raise ShardlmError(f"parallel.context={n} is not supported on XLA (its SPMD mesh has no context dimension); "
                           "use parallel.context=1 there, or run on CUDA or CPU.")
    try:  # PyTorch's context-parallel pieces this split is built on (absent from torch 2.9)
        from torch.distributed.tensor.experimental._context_parallel import flex_cp_allgather  # noqa: F401
    except ImportError:
        raise ShardlmError(f"parallel.context={n} needs PyTorch's context-parallel module "
                           "(torch.distributed.tensor.experimental._context_parallel), which torch "
                           f"{torch.__version__} lacks: install a newer torch (2.13 is tested), or set "
                           "parallel.context=1.") from None
    if world_size % n:
        raise ShardlmError(f"parallel.context={n} does not divide the world size ({world_size} ranks): each row is "
                           f"split over {n} ranks of a data index. Launch a multiple of {n} ranks, or set "
                           f"parallel.context to a divisor of {world_size}.")
    if not objectives.spec(cfg).context_split:
        raise ShardlmError(f"parallel.context={n} with train.objective={cfg.train.objective}: rows are split for "
                           "the next-token loss (text and examples) and preference pairs only so far; use "
                           "parallel.context=1 for it.")


def check_model(hf_cfg, cfg: Config) -> None:
    """The family and attention the split runs: SDPA layers with RoPE from position ids and no sliding window."""
    n = cfg.parallel.context
    if n == 1:
        return
    family = getattr(hf_cfg, "model_type", None)
    if family not in CONTEXT_FAMILIES:
        raise ShardlmError(f"parallel.context={n}: model family {family!r} is not supported by context "
                           f"parallelism (supported: {', '.join(CONTEXT_FAMILIES)}); use parallel.context=1.")
    impl = getattr(hf_cfg, "_attn_implementation", None)
    if impl not in (None, *SDPA_NAMES):
        raise ShardlmError(f"parallel.context={n} with model.attention={impl}: the split attends through SDPA "
                           "on gathered keys; use model.attention=auto (or sdpa).")
    window = getattr(hf_cfg, "sliding_window", None)
    layers = getattr(hf_cfg, "layer_types", None) or []
    if (window and getattr(hf_cfg, "use_sliding_window", True)) or any(t != "full_attention" for t in layers):
        raise ShardlmError(f"parallel.context={n}: this {family} model attends through a sliding window, which "
                           "the split's mask does not build; use parallel.context=1, or a config without "
                           "sliding_window.")


class Context:
    """The 2-D mesh (data x context) and this rank's place in it; made on every rank at once (collective)."""

    def __init__(self, size: int, dist: Dist):
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AttentionInterface

        self.size = size
        t = dist.tensor  # parallel.tensor: its ranks innermost, each context rank's block split over them
        self.mesh = init_device_mesh(dist.device.type, (dist.world_size // (size * t), size, t),
                                     mesh_dim_names=("data", "context", "tensor"))
        self.rank = self.mesh["context"].get_local_rank()
        self.process_group = self.mesh["context"].get_group()
        self.group = c10d._get_process_group_name(self.process_group)
        AttentionInterface.register(CONTEXT_ATTENTION, attention_forward)

    def describe(self) -> str:
        tensor = f" x tensor {self.mesh.size(2)}" if self.mesh.size(2) > 1 else ""
        return f"mesh data {self.mesh.size(0)} x context {self.size}{tensor}"


def attach(dist: Dist, cfg: Config) -> None:
    """Give `dist` its context mesh for `parallel.context` > 1 and its tensor groups for `parallel.tensor` > 1:
    micro-batches are then per data index."""
    if cfg.parallel.tensor > 1:
        from torch.distributed.device_mesh import init_device_mesh

        t = dist.tensor = cfg.parallel.tensor
        dist.rows_group = init_device_mesh(dist.device.type, (dist.world_size // t, t),
                                           mesh_dim_names=("rows", "tensor"))["rows"].get_group()
    if cfg.parallel.context > 1:
        dist.context = Context(cfg.parallel.context, dist)


def share(length: int, n: int) -> int:
    """Tokens of a row of `length` that each of `n` context ranks holds: padded to a multiple of 2n."""
    return length if n == 1 else (length + -length % (2 * n)) // n


def split_bytes(hf_cfg, rows: int, length: int, n: int, itemsize: int, layers: int, device: str = "cpu"
                ) -> float:
    """What the split adds on a rank (`shardlm estimate`): the mask of its queries against the whole row (in the
    compute dtype), and each layer's gathered keys and values, which autograd keeps for the backward: on CUDA
    repeated to every query head, as transformers does before SDPA under a mask (grouped-query SDPA would not take
    the kernels that run masks there); on CPU as many heads as the model's keys (`attention_forward`)."""
    heads = hf_cfg.num_attention_heads
    if device == "cpu":
        heads = getattr(hf_cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    whole = length + -length % (2 * n)
    return rows * share(length, n) * whole * itemsize + layers * rows * whole * 2 * heads * head_dim * itemsize


def head_tail(length: int, n: int) -> torch.Tensor:
    """The row's positions in the order the ranks hold them: rank r gets chunks r and 2n-1-r of 2n (PyTorch's
    `_HeadTailLoadBalancer`, which tests/test_context_parallel.py checks this against)."""
    chunks = torch.arange(length).view(2 * n, length // (2 * n))
    return torch.cat([torch.cat([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)])


def documents(positions: torch.Tensor) -> torch.Tensor:
    """Each position's example: a new one wherever the position ids do not go on by one (transformers' rule)."""
    start = torch.ones_like(positions[:, :1], dtype=torch.bool)
    return torch.cat([start, positions[:, 1:] != positions[:, :-1] + 1], 1).cumsum(1)


def split(ctx: Context, batch: Batch) -> tuple[Batch, torch.Tensor]:
    """This rank's share of the rows (inputs, targets, global position ids, preference pairs' sequence ids) and
    its attention mask.

    Rows are padded to a multiple of 2N (the balancer's chunks): padding is never a target and attends to itself
    alone (an example of its own), so no real token sees it and no row of the mask is empty."""
    inputs, targets, positions, segments = batch.inputs, batch.targets, batch.positions, batch.segments
    rows, length = inputs.shape
    pad = -length % (2 * ctx.size)
    if positions is None:
        positions = torch.arange(length, device=inputs.device).expand(rows, length)
    docs = documents(positions)
    if pad:
        inputs = F.pad(inputs, (0, pad))
        targets = F.pad(targets, (0, pad), value=IGNORE)
        positions = F.pad(positions, (0, pad))
        segments = None if segments is None else F.pad(segments, (0, pad), value=-1)
        docs = torch.cat([docs, docs[:, -1:] + 1 + torch.arange(pad, device=docs.device)], 1)
    order = head_tail(length + pad, ctx.size).to(inputs.device)
    mine = order.view(ctx.size, -1)[ctx.rank]
    visible = (order[None, :] <= mine[:, None]) & (docs[:, mine, None] == docs[:, None, order])
    return batch._replace(inputs=inputs[:, mine], targets=targets[:, mine], positions=positions[:, mine],
                          segments=None if segments is None else segments[:, mine]), visible[:, None]


@contextlib.contextmanager
def split_step(dist: Dist, hf_config, batch: Batch) -> Iterator[Batch]:
    """The forward and backward of a micro-batch on this rank's share of its rows (as given without a context
    mesh). The model attends through `attention_forward` meanwhile: activation checkpointing recomputes inside."""
    ctx = getattr(dist, "context", None)
    if not isinstance(ctx, Context):
        yield batch
        return
    batch, visible = split(ctx, batch)
    masks = {torch.bool: visible}  # the only reference: the first layer swaps it for the additive mask
    del visible
    before = hf_config._attn_implementation
    hf_config._attn_implementation, _active[0] = CONTEXT_ATTENTION, (ctx, masks)
    try:
        yield batch
    finally:
        hf_config._attn_implementation, _active[0] = before, None


def summed(x: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums (a preference pair's log-probabilities) over the context ranks of a split step, each of
    which holds part of every row's targets; `x` itself outside one. Differentiable: the backward hands each rank
    the sum of the ranks' gradients (N times one rank's, as every rank computes the same loss from the sums), which
    cancels against FSDP2 averaging gradients over data x context ranks: the loss is scaled per data index."""
    if _active[0] is None:
        return x
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(x, group=_active[0][0].process_group)


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, _mask: None,
                      **kwargs):
    """transformers' SDPA attention on the keys and values of the whole row, gathered from the context ranks; the
    mask is the split's (transformers builds none for this implementation: `_mask` is None)."""
    from torch.distributed.tensor.experimental._context_parallel import flex_cp_allgather
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ctx, masks = _active[0]
    if query.dtype not in masks:
        visible = masks.pop(torch.bool) if torch.bool in masks else next(iter(masks.values())) == 0
        masks[query.dtype] = additive(visible, query.dtype)
    key, value = flex_cp_allgather(key, value, 2, ctx.group)
    if query.device.type == "cpu":  # CPU's flash kernel takes grouped heads under a mask: no repeated keys kept
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=masks[query.dtype],
                                             dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"),
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, masks[query.dtype], **kwargs)


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask as SDPA adds it (0 or -inf) in the queries' dtype, made once a step and shared by every layer:
    given booleans, SDPA converts them at each call and autograd keeps each layer's copy (measured on CPU at 4096
    queries x 8192 keys: +104 MB per layer; in the queries' dtype, nothing)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))

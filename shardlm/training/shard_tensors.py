"""Tensor helpers for optimizers that update FSDP2's sharded parameters (DTensors) in place: the local shard, how
rows split over a shard group, that group and its device, and torch.optim's step protocol (shardlm.training.muon
and shardlm.training.optimizer_variants use them)."""

from __future__ import annotations

import math
from typing import Any

import torch

from shardlm import ShardlmError


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _rows(n: int, ranks: int) -> list[int]:
    """Rows of each rank's slice of an n-row tensor sharded on dim 0 (torch.chunk's split, as FSDP2's)."""
    size = -(-n // ranks)
    return [max(0, min(size, n - r * size)) for r in range(ranks)]


def _comm_device(p: torch.Tensor, home: torch.device) -> torch.device:
    """Where `p`'s collectives run: its mesh's device (CUDA for NCCL even when CPU offload keeps `p` on the CPU)."""
    kind = getattr(getattr(p, "device_mesh", None), "device_type", home.type)
    if kind == home.type:
        return home
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def _shard_ranks(p: torch.Tensor) -> int:
    group = _shard_group(p)
    return 1 if group is None else torch.distributed.get_world_size(group)


def _shard_group(p: torch.Tensor) -> Any:
    """The process group over which `p`'s rows are sharded (FSDP2's Shard(0)); None if `p` is whole here."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard) and mesh.size(dim) > 1:
            if placement.dim != 0:
                raise ShardlmError(f"train.optimizer=muon expects FSDP2's row sharding (Shard(0)), found {placement}.")
            return mesh.get_group(dim)
    return None


def _placed_like(p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...], sharded_rows: bool) -> torch.Tensor:
    """`local` as a DTensor on `p`'s mesh: rows sharded as `p`'s (a row statistic), or replicated (a column one)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(p, DTensor):
        return local
    placements = p.placements if sharded_rows else [Replicate()] * len(p.placements)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


def step_groups(optimizer: torch.optim.Optimizer, closure, update) -> Any:
    """torch.optim's step protocol: the closure's loss (gradients on), then `update(group, params)` for each
    group's parameters that have a gradient."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            update(group, params)
    return loss

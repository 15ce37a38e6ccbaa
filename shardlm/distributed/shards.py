"""What a rank holds of FSDP2's sharded tensors (DTensors): the local shard, the group its rows are sharded over,
how rows split over that group, the device its collectives run on, and a local tensor placed back as a DTensor.

The one home of these helpers: the gradient norm, the optimizers (shardlm.training.optim) and the memory count
(shardlm.observe.hardware) all read a DTensor's local shard through `local_shard`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardlm import ShardlmError


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (its local tensor, without DTensor dispatch); any other tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def splits(placement: Any) -> bool:
    """`placement` divides a tensor over its mesh dimension: Shard, or the strided shard FSDP2 places on a dimension
    that tensor parallelism split first (torch 2.13's _StridedShard is no Shard subclass, and its is_shard() is
    False)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, (Shard, _StridedShard))


def row_split(n: int, ranks: int) -> list[int]:
    """Rows of each rank's slice of an n-row tensor sharded on dim 0 (torch.chunk's split, as FSDP2's)."""
    size = -(-n // ranks)
    return [max(0, min(size, n - r * size)) for r in range(ranks)]


def comm_device(p: torch.Tensor, home: torch.device) -> torch.device:
    """Where `p`'s collectives run: its mesh's device (CUDA for NCCL even when CPU offload keeps `p` on the CPU)."""
    kind = getattr(getattr(p, "device_mesh", None), "device_type", home.type)
    if kind == home.type:
        return home
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def shard_ranks(p: torch.Tensor) -> int:
    """How many ranks share `p`'s rows (1 where `p` is whole here)."""
    group = shard_group(p)
    return 1 if group is None else torch.distributed.get_world_size(group)


def shard_group(p: torch.Tensor) -> Any:
    """The process group over which `p`'s rows are sharded (FSDP2's Shard(0)); None if `p` is whole here."""
    from torch.distributed.tensor import Shard

    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard) and mesh.size(dim) > 1:
            if placement.dim != 0:
                raise ShardlmError(f"this optimizer expects FSDP2's row sharding (Shard(0)), found {placement}: "
                                   "use train.optimizer=adamw.")
            return mesh.get_group(dim)
    return None


def placed_like(p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...], sharded_rows: bool) -> torch.Tensor:
    """`local` as a DTensor on `p`'s mesh: rows sharded as `p`'s (a row statistic), or replicated (a column one)."""
    from torch.distributed.tensor import Replicate

    if not isinstance(p, DTensor):
        return local
    placements = p.placements if sharded_rows else [Replicate()] * len(p.placements)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)

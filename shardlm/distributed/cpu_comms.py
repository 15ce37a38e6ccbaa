"""FSDP2's gradient reduce-scatter on CPU ranks, run as torch's all_to_all and a local sum.

gloo's `reduce_scatter_tensor` is slow: between 2 CPU ranks (torch 2.13) it took 12.1 ms for 600K fp32 values a
rank where `all_to_all_single` of the same chunks and a sum took 6.0 ms (3.7 against 1.1 ms at 150K, 104 against
34 ms at 5M), slower even than gloo's all-reduce of the whole input. FSDP2 reduce-scatters every unit's gradients on
every step, so on CPU that was most of the collective time of a 2-rank step. FSDP2 takes a replacement through its
own hook (`FSDPModule.set_custom_reduce_scatter`): each rank receives every rank's chunk of its shard and adds them
in rank order, which is the reduce-scatter's result. Only CPU meshes get it (NCCL's reduce-scatter is its own)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class AllToAllReduceScatter(ReduceScatter):
    """A reduce-scatter of SUM or AVG as `all_to_all_single` plus a sum over the ranks' chunks; other ops (a
    pre-multiplied sum) go to torch's `reduce_scatter_tensor` unchanged."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> dist.Work | None:
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        ranks = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(ranks, -1), dim=0, out=output_tensor)
        if op == ReduceOp.AVG:
            output_tensor.div_(ranks)
        return None


def applies(device_type: str, mesh_shape: tuple[int, ...]) -> bool:
    """On a CPU mesh whose shard dimension (the last; a hybrid mesh replicates over the first) has 2 ranks or more."""
    return device_type == "cpu" and bool(mesh_shape) and mesh_shape[-1] > 1


def use_on_cpu(model: nn.Module, mesh) -> bool:
    """Give every FSDP2 unit of `model` the all-to-all reduce-scatter where it `applies` to `mesh`; whether it did."""
    from torch.distributed.fsdp import FSDPModule

    if not applies(mesh.device_type, tuple(mesh.shape)):
        return False
    comm = AllToAllReduceScatter()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(comm)
    return True

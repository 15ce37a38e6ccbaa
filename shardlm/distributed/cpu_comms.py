"""FSDP2's gradient reduce-scatter on CPU ranks, run as another of torch's gloo collectives.

gloo's `reduce_scatter_tensor` is its slowest way to that result (`benchmarks/cpu_collectives.py`, 2 ranks, fp32,
torch 2.13, AMD EPYC; results/cpu_collectives_cpu_2026-11-29.json): `all_to_all_single` of the ranks' chunks and a
sum took 0.37-0.57x its time from 150K to 2M values a rank (1.0 against 1.8 ms at 150K, 2.3 against 6.2 ms at 600K,
6.3 against 13.6 ms at 2M). The all-to-all needs a receiving buffer as large as the input; past glibc's 32 MB mmap
threshold each one is fresh pages, and at 5M and 20M values a rank it came within 15% of the reduce-scatter (39 and
167 against 46 and 184 ms), where an all-reduce of the whole input in place, then the rank's chunk, took 26 and 98
ms. So inputs up to 16 MB take the all-to-all and larger ones the all-reduce (FSDP2 does not read its input after
the call). FSDP2 reduce-scatters every unit's gradients on every step, so this was most of a CPU rank's collective
time. It takes a replacement through its own hook (`FSDPModule.set_custom_reduce_scatter`); the result is the
reduce-scatter's (to the bit on 2 ranks, where a sum has one order). Only CPU meshes get it: NCCL's is its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

ALL_TO_ALL_MAX_BYTES = 16 * 2**20  # an input (and its receiving buffer) up to this size takes the all-to-all


class CpuReduceScatter(ReduceScatter):
    """A reduce-scatter of SUM or AVG: `all_to_all_single` and a sum over the ranks' chunks for an input of up to
    ALL_TO_ALL_MAX_BYTES, else an all-reduce of the whole input in place and this rank's chunk. Other ops (a
    pre-multiplied sum) go to torch's `reduce_scatter_tensor` unchanged."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> dist.Work | None:
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        ranks, n = group.size(), output_tensor.numel()
        if input_tensor.numel() * input_tensor.element_size() <= ALL_TO_ALL_MAX_BYTES:
            received = torch.empty_like(input_tensor)
            dist.all_to_all_single(received, input_tensor, group=group)
            torch.sum(received.view(ranks, n), dim=0, out=output_tensor)
        else:
            dist.all_reduce(input_tensor, group=group)
            output_tensor.copy_(input_tensor.view(ranks, n)[group.rank()])
        if op == ReduceOp.AVG:
            output_tensor.div_(ranks)
        return None


def applies(device_type: str, mesh_shape: tuple[int, ...]) -> bool:
    """On a CPU mesh whose shard dimension (the last; a hybrid mesh replicates over the first) has 2 ranks or more."""
    return device_type == "cpu" and bool(mesh_shape) and mesh_shape[-1] > 1


def use_on_cpu(model: nn.Module, mesh) -> bool:
    """Give every FSDP2 unit of `model` the CPU reduce-scatter where it `applies` to `mesh`; whether it did."""
    from torch.distributed.fsdp import FSDPModule

    if not applies(mesh.device_type, tuple(mesh.shape)):
        return False
    comm = CpuReduceScatter()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(comm)
    return True

"""The tensor-parallel styles torch has none for (shardlm.distributed.tensor's plans use them beside torch's own):
HF's GPT-2 Conv1D layers split by columns or rows, computed on local shards, a replicated layer, and Qwen3's
per-head norms on the rank's heads. Each is a `ParallelStyle`, as `parallelize_module` takes it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from shardlm import ShardlmError


class Conv1DColwise(ParallelStyle):
    """HF's Conv1D (`y = x @ W + b`, W of in x out) split by output columns, computed on the rank's shards as plain
    tensors (no DTensor op runs, so no sharding rule of this torch is relied on). Its input arrives replicated (a
    DTensor from PrepareModuleInput); the gradient it returns is this rank's partial sum, marked Partial, which
    PrepareModuleInput's backward reduce-scatters. `fused` parts side by side (q|k|v) are split each: the weight's
    placement is then a strided shard, and the bias stays whole on every rank (FSDP2's own split of a 1-D strided
    shard would not compose with it), each rank adding its slices and its gradient marked partial."""

    def __init__(self, fused: int = 1):
        super().__init__()
        self.fused = fused

    def _apply(self, module: Any, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Partial, Replicate, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        fused, n, rank = self.fused, device_mesh.size(), device_mesh.get_local_rank()
        weight = _StridedShard(1, split_factor=fused) if fused > 1 else Shard(1)
        for name, placement in (("weight", weight), ("bias", Replicate() if fused > 1 else Shard(0))):
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [placement]),
                                                         requires_grad=param.requires_grad))

        def forward(x: Any) -> torch.Tensor:
            local = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
            if fused > 1:
                whole = module.bias.to_local(grad_placements=[Partial()])
                bias = torch.cat([part.chunk(n)[rank] for part in whole.chunk(fused)])
            else:
                bias = module.bias.to_local()
            out = torch.addmm(bias, local.reshape(-1, local.size(-1)), module.weight.to_local())
            return out.view(*local.shape[:-1], -1)

        module.forward = forward
        return module


class Conv1DRowwise(ParallelStyle):
    """HF's Conv1D split by input rows: the rank's features times its rows of W, partial sums reduce-scattered to
    the rank's positions (sequence parallelism), then the bias (replicated; its gradient, summed over the rank's
    positions only, is marked Partial for FSDP2 to sum over the tensor ranks)."""

    def _apply(self, module: Any, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Partial, Replicate, distribute_tensor

        for name, placement in (("weight", Shard(0)), ("bias", Replicate())):
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [placement]),
                                                         requires_grad=param.requires_grad))

        def forward(x: torch.Tensor) -> torch.Tensor:
            partial = (x.reshape(-1, x.size(-1)) @ module.weight.to_local()).view(*x.shape[:-1], -1)
            out = DTensor.from_local(partial, device_mesh, [Partial()], run_check=False) \
                .redistribute(placements=[Shard(1)]).to_local()
            return out + module.bias.to_local(grad_placements=[Partial()])

        module.forward = forward
        return module


def check_strided_shards(mesh: Any) -> None:
    """GPT-2's fused q|k|v is a strided shard: checked once that this torch moves one to a plain shard and back
    (what checkpoints do, shardlm.checkpoint.state) with the right values, collectively on the tensor ranks."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    n = mesh.size()
    whole = torch.arange(2 * 3 * n, dtype=torch.float32).view(2, 3 * n)
    strided = distribute_tensor(whole, mesh, [_StridedShard(1, split_factor=3)])
    mine = torch.cat([part.chunk(n, 1)[mesh.get_local_rank()] for part in whole.chunk(3, 1)], 1)
    there_and_back = strided.redistribute(placements=[Shard(1)]).redistribute(
        placements=[_StridedShard(1, split_factor=3)])
    if not (torch.equal(strided.to_local(), mine) and torch.equal(there_and_back.to_local(), mine)):
        raise ShardlmError(f"GPT-2 under parallel.tensor needs DTensor's strided shards, which torch "
                           f"{torch.__version__} does not place or move right (2.13 is tested): use a newer torch, "
                           "or parallel.tensor=1.")


class Replicated(ParallelStyle):
    """A layer whose weights every tensor rank holds whole (replicated DTensors), run on DTensors as they come: a
    column-wise LoRA base's A, on the replicated input."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return distribute_module(module, device_mesh)


class HeadNorm(ParallelStyle):
    """A norm over each head's features (Qwen3's q_norm, k_norm) on the rank's heads: its weight replicated (a
    DTensor), its input the rank's heads of (batch, seq, heads, head_dim), so the weight's gradient, summed over
    heads, comes out partial on each rank and FSDP2 sums it over the tensor ranks (a plain weight would keep each
    rank's own partial sum, and the ranks' weights would drift apart)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return distribute_module(
            module, device_mesh, None,  # None: every parameter replicated
            lambda _m, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Shard(2)], run_check=False)  # type: ignore[arg-type]
                                           if torch.is_tensor(x) else x for x in inputs),
            lambda _m, out, _mesh: out.to_local())

"""The optimizer update: the global gradient norm, clipping, and which of two updates runs (`plan_update`).

Synchronous clip-and-skip reads the norm on the host (`float(norm)`), scales the gradients and steps unless it
was not finite. That read makes the host wait for the whole backward every step, so the GPU idles while the host
prepares the next one, and clipping makes its own pass over every gradient. The sync-free update
(`train.sync_free_step`) instead hands the clip factor and the non-finite check to AdamW as the `grad_scale` and
`found_inf` tensors it reads for GradScaler (the gradients are divided by the first; a non-zero second skips the
update and its step count, on the device), and the norm is copied to the host without waiting and read one step
later, once the next step's forward and backward are queued. What the host does with it (skip count, schedule,
stopping after `train.max_bad_steps`) then happens before the next update, so the numbers are those of the
synchronous step. Which implementations take those tensors is asked of torch once (`adamw.takes_amp_scaling`):
torch 2.9-2.13 take them in the fused kernels only; where they are not taken the synchronous update runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardlm.config import Config
from shardlm.distributed.shards import local_shard, splits
from shardlm.training.optim.adamw import takes_amp_scaling


# ---- the gradient norm and clipping --------------------------------------------------------------------------
def grad_norm(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The global gradient norm, a 0-d fp32 tensor on `device`; nothing is read on the host.

    torch's get_total_norm over FSDP2's DTensor gradients, computed on the local shards instead: one foreach
    norm, one all-reduce of a scalar over each mesh dimension that shards (replicas hold equal shards).
    DTensor dispatch costs ~15 us of host time per parameter and op (3.1 vs 0.9 ms for GPT-2's 148
    parameters, CPU), which shows wherever the GPU waits on the host. With CPU offload the gradients are on
    the CPU: the scalar travels to `device`, so NCCL can reduce it."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not grads or len(sharded) < len(grads):  # FSDP2 shards every parameter: all DTensors or none
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.nn.utils.get_total_norm(grads).float().to(device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_layout: dict[tuple, list[DTensor]] = {}
    for g in sharded:
        by_layout.setdefault((g.device_mesh, g.placements), []).append(g)
    for (mesh, placements), group in by_layout.items():
        local = [local_shard(g) for g in group]
        squares = torch.stack(torch._foreach_norm(local, 2.0, dtype=torch.float32)).square().sum().to(device)
        for dim, placement in enumerate(placements):
            if splits(placement) and mesh.size(dim) > 1:
                torch.distributed.all_reduce(squares, group=mesh.get_group(dim))
        total += squares
    return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ factor: gradients are scaled by it so their norm is at most `max_norm`."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, device: torch.device) -> torch.Tensor:
    """The global gradient norm (`grad_norm`), the gradients scaled to at most `max_norm` (one foreach multiply)."""
    norm = grad_norm(params, device)
    if max_norm != float("inf"):
        local = [local_shard(g) for p in params if (g := p.grad) is not None]
        if local:
            coef = clip_coefficient(norm, max_norm)
            torch._foreach_mul_(local, coef.to(local[0].device))  # offloaded: a host copy, read right after anyway
    return norm


# ---- which update runs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UpdatePlan:
    """The update a run's steps take: sync-free or synchronous, and why (the run header's `update:` line)."""

    sync_free: bool
    why: str

    def describe(self) -> str:
        how = "sync-free clip-and-skip in the optimizer" if self.sync_free else "synchronous clip-and-skip"
        return f"update: {how} ({self.why})"


def plan_update(optimizer: torch.optim.Optimizer, cfg: Config, device: torch.device) -> UpdatePlan:
    """Sync-free where train.sync_free_step asks for it and the optimizer's implementation takes the clip factor
    and the non-finite flag (asked of torch, never read from a version string); synchronous otherwise, with the
    same losses. Decided once per run: a resume keeps the implementation (optim.base.KeepsImplementation)."""
    if not cfg.train.sync_free_step:
        return UpdatePlan(False, "train.sync_free_step=false")
    if cfg.parallel.precision == "fp16":
        return UpdatePlan(False, "fp16: GradScaler owns grad_scale and found_inf")
    if cfg.parallel.cpu_offload:
        return UpdatePlan(False, "CPU offload: the gradients, so their norm, are on the host anyway")
    if device.type == "xla":
        return UpdatePlan(False, "XLA: the norm is read between the backward's graph and the update's")
    takes, what = takes_amp_scaling(optimizer)
    if not takes:
        return UpdatePlan(False, f"{what} takes no clip factor or non-finite flag")
    return UpdatePlan(True, f"{what} takes the clip factor; the norm is read a step late")


def fused_clip_step(optimizer: torch.optim.Optimizer, norm: torch.Tensor, max_norm: float) -> None:
    """`optimizer.step()` on gradients clipped to `max_norm` (0: no clipping), skipped when `norm` is not finite."""
    finite = torch.isfinite(norm)
    coef = clip_coefficient(norm, max_norm) if max_norm else torch.ones_like(norm)
    optimizer.grad_scale = torch.where(finite, coef.reciprocal(), torch.ones_like(norm))  # type: ignore[attr-defined]
    optimizer.found_inf = (~finite).float()  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]


class LateRead:
    """A 0-d device tensor on its way to the host: the copy is queued now, `value()` waits for that copy alone."""

    def __init__(self, tensor: torch.Tensor):
        self.event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor.detach()

    def value(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.host)

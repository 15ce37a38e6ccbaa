"""AdamW on FSDP2's local shards: the default optimizer (`ShardLocalAdamW`), the functional update Muon and 8-bit
AdamW run on their other tensors (`adamw_on_shards`), and which implementation a device runs and whether it takes
the sync-free step's clip factor and non-finite flag (`takes_amp_scaling`)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardlm.distributed.shards import local_shard
from shardlm.training.optim.base import KeepsImplementation


def fused_on(device: torch.device) -> bool:
    """torch's fused AdamW kernels run on CPU and CUDA; elsewhere (XLA) the foreach one is traced into the graph."""
    return device.type in ("cpu", "cuda")


class ShardLocalAdamW(KeepsImplementation, torch.optim.AdamW):
    """AdamW whose update runs on FSDP2's local shards: the parameters, gradients and state it holds (and
    that DCP checkpoints) stay DTensors; the math gets their local tensors.

    Through DTensor dispatch the fused step costs ~30 us of host time per parameter (5.9 vs 1.5 ms for
    GPT-2's 148 parameters, CPU), and on torch 2.11 it also leaks one DTensorSpec per parameter per step
    (pytorch#188174: host memory grows until a long run is killed). AdamW is elementwise, so the update of
    each shard is the update of the whole tensor. Local tensors that are not plain tensors (float8 weights)
    keep the DTensor path. Which path a group takes is decided once per group and count of parameters with a
    gradient: checking every tensor of every list each step was 3% of a tiny model's step under FSDP2."""

    def _init_group(self, group, *lists):
        has_complex = super()._init_group(group, *lists)
        if self._on_local_shards(group, lists):
            for lst in lists:
                lst[:] = [local_shard(t) for t in lst]
        return has_complex

    def _on_local_shards(self, group: dict, lists: tuple[list, ...]) -> bool:
        """Whether every non-scalar tensor of `group`'s lists is a DTensor over a plain local tensor; the verdict is
        kept beside the group itself (held, so its id is not reused) and asked again when the count changes."""
        verdicts = self.__dict__.setdefault("_local_verdicts", {})
        count = len(lists[0]) if lists else 0
        kept = verdicts.get(id(group))
        if kept is not None and kept[0] is group and kept[1] == count:
            return kept[2]
        tensors = [t for lst in lists for t in lst if isinstance(t, torch.Tensor) and t.dim() > 0]
        verdict = bool(tensors) and all(isinstance(t, DTensor) and type(local_shard(t)) is torch.Tensor
                                        for t in tensors)
        verdicts[id(group)] = (group, count, verdict)
        return verdict


def adamw_on_shards(params: list[torch.Tensor], states: list[dict[str, Any]], group: dict[str, Any]) -> None:
    """torch's functional AdamW over `params`' local shards and their `states` (exp_avg, exp_avg_sq, step; made
    here on the first step), fused where the device has the kernel. A fused kernel reads each step count on the
    parameter's device, so a count that came from elsewhere (a checkpoint of another device) moves there."""
    from torch.optim.adamw import adamw

    device = local_shard(params[0]).device
    fused = fused_on(device)
    for p, s in zip(params, states, strict=True):
        if not s:
            s["step"] = torch.tensor(0.0, dtype=torch.float32)
            s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if fused and s["step"].device != device:
            s["step"] = s["step"].to(device)
    beta1, beta2 = group["betas"]
    adamw([local_shard(p) for p in params], [local_shard(p.grad) for p in params],  # type: ignore[arg-type]
          [local_shard(s["exp_avg"]) for s in states], [local_shard(s["exp_avg_sq"]) for s in states], [],
          [s["step"] for s in states], foreach=None if fused else True, fused=fused or None, amsgrad=False,
          beta1=beta1, beta2=beta2, lr=float(group["lr"]), weight_decay=group["weight_decay"], eps=group["eps"],
          maximize=False, has_complex=False)


def takes_amp_scaling(optimizer: torch.optim.Optimizer) -> tuple[bool, str]:
    """Whether `optimizer`'s step divides the gradients by a `grad_scale` tensor and skips the update (and its
    step count) where `found_inf` is set, as GradScaler's contract says, and which implementation it runs.
    Only torch's Adam family is asked; the others run the synchronous clip-and-skip."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return False, type(optimizer).__name__
    group = optimizer.param_groups[0]
    device = local_shard(group["params"][0]).device
    kind = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    return _probe(device.type, kind), f"{kind} AdamW on {device.type} with torch {torch.__version__}"


@functools.cache
def _probe(device_type: str, kind: str) -> bool:
    """Asked of torch once per device type and implementation (no version strings): a scaled step must equal a
    step on the unscaled gradients, and a flagged one must leave the parameter and its step count as they were.
    An implementation that refuses the tensors (torch 2.9-2.13's foreach asserts) or ignores them answers no."""
    device = torch.device(device_type)

    def step(grad: list[float], scale: float | None, found_inf: float = 0.0) -> tuple[torch.Tensor, float]:
        p = torch.nn.Parameter(torch.tensor([1.0, 2.0], device=device))
        p.grad = torch.tensor(grad, device=device)
        opt = torch.optim.AdamW([p], lr=0.1, eps=1.0, weight_decay=0.0, fused=kind == "fused" or None,
                                foreach=kind == "foreach")
        if scale is not None:
            opt.grad_scale = torch.tensor(scale, device=device)  # type: ignore[attr-defined]
            opt.found_inf = torch.tensor(found_inf, device=device)  # type: ignore[attr-defined]
        opt.step()
        return p.detach().cpu(), float(opt.state[p]["step"])

    try:
        scaled, skipped = step([4.0, -8.0], 4.0), step([4.0, -8.0], 4.0, found_inf=1.0)
    except (AssertionError, RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    plain = step([1.0, -2.0], None)  # eps=1 makes the update depend on the gradient's scale
    return (torch.allclose(scaled[0], plain[0]) and scaled[1] == 1.0
            and torch.equal(skipped[0], torch.tensor([1.0, 2.0])) and skipped[1] == 0.0)

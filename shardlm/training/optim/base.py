"""What every optimizer of train.optimizer shares: torch.optim's step protocol over parameter groups, and a resume
that keeps the implementation this run chose (fused, foreach) instead of the one the checkpoint's writer used.

A checkpoint's param_groups carry the writer's `fused` / `foreach` / `capturable`, and torch's `load_state_dict`
puts them back: an XLA run's checkpoint (foreach) resumed on a CPU or GPU ran the foreach kernel there, which
does not take the sync-free step's `grad_scale` / `found_inf` (issue 45). The implementation follows the device
and torch a run runs on, so `KeepsImplementation` restores it after every load.
"""

from __future__ import annotations

from typing import Any

import torch

from shardlm.distributed.shards import local_shard

IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


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


class KeepsImplementation(torch.optim.Optimizer):
    """A torch optimizer whose `load_state_dict` keeps this run's implementation keys (IMPLEMENTATION) and puts
    each step count where that implementation reads it (the parameter's device for fused and capturable kernels,
    which torch decides from the checkpoint's keys instead)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        chosen = [{k: g[k] for k in IMPLEMENTATION if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, keys in zip(self.param_groups, chosen, strict=True):
            group.update(keys)
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                step = self.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    where = local_shard(p).device if on_device else torch.device("cpu")
                    if step.device != where:
                        self.state[p]["step"] = step.to(device=where, dtype=torch.float32)

"""The optimizer update without a host sync (`train.sync_free_step`).

Reading the gradient norm on the host right after computing it (`float(norm)`) makes the host wait for the
whole backward every step, so the GPU idles while the host prepares the next one; clipping also makes its own
pass over every gradient. Instead the clip factor and the non-finite check go to the fused AdamW as the
`grad_scale` and `found_inf` tensors it already reads for GradScaler (the gradients are divided by the first;
a non-zero second skips the update and its step count, on the device), and the norm is copied to the host
without waiting and read one step later, once the next step's forward and backward are queued. What the host
does with it (skip count, schedule, stopping after `train.max_bad_steps`) then happens before the next update,
so the numbers are those of the synchronous step.
"""

from __future__ import annotations

import torch

from shardlm.distributed.parallelize import clip_coefficient


def supports_sync_free(optimizer: torch.optim.Optimizer) -> bool:
    """Only the fused Adam/AdamW kernels read `grad_scale` / `found_inf` (foreach and XLA's traced step do not)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False) and optimizer.defaults.get("fused"))


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

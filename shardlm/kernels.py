"""A faster CPU tanh-GELU (GPT-2, Gemma), the same function; `use_cpu_kernels` swaps it into a model.

PyTorch's fused CPU kernel evaluates tanh with SLEEF, which is slow on AVX2: on this project's 2-core CPU
the tanh-GELU forward of 393K floats took 0.74 ms against 0.21 ms for erf-GELU, and fwd + bwd was 15% of
the small-model benchmark's step. tanh-GELU is also x * sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3),
and sigmoid costs a quarter of tanh there: the forward takes 0.33 ms. The backward recomputes the sigmoid
from the saved input (no activation memory beyond PyTorch's own) while a tensor is small enough for its
dozen memory passes to stay in cache; larger ones use PyTorch's fused backward, which reads memory once.
Values equal F.gelu(approximate="tanh") to a few float32 ulps (tested). Anything but float32 on a CPU
outside torch.compile (where inductor fuses the activation itself) takes F.gelu unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

C1 = 2 * math.sqrt(2 / math.pi)
C3 = 0.044715
# Above this many elements the composite backward's passes over memory cost more than the fused kernel's tanh
# (measured on a 16 MiB L3: 393K elements 0.75 vs 0.85 ms, 3.1M elements 8.0 vs 7.0 ms).
SMALL_BACKWARD = 1 << 20


class _TanhGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.addcmul(x, x * x, x, value=C3).mul_(C1).sigmoid_().mul_(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        if x.numel() > SMALL_BACKWARD:
            return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")
        x2 = x * x
        s = torch.addcmul(x, x2, x, value=C3).mul_(C1).sigmoid_()
        du = x2.mul_(3 * C3 * C1).add_(C1)  # d(2u)/dx
        return torch.sub(1, s).mul_(x).mul_(du).add_(1).mul_(s).mul_(grad)  # s (1 + x (1 - s) du) grad


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling():
        return _TanhGELU.apply(x)
    return F.gelu(x, approximate="tanh")


class TanhGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tanh_gelu(x)


def _tanh_gelu_types() -> tuple[type, ...]:
    from transformers import activations

    names = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")
    return tuple({getattr(activations, n) for n in names if hasattr(activations, n)})


def use_cpu_kernels(model: nn.Module) -> int:
    """Swap transformers' tanh-GELU modules for TanhGELU (no state: checkpoints and exports are unchanged).
    Returns how many were swapped."""
    types = _tanh_gelu_types()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, types):
                setattr(parent, name, TanhGELU())
                swapped += 1
    return swapped

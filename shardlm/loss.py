"""Linear + cross-entropy computed chunk by chunk, so the full (tokens x vocab) logits never exist.

Hugging Face's causal-LM loss materializes the logits, an fp32 copy and their gradient: at vocab 50257
that is ~0.5 GB per 1024-token sequence. Here each chunk's logits live only long enough to produce the
loss and, in the same pass, the gradients for the hidden states and the head weight (the backward
only scales them), so peak memory is one chunk's logits. The matmul count equals the plain loss's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


class _ChunkedLinearCE(torch.autograd.Function):
    """Works on transposed chunks (vocab x rows): on CPU `W @ h.T` runs ~1.5x faster than `h @ W.T` for
    the thin lm_head shape, and the backward matmuls read the same buffer without a copy."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, with_accuracy):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        n = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if need_grad and bias is not None else None
        w = weight.to(hidden.dtype)
        for start in range(0, n, chunk_size):
            h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
            valid = t != IGNORE
            safe_t = t.clamp(min=0)
            cols = torch.arange(len(t), device=t.device)
            # one (vocab x rows) fp32 buffer per chunk: logits -> exp -> softmax -> its gradient, in place
            buf = (w @ h.t()).float()
            if bias is not None:
                buf += bias.float()[:, None]
            target_logit = buf[safe_t, cols]
            if with_accuracy:
                correct += ((buf.argmax(0) == t) & valid).sum()
            col_max = buf.amax(0, keepdim=True)
            sum_exp = buf.sub_(col_max).exp_().sum(0, keepdim=True)
            lse = (sum_exp.log() + col_max).squeeze(0)
            loss += torch.where(valid, lse - target_logit, 0.0).sum()
            if need_grad:
                buf.div_(sum_exp)
                buf[safe_t, cols] -= 1.0
                if buf.is_cuda or not bool(valid.all()):  # on GPU, masking beats a host sync
                    buf *= valid[None, :]
                grad_logits = buf.to(h.dtype)
                grad_hidden[start:start + chunk_size] = grad_logits.t() @ w
                if h.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits, h)
                else:
                    grad_weight += (grad_logits @ h).float()
                if grad_bias is not None:
                    grad_bias += buf.sum(1)
                del grad_logits
            del buf
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        g_h = (grad_hidden * grad_loss).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        g_w = (grad_weight * grad_loss).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        g_b = (grad_bias * grad_loss).to(ctx.dtypes[1]) if grad_bias is not None and ctx.needs_input_grad[2] \
            else None
        return g_h, g_w, g_b, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = 0,
    bias: torch.Tensor | None = None, with_accuracy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, number of correct argmax predictions) over targets != -100.

    `chunk_size=0` is the plain reference: full logits, F.cross_entropy. `with_accuracy=False` skips the
    argmax (the count is then 0): training does not need it.
    """
    if chunk_size <= 0:
        logits = F.linear(hidden, weight, bias).float()
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
        correct = ((logits.argmax(-1) == targets) & (targets != IGNORE)).sum() if with_accuracy \
            else torch.zeros((), dtype=torch.int64, device=loss.device)
        return loss, correct
    return _ChunkedLinearCE.apply(hidden, weight, bias, targets, chunk_size, with_accuracy)

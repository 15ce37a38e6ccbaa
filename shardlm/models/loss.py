"""Linear + cross-entropy computed chunk by chunk, so the full (tokens x vocab) logits never exist.

Hugging Face's causal-LM loss materializes the logits, an fp32 copy and their gradient: at vocab 50257
that is ~0.5 GB per 1024-token sequence. Here each chunk's logits live only long enough to produce the
loss and, in the same pass, the gradients for the hidden states and the head weight (the backward
only scales them), so peak memory is one chunk's logits. The matmul count equals the plain loss's; with
gradients off (`torch.no_grad()`, evaluation) each chunk is the plain loss: one matmul, no gradient work.

The loop has no data-dependent branch or host sync, so `torch.compile(fullgraph=True)` traces it, unrolled
over the chunks (a new token count is a new graph), together with the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def _zeros_like_grads(hidden, weight, bias, needs: tuple[bool, bool, bool]) -> list[torch.Tensor | None]:
    """fp32 accumulators for the head's gradients; the hidden states' gradient is written chunk by chunk."""
    f32 = {"dtype": torch.float32, "device": weight.device}
    return [torch.empty_like(hidden) if needs[0] else None,
            torch.zeros(weight.shape, **f32) if needs[1] else None,
            torch.zeros(weight.shape[0], **f32) if needs[2] and bias is not None else None]


def _chunk_logits(w, h, bias) -> torch.Tensor:
    """(vocab x rows) fp32: on CPU `W @ h.T` runs ~1.5x faster than `h @ W.T` for the thin lm_head shape, and
    the gradient matmuls read the same buffer without a copy."""
    buf = (w @ h.t()).float()
    if bias is not None:
        buf += bias.float()[:, None]
    return buf


def _chunk_grads(buf, sum_exp, h, w, t, valid, grads, rows: slice) -> None:
    """Turns `buf` (exp of the shifted logits) into d loss / d logits in place and accumulates the gradients.

    Ignored targets are masked on the thin (rows x hidden) side, never on the (vocab x rows) buffer and
    without asking the device whether any target is ignored."""
    grad_hidden, grad_weight, grad_bias = grads
    buf.div_(sum_exp)
    buf[t.clamp(min=0), torch.arange(len(t), device=t.device)] -= 1.0
    grad_logits = buf.to(h.dtype)
    mask = valid[:, None].to(h.dtype)
    if grad_hidden is not None:
        grad_hidden[rows] = (grad_logits.t() @ w) * mask
    if grad_weight is not None:
        if h.dtype == torch.float32:
            grad_weight.addmm_(grad_logits, h * mask)
        else:
            grad_weight += (grad_logits @ (h * mask)).float()
    if grad_bias is not None:
        grad_bias += buf @ valid.float()


def _chunked(hidden, weight, bias, targets, chunk_size: int, with_accuracy: bool, needs: tuple[bool, bool, bool]):
    """(loss sum, correct count, [grad_hidden, grad_weight, grad_bias]) with the gradients of `needs` only."""
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
    grads = _zeros_like_grads(hidden, weight, bias, needs)
    w = weight.to(hidden.dtype)
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h, t = hidden[rows], targets[rows]
        valid = t != IGNORE
        buf = _chunk_logits(w, h, bias)
        target_logit = buf[t.clamp(min=0), torch.arange(len(t), device=t.device)]
        if with_accuracy:
            correct += ((buf.argmax(0) == t) & valid).sum()
        col_max = buf.amax(0, keepdim=True)
        sum_exp = buf.sub_(col_max).exp_().sum(0, keepdim=True)
        loss += torch.where(valid, (sum_exp.log() + col_max).squeeze(0) - target_logit, 0.0).sum()
        _chunk_grads(buf, sum_exp, h, w, t, valid, grads, rows)
        del buf
    return loss, correct, grads


class _ChunkedLinearCE(torch.autograd.Function):
    """The forward computes the gradients too (they need the same logits); the backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, with_accuracy):
        needs = tuple(ctx.needs_input_grad[:3])
        loss, correct, grads = _chunked(hidden, weight, bias, targets, chunk_size, with_accuracy, needs)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, weight.dtype)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grads = ctx.saved_tensors
        out = [None if grads[i] is None else (grads[i] * grad_loss).to(ctx.dtypes[i]) for i in range(3)]
        return *out, None, None, None


def _plain(hidden, weight, bias, targets, with_accuracy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return logits_cross_entropy(F.linear(hidden, weight, bias), targets, with_accuracy)


def logits_cross_entropy(logits, targets, with_accuracy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, correct count) from (tokens x vocab) logits, in fp32 like HF's own loss."""
    logits = logits.float()
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    correct = ((logits.argmax(-1) == targets) & (targets != IGNORE)).sum() if with_accuracy \
        else torch.zeros((), dtype=torch.int64, device=loss.device)
    return loss, correct


def _chunk_without_grad(h, w, bias, t, with_accuracy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows x vocab) logits reduced in place along the contiguous vocab axis: one buffer, and on CPU ~2x faster
    than the (vocab x rows) buffer's column reductions, which only pay off when the gradient matmuls follow."""
    logits = F.linear(h, w, bias).float()
    valid = t != IGNORE
    target_logit = logits.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
    correct = ((logits.argmax(-1) == t) & valid).sum() if with_accuracy \
        else torch.zeros((), dtype=torch.int64, device=h.device)
    row_max = logits.amax(-1, keepdim=True)
    lse = logits.sub_(row_max).exp_().sum(-1).log() + row_max.squeeze(1)
    return torch.where(valid, lse - target_logit, 0.0).sum(), correct


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = 0,
    bias: torch.Tensor | None = None, with_accuracy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, number of correct argmax predictions) over targets != -100.

    `chunk_size=0` is the plain reference: full logits, F.cross_entropy. `with_accuracy=False` skips the
    argmax (the count is then 0): training does not need it.
    """
    if chunk_size <= 0:
        return _plain(hidden, weight, bias, targets, with_accuracy)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias)):
        return _ChunkedLinearCE.apply(hidden, weight, bias, targets, chunk_size, with_accuracy)
    # Not through the Function: its needs_input_grad follows requires_grad, not grad mode, so under no_grad()
    # the head's Parameter would get a gradient (2 more matmuls per chunk).
    w, b = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
    chunks = [_chunk_without_grad(hidden[s:s + chunk_size], w, b, targets[s:s + chunk_size], with_accuracy)
              for s in range(0, hidden.shape[0], chunk_size)]
    return torch.stack([c[0] for c in chunks]).sum(), torch.stack([c[1] for c in chunks]).sum()

"""Distillation's loss: GKD's generalized Jensen-Shannon divergence to a teacher, mixed with the next-token loss.

Per target (TRL's `GKDTrainer.generalized_jsd_loss`, Eq. 1 of the GKD paper): p the student's and q the
teacher's softmax of logits / temperature over the shared vocabulary (the first `vocab` rows of both heads, so
padding rows count in neither); m = (1 - beta) p + beta q; JSD = beta KL(q || m) + (1 - beta) KL(p || m), with
beta 0 the forward KL(q || p) and beta 1 the reverse KL(p || q) exactly (not the vanishing limits).
The loss sum = alpha x JSD + (1 - alpha) x cross-entropy of the targets under the student's whole head.

Chunked (`distill_loss` with `chunk_size` > 0): each chunk of target positions holds its own (rows x vocab)
logits of both models, and the forward writes the gradients as it goes (as `shardlm.models.loss` does for the
cross-entropy), since the divergence's gradient wrt the tempered student logits has a closed form:
forward KL p - q; reverse KL p (log p - log q - KL); JSD (1 - beta) p (log p - log m - KL(p || m)).

A stored top-K teacher (`TopKTeacher`) is K categories plus the rest of the mass as one bucket on each side.
Spreading the teacher's rest over the student's rest in proportion to the student (q_j = Q_rest p_j / P_rest)
gives the bucketed divergence's value and, all log-ratios being constant inside the bucket, its gradient too:
the chunk then runs the full-vocabulary code. With K = vocab there is no bucket and it is the full loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardlm.models.loss import IGNORE

STATS = ("distill", "nll", "student_entropy", "teacher_entropy")


@dataclass
class LiveTeacher:
    """The teacher's final hidden states at the student's positions (same flattened rows) and its head."""
    hidden: torch.Tensor  # [N, Ht]
    weight: torch.Tensor  # [Vt, Ht] plain tensor (gathered)
    bias: torch.Tensor | None = None


@dataclass
class TopKTeacher:
    """Stored scores of the N valid targets, in flattened row-major order."""
    ids: torch.Tensor  # [N, K] int64
    logps: torch.Tensor  # [N, K] float32: log-softmax(teacher logits / temperature) at those ids


@dataclass(frozen=True)
class _Spec:
    beta: float
    temperature: float
    alpha: float
    vocab: int


def generalized_jsd(logp: torch.Tensor, logq: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row divergence from log-probabilities over the last dimension (differentiable: the reference's)."""
    if beta == 0:
        return (logq.exp() * (logq - logp)).sum(-1)
    if beta == 1:
        return (logp.exp() * (logp - logq)).sum(-1)
    logm = torch.logaddexp(logp + math.log1p(-beta), logq + math.log(beta))
    return (beta * (logq.exp() * (logq - logm)).sum(-1)
            + (1 - beta) * (logp.exp() * (logp - logm)).sum(-1))


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def _rest_logp(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log of the probability outside `ids`, per row, without leaving log space (no 1 - sum cancellation)."""
    return logp.scatter(1, ids, float("-inf")).logsumexp(-1)


def _teacher_rest(logps: torch.Tensor) -> torch.Tensor:
    """log of the teacher's mass outside its stored top K: 1 - their sum, floored at the smallest normal float
    (fp32 rounding can leave it at or below 0 where the top K hold nearly all of it)."""
    rest = 1.0 - logps.float().exp().sum(-1)
    return rest.clamp(min=torch.finfo(torch.float32).tiny).log()


def _bucketed_entropy(logps: torch.Tensor) -> torch.Tensor:
    """The teacher's entropy over its K stored categories and the rest as one (a lower bound of the full one)."""
    rest = _teacher_rest(logps)
    return _entropy(logps.float()) - rest.exp() * rest


def full_distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | TopKTeacher,
                      targets: torch.Tensor, *, beta: float, temperature: float, alpha: float, vocab: int
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference: whole (N x vocab) logits and autograd. Logits [..., V] (V >= vocab), targets [...] with
    -100; a `TopKTeacher` (rows = the valid targets) is compared bucket by bucket, K categories and the rest."""
    z = student_logits.reshape(-1, student_logits.shape[-1]).float()
    t = targets.reshape(-1)
    keep = (t != IGNORE).nonzero().squeeze(1)
    nll = F.cross_entropy(z, t, ignore_index=IGNORE, reduction="sum")
    logp = (z.index_select(0, keep)[:, :vocab] / temperature).log_softmax(-1)
    if isinstance(teacher_logits, TopKTeacher):
        ids, logq = teacher_logits.ids, teacher_logits.logps.float().detach()
        teacher_entropy = _bucketed_entropy(logq)
        student_entropy = _entropy(logp.detach())
        if ids.shape[1] < vocab:
            logq = torch.cat([logq, _teacher_rest(logq)[:, None]], 1)
            logp = torch.cat([logp.gather(1, ids), _rest_logp(logp, ids)[:, None]], 1)
        else:
            logp = logp.gather(1, ids)
    else:
        zt = teacher_logits.detach().reshape(-1, teacher_logits.shape[-1]).float().index_select(0, keep)
        logq = (zt[:, :vocab] / temperature).log_softmax(-1)
        teacher_entropy, student_entropy = _entropy(logq), _entropy(logp.detach())
    jsd = generalized_jsd(logp, logq, beta).sum()
    loss = alpha * jsd + (1 - alpha) * nll
    stats = {"distill": jsd.detach(), "nll": nll.detach(), "student_entropy": student_entropy.sum(),
             "teacher_entropy": teacher_entropy.sum()}
    return loss, stats


def _divergence(logp: torch.Tensor, logq: torch.Tensor, beta: float, with_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-row divergence, its gradient wrt the tempered student logits or None), the closed forms."""
    p = logp.exp()
    if beta == 0:
        q = logq.exp()
        value = (q * (logq - logp)).sum(-1)
        return value, (p - q if with_grad else None)
    if beta == 1:
        ratio = logp - logq
        value = (p * ratio).sum(-1)
        return value, (ratio.sub_(value[:, None]).mul_(p) if with_grad else None)
    logm = torch.logaddexp(logp + math.log1p(-beta), logq + math.log(beta))
    kl_teacher = (logq.exp() * (logq - logm)).sum(-1)
    gap = logp - logm
    kl_student = (p * gap).sum(-1)
    value = beta * kl_teacher + (1 - beta) * kl_student
    return value, (gap.sub_(kl_student[:, None]).mul_(p).mul_(1 - beta) if with_grad else None)


def _teacher_logq(teacher: LiveTeacher | TopKTeacher, head: tuple, rows: torch.Tensor, span: slice,
                  logp: torch.Tensor, spec: _Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(the teacher's tempered log-probabilities over the vocabulary for this chunk, its entropies)."""
    if isinstance(teacher, LiveTeacher):
        weight, bias = head
        with torch.no_grad():
            zt = F.linear(teacher.hidden.index_select(0, rows), weight, bias).float()
            logq = zt.div_(spec.temperature).log_softmax(-1)
        return logq, _entropy(logq)
    ids, logps = teacher.ids[span], teacher.logps[span].float()
    if ids.shape[1] >= spec.vocab:
        return torch.empty_like(logp).scatter_(1, ids, logps), _entropy(logps)
    shift = _teacher_rest(logps) - _rest_logp(logp, ids)
    return (logp + shift[:, None]).scatter_(1, ids, logps), _bucketed_entropy(logps)


def _chunk(h, w, b, t, teacher, head, rows, span, spec: _Spec, with_grad: bool):
    """(jsd, nll, student entropy, teacher entropy sums; d loss / d student logits [rows, V] or None)."""
    z = F.linear(h, w, b).float()
    lse = z.logsumexp(-1)
    nll = (lse - z.gather(1, t[:, None]).squeeze(1)).sum()
    logp = (z[:, :spec.vocab] / spec.temperature).log_softmax(-1)
    logq, teacher_entropy = _teacher_logq(teacher, head, rows, span, logp, spec)
    value, grad_p = _divergence(logp, logq, spec.beta, with_grad)
    sums = (value.sum(), nll, _entropy(logp).sum(), teacher_entropy.sum())
    if not with_grad:
        return sums, None
    assert grad_p is not None
    grad = z.sub_(lse[:, None]).exp_().mul_(1 - spec.alpha)  # (1 - alpha)(softmax - onehot) + alpha/T grad_p
    grad[torch.arange(len(t), device=t.device), t] -= 1 - spec.alpha
    grad[:, :spec.vocab].add_(grad_p, alpha=spec.alpha / spec.temperature)
    return sums, grad


def _teacher_head(teacher: LiveTeacher | TopKTeacher, vocab: int) -> tuple:
    if not isinstance(teacher, LiveTeacher):
        return None, None
    dtype = teacher.hidden.dtype
    bias = None if teacher.bias is None else teacher.bias[:vocab].detach().to(dtype)
    return teacher.weight[:vocab].detach().to(dtype), bias


def _chunked(hidden, weight, bias, targets, teacher, spec: _Spec, chunk_size: int, needs: tuple[bool, ...]):
    """(loss, the four stat sums, [grad_hidden, grad_weight, grad_bias] for `needs`)."""
    rows = (targets != IGNORE).nonzero().squeeze(1)
    if isinstance(teacher, TopKTeacher) and teacher.ids.shape[0] != rows.numel():
        raise ValueError(f"top-K teacher has {teacher.ids.shape[0]} rows for {rows.numel()} targets")
    w, b = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
    head = _teacher_head(teacher, spec.vocab)
    f32 = {"dtype": torch.float32, "device": weight.device}
    grads = [torch.zeros_like(hidden) if needs[0] else None, torch.zeros(weight.shape, **f32) if needs[1] else None,
             torch.zeros(weight.shape[0], **f32) if needs[2] and bias is not None else None]
    sums = torch.zeros(4, **f32)
    for start in range(0, rows.numel(), chunk_size):
        span = slice(start, start + chunk_size)
        at = rows[span]
        h = hidden.index_select(0, at)
        chunk_sums, grad = _chunk(h, w, b, targets.index_select(0, at), teacher, head, at, span, spec, any(needs))
        sums += torch.stack(chunk_sums)
        if grad is not None:
            _accumulate(grads, grad, h, w, at)
    loss = spec.alpha * sums[0] + (1 - spec.alpha) * sums[1]
    return loss, sums, grads


def _accumulate(grads: list, grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, at: torch.Tensor) -> None:
    grad_hidden, grad_weight, grad_bias = grads
    low = grad.to(h.dtype)
    if grad_hidden is not None:
        grad_hidden.index_copy_(0, at, low @ w)
    if grad_weight is not None:
        if h.dtype == torch.float32:
            grad_weight.addmm_(grad.t(), h)
        else:
            grad_weight += (low.t() @ h).float()
    if grad_bias is not None:
        grad_bias += grad.sum(0)


class _ChunkedDistill(torch.autograd.Function):
    """The forward computes the gradients too (they need the same logits); the backward only scales them.
    The teacher is no input of the graph: no gradient can reach it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher, spec, chunk_size):
        needs = tuple(ctx.needs_input_grad[:3])
        loss, sums, grads = _chunked(hidden, weight, bias, targets, teacher, spec, chunk_size, needs)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, weight.dtype)
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        grads = ctx.saved_tensors
        out = [None if grads[i] is None else (grads[i] * grad_loss).to(ctx.dtypes[i]) for i in range(3)]
        return *out, None, None, None, None


def distill_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 teacher: LiveTeacher | TopKTeacher, *, beta: float, temperature: float, alpha: float, vocab: int,
                 chunk_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss sum over targets != -100, {"distill", "nll", "student_entropy", "teacher_entropy"} sums, detached).

    hidden [N, Hs] the student's flattened final hidden states, weight/bias its whole head, targets [N].
    `chunk_size` positions at a time, never (N x vocab) logits at once; 0 = whole logits and autograd (the
    reference, `full_distill_loss`). No gradient reaches the teacher."""
    spec = _Spec(float(beta), float(temperature), float(alpha), int(vocab))
    if chunk_size <= 0:
        student = F.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype))
        if isinstance(teacher, LiveTeacher):
            with torch.no_grad():
                wt, bt = _teacher_head(teacher, vocab)
                teacher_logits: torch.Tensor | TopKTeacher = F.linear(teacher.hidden, wt, bt)
        else:
            teacher_logits = teacher
        return full_distill_loss(student, teacher_logits, targets, beta=beta, temperature=temperature,
                                 alpha=alpha, vocab=vocab)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias)):
        loss, sums = _ChunkedDistill.apply(hidden, weight, bias, targets, teacher, spec, chunk_size)
    else:  # not through the Function: under no_grad its needs_input_grad would still ask for the head's gradient
        loss, sums, _ = _chunked(hidden, weight, bias, targets, teacher, spec, chunk_size, (False, False, False))
    return loss, dict(zip(STATS, sums.unbind(), strict=True))

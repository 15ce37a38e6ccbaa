"""Distillation's loss: the chunked loss equals the whole-logits one in value and gradients (hidden, head weight,
bias) for beta 0, 0.5, 1, two temperatures and alpha 1 and 0.5; the whole-logits one is TRL's
`GKDTrainer.generalized_jsd_loss`; 0 with no gradient when teacher = student; no gradient reaches the teacher;
padding rows beyond the vocabulary count in neither distribution; top-K with K = vocab is the live teacher, and
with K < vocab the chunked loss is the bucketed (K + rest) divergence."""

import itertools

import torch

from shardlm.models.distill_loss import LiveTeacher, TopKTeacher, distill_loss, full_distill_loss

N, HS, HT, VOCAB = 30, 8, 12, 50
CASES = list(itertools.product((0.0, 0.5, 1.0), (1.0, 2.0), (1.0, 0.5)))


def _student(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, HS, generator=g).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(VOCAB + 6, HS, generator=g)).requires_grad_()  # 6 padding rows
    bias = (0.1 * torch.randn(VOCAB + 6, generator=g)).requires_grad_()
    targets = torch.randint(0, VOCAB, (N,), generator=g)
    targets[::4] = -100
    return hidden, weight, bias, targets


def _teacher(seed: int = 1) -> LiveTeacher:
    g = torch.Generator().manual_seed(seed)
    return LiveTeacher(torch.randn(N, HT, generator=g), 0.5 * torch.randn(VOCAB + 3, HT, generator=g),
                       0.1 * torch.randn(VOCAB + 3, generator=g))


def _run(student, teacher, chunk: int, beta: float, temperature: float, alpha: float):
    hidden, weight, bias, targets = student
    for x in (hidden, weight, bias):
        x.grad = None
    loss, stats = distill_loss(hidden, weight, bias, targets, teacher, beta=beta, temperature=temperature,
                               alpha=alpha, vocab=VOCAB, chunk_size=chunk)
    (loss / 7).backward()
    return [loss.detach(), *stats.values(), hidden.grad.float(), weight.grad, bias.grad]


def _close(a: list, b: list, tol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x.float(), y.float(), rtol=tol, atol=tol), (x, y)


def test_chunked_equals_full_in_value_and_gradients():
    student, teacher = _student(), _teacher()
    for beta, temperature, alpha in CASES:
        full = _run(student, teacher, 0, beta, temperature, alpha)
        assert full[1] > 0.05 and full[2] > 0.05  # a divergence and a next-token loss to compare
        for chunk in (7, 100):
            _close(_run(student, teacher, chunk, beta, temperature, alpha), full)
        with torch.no_grad():  # validation's path: the same sums, no gradient work
            loss, stats = distill_loss(*student, teacher, beta=beta, temperature=temperature, alpha=alpha,
                                       vocab=VOCAB, chunk_size=7)
        _close([loss, *stats.values()], full[:5])
    bf16 = _student(dtype=torch.bfloat16)  # bf16 hidden states: fp32 logits math, within bf16's rounding
    _close(_run(bf16, teacher, 7, 0.5, 2.0, 0.5), _run(bf16, teacher, 0, 0.5, 2.0, 0.5), 2e-2)


def test_full_loss_is_trl_generalized_jsd():
    from trl.experimental.gkd import GKDTrainer

    g = torch.Generator().manual_seed(2)
    student = torch.randn(2, 15, VOCAB + 6, generator=g)
    teacher = torch.randn(2, 15, VOCAB + 3, generator=g)
    labels = torch.randint(0, VOCAB, (2, 15), generator=g)
    labels[:, :4] = -100
    for beta, temperature in itertools.product((0.0, 0.5, 1.0, 0.1), (1.0, 2.0)):
        ours = student.clone().requires_grad_()
        loss, _ = full_distill_loss(ours, teacher, labels, beta=beta, temperature=temperature, alpha=1.0,
                                    vocab=VOCAB)
        loss.backward()
        theirs = student[..., :VOCAB].clone().requires_grad_()
        ref = GKDTrainer.generalized_jsd_loss(theirs, teacher[..., :VOCAB], labels, beta=beta,
                                              temperature=temperature, reduction="sum")
        ref.backward()
        assert ref > 0.1 and torch.allclose(loss, ref, rtol=1e-5, atol=1e-5), (beta, temperature, loss, ref)
        assert torch.allclose(ours.grad[..., :VOCAB], theirs.grad, atol=1e-6)
        assert not ours.grad[..., VOCAB:].any()  # padding rows: in no distribution


def test_teacher_equal_to_student_gives_zero_and_no_gradient_reaches_the_teacher():
    hidden, weight, bias, targets = _student()
    same = LiveTeacher(hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_(),
                       bias.detach().clone().requires_grad_())
    for (beta, temperature, _), chunk in itertools.product(CASES[::2], (0, 7)):
        loss, stats, gh, gw, gb = [_run((hidden, weight, bias, targets), same, chunk, beta, temperature, 1.0)[i]
                                   for i in (0, 3, 5, 6, 7)]
        assert abs(loss) < 1e-5 and stats > 1.0  # a real distribution, matched exactly
        for grad in (gh, gw, gb):
            assert grad.abs().max() < 1e-6
    assert same.hidden.grad is None and same.weight.grad is None and same.bias.grad is None
    # the teacher's padding rows (and the student's, with alpha 1) change nothing
    other = LiveTeacher(same.hidden, torch.cat([same.weight[:VOCAB], 50 * torch.ones(6, HS)]), same.bias)
    assert abs(_run((hidden, weight, bias, targets), other, 7, 0.5, 1.0, 1.0)[0]) < 1e-5


def _topk(teacher: LiveTeacher, targets: torch.Tensor, k: int, temperature: float) -> TopKTeacher:
    keep = targets != -100
    logits = torch.nn.functional.linear(teacher.hidden[keep], teacher.weight[:VOCAB], teacher.bias[:VOCAB])
    logps, ids = (logits / temperature).log_softmax(-1).topk(k, -1)
    return TopKTeacher(ids, logps)


def test_top_k_equals_live_teacher_at_full_vocabulary_and_the_bucketed_loss_below_it():
    student, teacher = _student(), _teacher()
    for beta, temperature, alpha in CASES[::3]:
        live = _run(student, teacher, 7, beta, temperature, alpha)
        _close(_run(student, _topk(teacher, student[3], VOCAB, temperature), 7, beta, temperature, alpha), live)
        stored = _topk(teacher, student[3], 5, temperature)
        bucketed = _run(student, stored, 0, beta, temperature, alpha)  # autograd over the K + 1 buckets
        _close(_run(student, stored, 7, beta, temperature, alpha), bucketed)
        assert bucketed[1] < live[1]  # merging categories lowers an f-divergence

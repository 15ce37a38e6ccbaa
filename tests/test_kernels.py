"""shardlm.kernels: the CPU tanh-GELU is the same function as PyTorch's, and swapping it in changes no logits."""

import pytest
import torch
import torch.nn.functional as F

from helpers import byte_gpt2_config
from shardlm import kernels


@pytest.mark.parametrize("small_backward", [kernels.SMALL_BACKWARD, 0])  # the composite and the fused backward
def test_tanh_gelu_equals_pytorchs(monkeypatch, small_backward):
    monkeypatch.setattr(kernels, "SMALL_BACKWARD", small_backward)
    x = torch.linspace(-12, 12, 100_001).requires_grad_()
    grad = torch.randn_like(x)
    ours = kernels.tanh_gelu(x)
    (g_ours,) = torch.autograd.grad(ours, x, grad)
    x64 = x.detach().double().requires_grad_()
    ref = F.gelu(x64, approximate="tanh")
    (g_ref,) = torch.autograd.grad(ref, x64, grad.double())
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(g_ours.double(), g_ref, rtol=0, atol=1e-5)
    x64 = (torch.randn(40, dtype=torch.float64) * 3).requires_grad_()
    assert torch.autograd.gradcheck(kernels._TanhGELU.apply, x64)


def test_swapped_model_gives_the_same_logits_and_grads():
    from transformers import GPT2LMHeadModel

    cfg = byte_gpt2_config(n_layer=2, n_embd=32, activation_function="gelu_new")  # GPT-2's own: swapped too
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()  # no dropout; gradients still flow
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    before = model(ids, labels=ids)
    assert kernels.use_cpu_kernels(model) == cfg.n_layer
    assert all(type(b.mlp.act) is kernels.TanhGELU for b in model.transformer.h)
    after = model(ids, labels=ids)
    torch.testing.assert_close(after.logits, before.logits, rtol=0, atol=1e-5)
    g_before = torch.autograd.grad(before.loss, model.transformer.h[0].mlp.c_fc.weight)[0]
    g_after = torch.autograd.grad(after.loss, model.transformer.h[0].mlp.c_fc.weight)[0]
    torch.testing.assert_close(g_after, g_before, rtol=1e-4, atol=1e-6)

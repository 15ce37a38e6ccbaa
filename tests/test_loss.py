"""The chunked linear + cross-entropy: equal to the plain loss (values and gradients, fp32 and bf16), less memory
in a training step, no gradient work without grad mode, torch.compile; and `shardlm eval` (auto loss chunk,
progress on stderr, stdout one JSON line)."""

import json
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import GPT2_VOCAB, byte_gpt2_config, fp32_tol, on_cuda, tiny
from shardlm.config import load_config
from shardlm.models.loss import linear_cross_entropy
from shardlm.observe.hardware import measure_step_peak
from shardlm.training.trainer import Trainer

N, D, V = 40, 16, 300


def _inputs(bias: bool = False):
    torch.manual_seed(0)
    hidden = torch.randn(N, D)
    weight = torch.nn.Parameter(0.1 * torch.randn(V, D))
    b = torch.nn.Parameter(0.1 * torch.randn(V)) if bias else None
    targets = torch.randint(0, V, (N,))
    targets[::7] = -100
    return hidden, weight, b, targets


def _matmul_flops(fn) -> int:
    """FlopCounterMode has no formula for the in-place addmm_ the chunked loss accumulates with."""
    def addmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.cuda
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_plain_loss(chunk, dtype):
    device = "cuda" if on_cuda() else "cpu"
    torch.manual_seed(0)
    hidden = torch.randn(96, 32, dtype=dtype).to(device).requires_grad_()
    weight = (0.1 * torch.randn(300, 32)).to(device, dtype).requires_grad_()
    targets = torch.randint(0, 300, (96,)).to(device)
    targets[::11] = -100
    grads = []
    for c in (0, chunk):
        hidden.grad = weight.grad = None
        loss, correct = linear_cross_entropy(hidden, weight, targets, c)
        (loss / 96).backward()
        grads.append((loss.detach(), correct, hidden.grad.float(), weight.grad.float()))
    tol = fp32_tol(1e-5) if dtype == torch.float32 else 2e-2
    for plain, chunked in zip(grads[0], grads[1], strict=True):
        assert torch.allclose(plain.float(), chunked.float(), rtol=tol, atol=tol)


def test_chunked_loss_saves_memory(corpus, cache_dir, tmp_path):
    peaks = {}
    for chunk in (0, 256):
        cfg = load_config(None, tiny(corpus, cache_dir, tmp_path / str(chunk),
                                     **{**GPT2_VOCAB, "train.batch_size": 8, "train.loss_chunk_size": chunk}))
        trainer = Trainer.from_config(cfg)
        trainer.train_step()
        peaks[chunk] = measure_step_peak(trainer)
    assert peaks[256] < 0.6 * peaks[0], peaks  # 0.42 at batch 8 (886 MB plain, 371 MB chunked)


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_no_grad_does_only_the_forward_matmul(no_grad):
    hidden, weight, bias, targets = _inputs(bias=True)
    one_matmul = 2 * N * D * V
    with no_grad():  # the head is a Parameter (requires_grad) as in evaluation
        assert _matmul_flops(lambda: linear_cross_entropy(hidden, weight, targets, 16, bias)) == one_matmul
        got = linear_cross_entropy(hidden, weight, targets, 16, bias)
        want = linear_cross_entropy(hidden, weight, targets, 0, bias)
    assert not got[0].requires_grad
    assert torch.allclose(got[0], want[0], rtol=1e-5) and got[1] == want[1]
    # with gradients: the forward matmul + d hidden + d weight, or + d weight alone for a detached input
    hidden.requires_grad_()
    assert _matmul_flops(lambda: linear_cross_entropy(hidden, weight, targets, 16, bias)) == 3 * one_matmul
    assert _matmul_flops(lambda: linear_cross_entropy(hidden.detach(), weight, targets, 16, bias)) == 2 * one_matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 16, 1000])
def test_no_grad_chunks_equal_plain_loss(dtype, chunk):
    hidden, weight, bias, targets = _inputs(bias=True)
    hidden, weight, bias = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
    with torch.no_grad():
        (loss, correct), (want, want_correct) = (linear_cross_entropy(hidden, weight, targets, c, bias)
                                                 for c in (chunk, 0))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # bf16 logits tie often; a chunk's matmul may take another kernel (AVX2, AVX-512-BF16, AMX) and break a tie
    # the other way, so bf16 accuracy may differ by a near-tie or two; fp32 must match exactly
    ties = 0 if dtype == torch.float32 else 2
    assert loss.item() == pytest.approx(want.item(), rel=tol) and abs(int(correct) - int(want_correct)) <= ties


def test_bias_gradient_skips_ignored_targets():
    hidden, weight, bias, targets = _inputs(bias=True)
    hidden.requires_grad_()
    grads = []
    for chunk in (0, 16):
        hidden.grad = weight.grad = bias.grad = None
        linear_cross_entropy(hidden, weight, targets, chunk, bias)[0].backward()
        grads.append((hidden.grad, weight.grad, bias.grad))
    for plain, chunked in zip(*grads, strict=True):
        assert torch.allclose(plain, chunked, rtol=1e-5, atol=1e-6)


def _compiler_or_skip():
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # no inductor or no C++ compiler: nothing to test here
        pytest.skip(f"torch.compile's CPU backend is unavailable: {exc}")


def test_chunked_loss_compiles_fullgraph_and_matches_eager():
    _compiler_or_skip()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()  # reset() leaves the counts of earlier tests

    def step(hidden, weight, targets):
        loss, correct = linear_cross_entropy(hidden, weight, targets, chunk_size=24)  # 24 + 16 rows: unrolled
        return loss / N, correct

    compiled = torch.compile(step, fullgraph=True)  # fails on any graph break (a host sync, a data branch)
    hidden, weight, _, targets = _inputs()
    hidden.requires_grad_()
    for seed in range(2):
        torch.manual_seed(seed)
        targets = torch.where(torch.rand(N) < 0.2, -100, torch.randint(0, V, (N,)))
        results = []
        for fn in (compiled, step):
            hidden.grad = weight.grad = None
            loss, correct = fn(hidden, weight, targets)
            loss.backward()
            results.append((loss.detach(), correct, hidden.grad, weight.grad))
        for got, want in zip(*results, strict=True):
            assert torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-7)
    assert counters["stats"]["unique_graphs"] == 1  # new targets, same shapes: no recompile


@pytest.fixture
def hf_model(tmp_path):
    from transformers import GPT2LMHeadModel

    from shardlm.tokenizer import byte_tokenizer

    folder = tmp_path / "hf"
    torch.manual_seed(0)
    GPT2LMHeadModel(byte_gpt2_config(n_positions=32, n_embd=16, n_head=2)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("stride", [None, 8])
def test_eval_reports_progress_on_stderr_and_one_json_line(hf_model, tmp_path, capsys, stride):
    from shardlm.inference.evaluate import evaluate_path

    val = tmp_path / "val.txt"
    val.write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 3)
    common = [f"data.val={val}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32", "train.batch_size=4"]
    results = {}
    for chunk in (0, 16):  # the chunked no-grad path scores exactly what the plain loss does
        results[chunk] = evaluate_path(str(hf_model), [*common, f"train.loss_chunk_size={chunk}"], stride=stride)
        out, err = capsys.readouterr()
        assert out.splitlines() == [json.dumps(results[chunk])]
        assert re.search(r"^eval [\d,]+/[\d,]+ tokens \(.*%\) +[\d,]+ tok/s +ETA \d\d:\d\d$", err, re.M), err
    assert results[16] == pytest.approx(results[0], rel=1e-5)
    if stride:  # every target of the stream is scored once
        assert results[0]["tokens"] == len(val.read_bytes())  # bytes + EOS, minus the first token


@pytest.mark.parametrize("stride", [0, 33])
def test_eval_refuses_a_stride_that_skips_tokens(hf_model, stride):
    from shardlm import ShardlmError
    from shardlm.inference.evaluate import evaluate_path

    with pytest.raises(ShardlmError, match=rf"--stride {stride}: give 1\.\.32"):
        evaluate_path(str(hf_model), ["data.val=unused.txt"], stride=stride)


def test_padded_vocabulary_trains_the_same_loss_and_never_generates_a_padding_id(corpus, cache_dir, tmp_path):
    """model.vocab_multiple=64: 257 byte ids -> 320 rows; shardlm's loss is the model's own labels loss, and
    generation (hot enough to reach every id) never emits one of the 63 padding ids."""
    from helpers import tiny
    from shardlm.config import load_config
    from shardlm.inference.generate import generate_batch
    from shardlm.training.build import build

    run = build(load_config(None, tiny(corpus, cache_dir, tmp_path, **{"model.vocab_multiple": 64})))
    hf = run.model.hf
    assert hf.config.vocab_size == 320 and hf.generation_config.suppress_tokens == list(range(257, 320))
    tokens = torch.randint(0, 257, (2, 33))
    with torch.no_grad():
        loss_sum, _ = run.model(tokens[:, :-1], tokens[:, 1:])
        assert loss_sum / 64 == pytest.approx(hf(input_ids=tokens, labels=tokens).loss.item(), rel=1e-5)
    out = generate_batch(hf.eval(), [[1, 2, 3]], max_new_tokens=60, eos=10**6, temperature=50.0)
    assert len(out[0][0]) == 60 and max(out[0][0]) < 257

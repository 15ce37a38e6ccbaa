"""QLoRA (lora.quantize=nf4): adapters on a 4-bit base, run on bitsandbytes' CPU backend (a run is CUDA-only:
that one check is lifted here), the real thing on CUDA, the refusals of a QLoRA run off one GPU, and what
`shardlm estimate` counts for the 4-bit weights. The LoRA bases and runs are conftest's."""

import pytest
import torch
from faults import SigtermAt

from helpers import LORA_STEPS, by_step, folder_digest, lora_args, on_cuda, records, save_hf_folder, shardlm_cli
from shardlm import ShardlmError

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


@pytest.fixture
def bnb_portable_cpu_path(monkeypatch):
    """bitsandbytes' CPU stand-in for the CUDA kernels, the same on every x86 CPU. On AVX-512-BF16 machines
    Linear4bit repacks its weight for a bf16 inference kernel the first time it runs in eval mode without grad
    (validation, the end-of-run sample): that kernel needs out_features % 32 == 0 and computes in bf16, so the
    tiny bases here would fail there (and pass on AVX2). shardlm runs QLoRA on CUDA only, where the kernel is
    not taken; the tests take the plain path everywhere."""
    bnb = pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: False, raising=False)  # absent before 0.47
    return bnb


def test_qlora_trains_adapters_on_a_4bit_base_and_merges_for_inference(lora_bases, lora_runs, corpus, cache_dir,
                                                                       tmp_path, monkeypatch, capsys,
                                                                       bnb_portable_cpu_path):
    """QLoRA's path, run on bitsandbytes' CPU backend (a run is CUDA-only: that one check is lifted here): the
    base's linears hold 4-bit weights, only the adapters train, the first loss is the full-precision LoRA run's
    up to the quantization error (and not equal to it), the weights gathered for the end-of-training sample
    (dequantized, merged, GPT-2's Conv1D layout restored) give the QLoRA model's own loss, a stopped run
    resumes bit for bit, and the export is a plain model."""
    bnb = bnb_portable_cpu_path
    from shardlm.config import load_config
    from shardlm.distributed.full_state import gather_hf_model
    from shardlm.models import lora
    from shardlm.training.trainer import Trainer

    monkeypatch.setattr(lora, "check", lambda *args, **kwargs: None)
    folders, _ = lora_bases
    args = lora_args(corpus, cache_dir, tmp_path, folders["gpt2"], **{"lora.quantize": "nf4", "train.max_steps": 3})
    trainer = Trainer.from_config(load_config(None, args))
    four_bit = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 8 and all(m.weight.dtype == torch.uint8 for m in four_bit)  # 2 blocks x 4 linears
    assert all(lora.is_adapter_key(n) for n, p in trainer.model.named_parameters() if p.requires_grad)
    first = [trainer.train_step()["loss_sum"].item() / (8 * 32) for _ in range(3)][0]
    full_precision = records(lora_runs["gpt2"])[0]["loss"]
    assert first != full_precision and first == pytest.approx(full_precision, rel=0.02)

    trainer.model.eval()
    tokens = trainer.run.train.get(torch.arange(4).numpy())
    with torch.no_grad():
        own, _ = trainer.model(tokens[:, :-1], tokens[:, 1:])
        hf = gather_hf_model(trainer.model, trainer.run.hf_config, trainer.dist)
        logits = hf(tokens[:, :-1]).logits
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    assert plain.item() == pytest.approx(own.item(), rel=1e-4)

    # a QLoRA checkpoint resumes bit for bit and exports merged into the full-precision base
    from shardlm.inference.export import export
    from shardlm.runner import train

    qlora = {"lora.quantize": "nf4", "train.max_steps": 4, "checkpoint.every": 0}
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(load_config(None, lora_args(corpus, cache_dir, whole, folders["gpt2"], **qlora)))
    train(load_config(None, lora_args(corpus, cache_dir, split, folders["gpt2"], **qlora)), callbacks=[SigtermAt(2)])
    assert max(by_step(split)) == 2
    capsys.readouterr()
    train(load_config(None, lora_args(corpus, cache_dir, split, folders["gpt2"], **qlora)))
    assert "resumed from" in capsys.readouterr().out and by_step(split) == by_step(whole)
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(str(export(whole, tmp_path / "hf")))).__name__ == "GPT2LMHeadModel"

    # shardlm eval scores that export (the adapters on the full-precision base), not the 4-bit base, and says so
    from shardlm.inference.evaluate import evaluate_path

    val = [f"data.val={corpus}", f"data.cache_dir={cache_dir}", "data.seq_len=32", "train.batch_size=8",
           "train.eval_batches=2"]
    got = evaluate_path(str(whole), val)
    assert "eval scores its adapters merged into the full-precision base" in got.pop("scored")
    assert got == pytest.approx(evaluate_path(str(tmp_path / "hf"), val), rel=1e-5)


@pytest.mark.cuda
def test_qlora_on_cuda_trains_and_exports(lora_bases, corpus, cache_dir, tmp_path):
    """The real thing, where there is a GPU (`make gpu-check` runs the cuda-marked tests)."""
    if not on_cuda():
        pytest.skip("QLoRA runs on CUDA only")
    pytest.importorskip("bitsandbytes")
    folders, digests = lora_bases
    run = tmp_path / "run"
    shardlm_cli(["train", *lora_args(corpus, cache_dir, run, folders["llama"], **{
        "lora.quantize": "nf4", "parallel.precision": "bf16", "checkpoint.export_final": True})])
    losses = [r["loss"] for r in records(run)]
    assert len(losses) == LORA_STEPS and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    greedy = ["--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "8"]
    from_ckpt, from_export = (shardlm_cli(["generate", str(path), *greedy]).stdout for path in (run, run / "hf"))
    assert from_ckpt == from_export
    assert folder_digest(folders["llama"]) == digests["llama"]  # the base folder is never written


def test_qlora_refusals_on_cuda_need_no_gpu(lora_bases, monkeypatch):
    import importlib.util

    from shardlm.config import load_config
    from shardlm.models import lora

    pytest.importorskip("bitsandbytes")
    folders, _ = lora_bases
    cfg = load_config(None, [f"model.name={folders['llama']}", "lora.r=4", "lora.quantize=nf4"])
    cuda = torch.device("cuda")
    with pytest.raises(ShardlmError, match="runs in one process on one GPU.*lora.quantize=null"):
        lora.check(cfg.lora, cuda, sharded=True)
    lora.check(cfg.lora, cuda, sharded=False)  # one process on a GPU: accepted
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        real(name, *a))
    with pytest.raises(ShardlmError, match=r"needs the bitsandbytes package.*shardlm\[qlora\]"):
        lora.check(cfg.lora, cuda)


def test_qlora_estimate_counts_what_bitsandbytes_holds(tmp_path, monkeypatch):
    """The 4-bit weights and their constants, as `shardlm estimate` counts them, against the bytes of a real
    bitsandbytes NF4 model (CPU backend; a Llama base big enough that per-layer constants do not dominate)."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardlm.config import load_config
    from shardlm.models import lora
    from shardlm.models.hf_config import model_config
    from shardlm.preflight.estimate import estimate
    from shardlm.tokenizer import model_tokenizer

    base = save_hf_folder(LlamaForCausalLM(LlamaConfig(
        hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4, vocab_size=257,
        bos_token_id=256, eos_token_id=256)), tmp_path / "base")
    cfg = load_config(None, [f"model.name={base}", "lora.r=8", "lora.quantize=nf4", "data.seq_len=32"])
    hf_cfg = model_config(cfg, model_tokenizer(cfg.model))
    hf = lora.quantized_base(cfg, hf_cfg, torch.device("cpu"))
    held = 0
    for m in hf.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            held += m.weight.numel() * m.weight.element_size() + qs.absmax.nbytes + qs.state2.absmax.nbytes
    predicted = estimate(cfg, model_tokenizer(cfg.model)).components["base linears (4-bit NF4, double quantization)"]
    assert predicted == pytest.approx(held, rel=0.01)

"""QLoRA (lora.quantize=nf4): adapters on a 4-bit base. torchao's NF4 backend (auto's choice off one CUDA process):
sharded by FSDP2, 2 ranks equal to 1 process, resumed exactly, its adapter export loaded by PEFT, its refusals.
bitsandbytes' (one CUDA process): run on its CPU backend (a run is CUDA-only: that one check is lifted here), the
real thing on CUDA, its refusals off one GPU. And what `shardlm estimate` counts for the 4-bit weights of each.
The LoRA bases and runs are conftest's."""

import pytest
import torch
from faults import SigtermAt, fault

from helpers import (
    LORA_STEPS,
    by_step,
    byte_gpt2_config,
    folder_digest,
    lora_args,
    on_cuda,
    records,
    save_hf_folder,
    shardlm_cli,
    train_in_process,
)
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
    from shardlm.models import lora
    from shardlm.training.trainer import Trainer

    monkeypatch.setattr(lora, "check", lambda *args, **kwargs: None)
    folders, _ = lora_bases
    args = lora_args(corpus, cache_dir, tmp_path, folders["gpt2"], **{"lora.quantize": "nf4", "train.max_steps": 3,
                                                                      "lora.quant_backend": "bitsandbytes"})
    trainer = Trainer.from_config(load_config(None, args))
    four_bit = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 8 and all(m.weight.dtype == torch.uint8 for m in four_bit)  # 2 blocks x 4 linears
    assert all(lora.is_adapter_key(n) for n, p in trainer.model.named_parameters() if p.requires_grad)
    first = [trainer.train_step()["loss_sum"].item() / (8 * 32) for _ in range(3)][0]
    full_precision = records(lora_runs["gpt2"])[0]["loss"]
    assert first != full_precision and first == pytest.approx(full_precision, rel=0.02)

    _gathered_model_scores_the_loss(trainer, rel=1e-4)

    # a QLoRA checkpoint resumes bit for bit and exports merged into the full-precision base
    from shardlm.inference.export import export
    from shardlm.runner import train

    qlora = {"lora.quantize": "nf4", "train.max_steps": 4, "checkpoint.every": 0, "lora.quant_backend": "bitsandbytes"}
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
    cfg = load_config(None, [f"model.name={folders['llama']}", "lora.r=4", "lora.quantize=nf4",
                             "lora.quant_backend=bitsandbytes"])
    cuda = torch.device("cuda")
    with pytest.raises(ShardlmError, match="runs in one process on one GPU.*lora.quant_backend=torchao"):
        lora.check(cfg.lora, cuda, sharded=True)
    lora.check(cfg.lora, cuda, sharded=False)  # one process on a GPU: accepted
    with pytest.raises(ShardlmError, match="needs a CUDA GPU.*lora.quant_backend=torchao"):
        lora.check(cfg.lora, torch.device("cpu"))
    cfg.lora.quant_backend = "auto"  # bitsandbytes in one CUDA process, torchao sharded or on a CPU
    assert [lora.backend(cfg.lora, torch.device(d), sharded) for d, sharded in
            (("cuda", False), ("cuda", True), ("cpu", False))] == ["bitsandbytes", "torchao", "torchao"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        real(name, *a))
    assert lora.backend(cfg.lora, cuda) == "torchao"  # auto without bitsandbytes
    cfg.lora.quant_backend = "bitsandbytes"
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
    cfg = load_config(None, [f"model.name={base}", "lora.r=8", "lora.quantize=nf4", "data.seq_len=32",
                             "lora.quant_backend=bitsandbytes"])
    hf_cfg = model_config(cfg, model_tokenizer(cfg.model))
    hf = lora.quantized_base(cfg, hf_cfg, torch.device("cpu"))
    held = 0
    for m in hf.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            held += m.weight.numel() * m.weight.element_size() + qs.absmax.nbytes + qs.state2.absmax.nbytes
    predicted = estimate(cfg, model_tokenizer(cfg.model)).components["base linears (4-bit NF4, double quantization)"]
    assert predicted == pytest.approx(held, rel=0.01)


# ---- torchao's NF4 backend (lora.quant_backend=torchao; auto's choice here, on a CPU) ------------------------------
def _nf4_params(model) -> dict:
    from shardlm.models.nf4 import is_nf4

    return {n: p for n, p in model.named_parameters() if is_nf4(p)}


def test_qlora_torchao_holds_a_4bit_base_counted_by_estimate_and_merges_for_inference(lora_bases, lora_runs, corpus,
                                                                                    cache_dir, tmp_path):
    """GPT-2 (Conv1D layers) on one process: every linear of the blocks becomes a frozen NF4 weight, only the
    adapters train, the first loss is the full-precision LoRA run's up to the quantization error (and not equal),
    `shardlm estimate` counts the bytes the 4-bit base holds, the header names the backend, and the weights
    gathered for inference (dequantized, merged, Conv1D's layout restored) give the model's own loss."""
    from shardlm.config import load_config
    from shardlm.models import lora, nf4
    from shardlm.preflight.estimate import estimate
    from shardlm.tokenizer import model_tokenizer
    from shardlm.training.reporting import run_header
    from shardlm.training.trainer import Trainer

    folders, _ = lora_bases
    cfg = load_config(None, lora_args(corpus, cache_dir, tmp_path, folders["gpt2"], **{"lora.quantize": "nf4"}))
    trainer = Trainer.from_config(cfg)
    four_bit = _nf4_params(trainer.model)
    assert len(four_bit) == 8 and not any(p.requires_grad for p in four_bit.values())  # 2 blocks x 4 linears
    assert all(lora.is_adapter_key(n) for n, p in trainer.model.named_parameters() if p.requires_grad)
    held = nf4.base_bytes(trainer.model)
    weights = sum(p.numel() for p in four_bit.values())
    assert 0.5 * weights < held < 0.6 * weights  # 4 bits a weight, its scales, its groups' factors: not fp32
    counted = {w: estimate(cfg, model_tokenizer(cfg.model), w).components["base linears (4-bit NF4, torchao, sharded)"]
               for w in (1, 2)}
    assert counted[1] == pytest.approx(held, rel=0.01) and counted[2] == counted[1] / 2  # per rank
    assert "QLoRA base: 8 linears in 4-bit NF4 (torchao)" in run_header(trainer.run)
    first = trainer.train_step()["loss_sum"].item() / (8 * 32)
    full_precision = records(lora_runs["gpt2"])[0]["loss"]
    assert first != full_precision and first == pytest.approx(full_precision, rel=0.02)

    hf = _gathered_model_scores_the_loss(trainer, rel=1e-5)
    assert type(hf.transformer.h[0].attn.c_attn).__name__ == "Conv1D"


def _dequantized_base(base, out):
    """The base folder with the blocks' linears as the 4-bit weights a torchao QLoRA run computes with."""
    from transformers import AutoModelForCausalLM

    from shardlm.models import nf4

    model = AutoModelForCausalLM.from_pretrained(str(base))
    with torch.no_grad():
        for linear in nf4.block_linears(model).values():
            linear.weight.copy_(nf4.dequantized(nf4.to_nf4(linear.weight)))
    return save_hf_folder(model, out)


def test_qlora_torchao_two_ranks_equal_one_process_resume_exactly_and_the_adapter_loads_in_peft(
        lora_bases, corpus, cache_dir, tmp_path):
    """Llama: 1 process; the same run stopped and resumed (bit for bit); 2 FSDP2 ranks holding half the 4-bit
    base each, killed after a save and resumed (the losses to 1e-4); the adapter export loaded by PEFT onto the
    dequantized base generates the trained model's tokens, and onto the original base it loads as a PEFT adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardlm.config import load_config
    from shardlm.distributed.full_state import gather_hf_model
    from shardlm.inference.export import export
    from shardlm.runner import train
    from shardlm.training.build import build
    from shardlm.training.trainer import Trainer

    folders, digests = lora_bases
    qlora = {"lora.quantize": "nf4", "train.lr": 3e-3}
    whole = tmp_path / "whole"
    train_in_process(lora_args(corpus, cache_dir, whole, folders["llama"], **qlora))
    reference = by_step(whole)
    assert sorted(reference) == list(range(1, LORA_STEPS + 1)) and reference[LORA_STEPS] < reference[1]

    split = tmp_path / "split"
    train(load_config(None, lora_args(corpus, cache_dir, split, folders["llama"], **qlora)), callbacks=[SigtermAt(4)])
    assert max(by_step(split)) == 4
    train_in_process(lora_args(corpus, cache_dir, split, folders["llama"], **qlora))
    assert by_step(split) == reference

    two = tmp_path / "two"
    args = lora_args(corpus, cache_dir, two, folders["llama"], **qlora, **{"train.batch_size": 4})
    proc = shardlm_cli(["train", *args, fault("KillAfterSave(4)")], nproc=2, check=False)
    assert proc.returncode != 0 and max(by_step(two)) == 4
    assert "QLoRA base: 14 linears in 4-bit NF4 (torchao)" in proc.stdout and "on this rank" in proc.stdout
    resumed = shardlm_cli(["train", *args], nproc=2)
    assert "resumed from" in resumed.stdout
    got = by_step(two)
    assert sorted(got) == sorted(reference)
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), step

    # the trained model (its 4-bit base dequantized) and PEFT's model from the adapter export: the same tokens
    trainer = Trainer(build(load_config(None, lora_args(corpus, cache_dir, whole, folders["llama"], **qlora))),
                      checkpoint=True)
    assert trainer.checkpointer is not None and trainer.checkpointer.maybe_resume()
    trained = gather_hf_model(trainer.model, trainer.run.hf_config, trainer.dist)
    adapter = export(whole, tmp_path / "adapter", adapter=True)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(_dequantized_base(folders["llama"], tmp_path / "dq"))), str(adapter))
    prompt = torch.tensor([[72, 101, 108, 108, 111]])
    greedy = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 256}
    with torch.no_grad():
        assert torch.equal(trained.generate(prompt, **greedy), peft_model.eval().generate(prompt, **greedy))
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(folders["llama"])), str(adapter))
    assert on_base.peft_config["default"].r == 4
    assert {n: folder_digest(f) for n, f in folders.items()} == digests  # the base folders were never written


@pytest.mark.parametrize("case", ["block", "split"])
def test_qlora_torchao_refuses_weights_it_cannot_hold(case, corpus, cache_dir, tmp_path):
    """A weight that is not whole blocks of 64, and one that does not split over the ranks in whole groups of
    scales: one line naming the fix (the CLI's `error:` line, exit 2), nothing written."""
    from shardlm.config import load_config
    from shardlm.models import nf4
    from shardlm.models.hf_config import model_config
    from shardlm.models.instantiate import empty_model
    from shardlm.tokenizer import model_tokenizer

    widths = {"block": 12, "split": 8}  # c_attn 36x12: 432 weights; 24x8: 3 groups
    base = save_hf_folder(__import__("transformers").GPT2LMHeadModel(
        byte_gpt2_config(n_layer=1, n_embd=widths[case], n_head=2)), tmp_path / "base")
    args = lora_args(corpus, cache_dir, tmp_path / "run", base, **{"lora.quantize": "nf4"})
    if case == "block":
        with pytest.raises(ShardlmError, match=r"c_attn has 36x12 = 432 weights, not a multiple of 64.*"
                                               "lora.quantize=null") as err:
            train_in_process(args)
        assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
        from shardlm.preflight.dryrun import dry_run  # `train --dry-run` refuses it with the same line

        with pytest.raises(ShardlmError) as dry:
            dry_run(load_config(None, args), 1)
        assert str(dry.value) == str(err.value)
    else:  # what build_model checks on the meta model before FSDP2 shards it over the plan's mesh (2 ranks here)
        cfg = load_config(None, args)
        hf = empty_model(model_config(cfg, model_tokenizer(cfg.model)), "meta")
        with pytest.raises(ShardlmError, match="c_attn .24x8. does not split into 2 equal parts.*split over no "
                                               "number of ranks: train it in one process") as err:
            nf4.quantize(hf, mesh=(2,))
        assert "\n" not in str(err.value)
        assert type(hf.transformer.h[0].attn.c_attn).__name__ == "Conv1D"  # refused before any change


def test_qlora_backend_key_and_a_torchao_that_does_not_import_are_refused(lora_bases, monkeypatch):
    from shardlm.config import load_config
    from shardlm.models import lora, nf4

    folders, _ = lora_bases
    base = [f"model.name={folders['llama']}", "lora.r=4", "lora.quantize=nf4"]
    with pytest.raises(ShardlmError, match="lora.quant_backend='bnb' is not one of auto, torchao, bitsandbytes"):
        load_config(None, [*base, "lora.quant_backend=bnb"])
    cfg = load_config(None, base)
    lora.check(cfg.lora, torch.device("cpu"), sharded=True)  # auto: torchao, here importable
    with pytest.raises(ShardlmError, match="does not run on XLA devices.*lora.quantize=null on a TPU"):
        lora.check(cfg.lora, torch.device("xla"))
    monkeypatch.setattr(nf4, "import_problem", lambda: "ModuleNotFoundError: No module named 'torchao'")
    with pytest.raises(ShardlmError, match=r"needs torchao, which does not import here \(ModuleNotFoundError.*"
                                           "pip install 'torchao>=0.17'.*lora.quant_backend=bitsandbytes"):
        lora.check(cfg.lora, torch.device("cpu"), sharded=True)


def _gathered_model_scores_the_loss(trainer, rel: float):
    """The QLoRA model gathered for inference gives the trained model's own loss (to `rel`); returns it."""
    from shardlm.distributed.full_state import gather_hf_model
    trainer.model.eval()
    tokens = trainer.run.train.get(torch.arange(4).numpy())
    with torch.no_grad():
        own, _ = trainer.model(tokens[:, :-1], tokens[:, 1:])
        hf = gather_hf_model(trainer.model, trainer.run.hf_config, trainer.dist)
        logits = hf(tokens[:, :-1]).logits
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    assert plain.item() == pytest.approx(own.item(), rel=rel)
    return hf

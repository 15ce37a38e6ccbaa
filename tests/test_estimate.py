"""`shardlm estimate` against the measured peak memory of a real training step on CPU."""

import pytest
import torch

from helpers import GPT2_VOCAB, tiny
from shardlm.config import load_config
from shardlm.observe.hardware import measure_step_peak
from shardlm.preflight.estimate import estimate
from shardlm.training.trainer import Trainer


@pytest.mark.parametrize("extra", [
    {},
    {"train.loss_chunk_size": 0},
    {"parallel.activation_checkpointing": True, "train.batch_size": 8},
    {"train.batch_size": 16, "train.loss_chunk_size": 256},
    {"model.arch": "llama", "model.n_kv_head": 2, "model.intermediate_size": 688},
    {"model.arch": "gemma2"},  # eager attention keeps (T x T) probabilities; soft-capped logits
    {"model.arch": "gemma3_text"},  # one rotary table per layer type
], ids=["chunked", "plain-loss", "activation-ckpt", "big-batch", "llama", "gemma2", "gemma3"])
def test_estimate_within_15_percent_of_measured(corpus, cache_dir, tmp_path, extra):
    cfg = load_config(None, tiny(corpus, cache_dir, tmp_path, **{**GPT2_VOCAB, **extra}))
    trainer = Trainer.from_config(cfg)
    trainer.train_step()  # the optimizer state exists from here on
    measured = measure_step_peak(trainer)
    predicted = estimate(cfg, trainer.run.tokenizer).peak_bytes
    assert predicted == pytest.approx(measured, rel=0.15)


def test_lora_estimate_within_15_percent_of_measured(corpus, cache_dir, tmp_path):
    """LoRA freezes the head: the chunked loss builds no head gradient (counting one was +21% here)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.tokenizer import load_tokenizer

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128)).save_pretrained(tmp_path / "base")
    load_tokenizer("gpt2").save_pretrained(tmp_path / "base")
    cfg = load_config(None, tiny(corpus, cache_dir, tmp_path / "run", **{
        **GPT2_VOCAB, "model.name": tmp_path / "base", "model.tokenizer": "null", "lora.r": 16, "lora.alpha": 32}))
    trainer = Trainer.from_config(cfg)
    trainer.train_step()
    assert estimate(cfg, trainer.run.tokenizer).peak_bytes == pytest.approx(measure_step_peak(trainer), rel=0.15)


def test_a_live_reference_without_lora_counts_one_more_model():
    from shardlm.tokenizer import load_tokenizer

    base = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "data.seq_len=32", "train.objective=dpo"]
    tok = load_tokenizer("bytes")
    pre, live = (estimate(load_config(None, [*base, f"preference.reference={mode}"]), tok)
                 for mode in ("precomputed", "live"))
    extra = live.components.pop("live reference (frozen copy of the initial model)")
    assert extra == 4 * pre.parameters and live.components == pre.components

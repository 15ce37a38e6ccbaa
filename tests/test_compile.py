"""torch.compile per block (with activation checkpointing) compiles once, not every step or every layer;
the whole model (loss included) compiles into one graph with the eager model's losses."""

import pytest
import torch

from helpers import fp32_tol, tiny
from shardlm.config import load_config
from shardlm.training.trainer import Trainer


@pytest.mark.cuda
def test_compiled_blocks_do_not_recompile(corpus, cache_dir, tmp_path):
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()  # reset() leaves the counts of earlier tests in this process
    cfg = load_config(None, tiny(corpus, cache_dir, tmp_path, **{"parallel.compile": "blocks", "model.n_layer": 3,
                                                                 "parallel.activation_checkpointing": True}))
    trainer = Trainer.from_config(cfg)
    eager = Trainer.from_config(load_config(None, tiny(corpus, cache_dir, tmp_path / "eager", **{"model.n_layer": 3})))
    losses = []
    for _ in range(2):
        losses.append((trainer.train_step()["loss_sum"].item(), eager.train_step()["loss_sum"].item()))
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    for _ in range(3):
        losses.append((trainer.train_step()["loss_sum"].item(), eager.train_step()["loss_sum"].item()))
    assert graphs_after_warmup >= 1  # the blocks really were compiled
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup  # steady state: no recompiles
    assert graphs_after_warmup == 1, dict(counters["stats"])  # one graph serves all 3 blocks (not one per layer_idx)
    assert not counters["recompiles"] or sum(counters["recompiles"].values()) <= 1
    for compiled, plain in losses:
        assert compiled == pytest.approx(plain, rel=fp32_tol(1e-4))


@pytest.mark.cuda
def test_whole_model_compiles_to_one_graph_with_eager_losses(corpus, cache_dir, tmp_path):
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled, eager = (Trainer.from_config(load_config(None, tiny(corpus, cache_dir, tmp_path / mode, **{
        "parallel.compile": mode, "train.loss_chunk_size": 16}))) for mode in ("model", "false"))
    pairs = [(compiled.train_step()["loss_sum"].item(), eager.train_step()["loss_sum"].item()) for _ in range(3)]
    assert all(c == pytest.approx(e, rel=fp32_tol(1e-4)) for c, e in pairs), pairs
    # embeddings, blocks, final norm and the chunked loss in one graph: no breaks, no recompiles (on CUDA the
    # chunked loss runs eager, a torch 2.11 inductor workaround in parallel.py: the one break is there; dynamo
    # counts it once per frame it unwinds, so the reasons are counted, not the events)
    allowed = {"linear_cross_entropy"} if compiled.device.type == "cuda" else set()
    reasons = {r for r in counters["graph_break"] if not any(name in r for name in allowed)}
    assert counters["stats"]["unique_graphs"] == 1 and not reasons and len(counters["graph_break"]) <= len(allowed), (
        dict(counters["stats"]), dict(counters["graph_break"]), dict(counters["recompiles"]))


@pytest.mark.cuda
def test_compiled_attention_of_unpadded_blocks_is_causal_without_a_mask():
    """Traced, transformers builds a full (B, 1, T, T) mask (it cannot rule out packed sequences), which denies
    SDPA its causal flash kernels; shardlm's blocks get is_causal=True. A sliding window stays a real mask."""
    from shardlm.models.hf_config import model_config
    from shardlm.models.instantiate import empty_model
    from shardlm.tokenizer import load_tokenizer

    def sdpa_calls(arch: str, attention: str = "auto", **config_overrides) -> list[dict]:
        cfg = load_config(None, ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.seq_len=16",
                                 f"model.arch={arch}", f"model.config_overrides={config_overrides}",
                                 f"model.attention={attention}"])
        model = empty_model(model_config(cfg, load_tokenizer("bytes")), "cpu")
        calls: list[dict] = []

        def capture(gm, _inputs):
            calls.extend(dict(n.kwargs) for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
            return gm

        torch._dynamo.reset()
        torch.compile(model, backend=capture)(input_ids=torch.randint(0, 200, (2, 16)))
        return calls

    (gpt2,) = sdpa_calls("gpt2")
    assert gpt2["attn_mask"] is None and gpt2["is_causal"] is True
    (window,) = sdpa_calls("mistral", sliding_window=4)
    assert window["attn_mask"] is not None and window["is_causal"] is False
    (stock,) = sdpa_calls("gpt2", "sdpa")  # model.attention=sdpa: transformers' own masks
    assert stock["attn_mask"] is not None and stock["is_causal"] is False
    from transformers import AutoConfig

    from shardlm.models.attention import attention
    assert attention(AutoConfig.for_model("falcon")) == "sdpa"  # untested families (Falcon branches on the name)

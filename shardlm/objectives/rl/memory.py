"""What online RL adds to `shardlm estimate`: its micro-batch's rows (a prompt's group under one 4D mask where the
family shares a prompt), the loss on completion tokens only, the frozen reference of grpo.beta, and the
generation phase (the KV cache and the decode step's logits), which may set the peak instead of the step."""

from __future__ import annotations

from shardlm.config import Config
from shardlm.models import lora
from shardlm.models.causal_lm import SHARED_PREFIX_FAMILIES
from shardlm.objectives.base import Footprint, MemoryTerms


def rl_memory(cfg: Config, f: Footprint) -> MemoryTerms:
    out = MemoryTerms()
    if cfg.grpo.beta > 0 and not lora.enabled(cfg.lora):
        out.resident["reference for grpo.beta (initial model, frozen)"] = f.initial_model
    if not f.full_logits:  # completion_logps' own chunks replace the loss's
        out.loss = rl_loss_bytes(cfg, f.head[0], f.head[1], f.csize, f.head[2])
    whole = f.whole if f.gathered else 0.0  # 0 where the local shards are the whole fp32 tensors
    out.phase = generation_bytes(cfg, f.hf_config, f.layers, f.csize, max(0.0, whole - f.gathered))
    return out


def rl_rows(cfg: Config, hf_cfg) -> tuple[int, int, bool]:
    """(rows, tokens per row, shared) of a grpo/rloo micro-batch as shardlm.objectives.rl.step packs it, at its
    longest: for the SDPA families that share a prompt (`shares_prefix`) a row per prompt, the prompt once and
    then its group's completions under a 4D mask (shared), so attention's (row x row) terms grow with group x
    max_completion_length; else a row per completion of up to data.seq_len."""
    g, batch, seq_len = cfg.grpo, cfg.train.batch_size, cfg.data.seq_len
    sliding = getattr(hf_cfg, "use_sliding_window", False) and getattr(hf_cfg, "sliding_window", None)
    if hf_cfg.model_type not in SHARED_PREFIX_FAMILIES or cfg.model.attention not in ("auto", "sdpa") or sliding:
        return batch, seq_len, False
    return batch // g.group, seq_len - g.max_completion_length - 1 + g.group * g.max_completion_length, True


def rl_loss_bytes(cfg: Config, vocab: int, hidden: int, csize: int, head_trains: bool) -> dict[str, float]:
    """Online RL's loss (CausalLM.completion_logps): the head on the completion tokens only, train.loss_chunk_size
    (or 1024) of them at a time, whose fp32 logits and one more (rows x vocab) fp32 tensor are live together (the
    entropy's exp in forward, the softmax in backward); the head's weight gradient where it trains; the hidden
    states' gradient."""
    targets = cfg.train.batch_size * cfg.grpo.max_completion_length
    rows = min(cfg.train.loss_chunk_size or 1024, targets)
    return {"loss: a chunk's fp32 logits, softmax, entropy": rows * vocab * 8
            + (vocab * hidden * 4 if head_trains else 0) + targets * hidden * csize}


def generation_bytes(cfg: Config, hf_cfg, layers: int, csize: int, unheld: float) -> dict[str, float]:
    """Online RL's generation phase: each rank samples its completions of a round (train.batch_size x
    train.grad_accum rows, objectives.rl.sampling) with the model gathered whole once for the round (`unheld`: the
    bytes beyond what a training step holds gathered); keys and values cached for every row up to data.seq_len
    (prompt + grpo.max_completion_length: an upper bound, a prompt is usually shorter), plus one layer's keys
    copied while the cache grows by a token; and a decode step's (rows x vocab) logits with the fp32 tensors
    sampling makes of them (temperature, softmax, its cumulative sum; top-p sorts and scatters: 28 bytes more)."""
    g, rows, T = cfg.grpo, cfg.train.batch_size * cfg.train.grad_accum, cfg.data.seq_len
    heads = hf_cfg.num_attention_heads
    kv_heads = getattr(hf_cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads
    per_layer = kv_heads * head_dim * T * rows * csize  # its keys, or its values
    per_logit = csize + 12 + (4 if 0 < g.top_k < hf_cfg.vocab_size else 0) + (28 if g.top_p < 1 else 0)
    out = {f"generation: KV cache ({rows} rows x {T} tokens)": (2.0 * layers + 1) * per_layer,
           "generation: decode step logits (rows x vocab)": rows * hf_cfg.vocab_size * per_logit}
    if unheld:
        out["generation: the whole model gathered"] = unheld
    return out

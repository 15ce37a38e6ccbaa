"""The Hugging Face config of the model to train, and the checks it must pass before a model is built.

Read from a hub name or folder (pretrained, with shardlm's overrides) or built from `model.*` (from scratch,
shardlm's size keys mapped to the family's names). Everything here is decided from configs alone: no weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardlm import ShardlmError
from shardlm.config import Config, nearest, objectives
from shardlm.hub import check_model_path, hub_kwargs, hub_reachable
from shardlm.models.attention import PACKING_FAMILIES, TESTED_FAMILIES, attention, check_attention
from shardlm.models.moe import is_moe
from shardlm.models.overrides import apply_overrides
from shardlm.tokenizer import BUILTIN_TEMPLATES, tokenizer_spec

# Config keys of families that transform their logits after the head (Gemma 2 soft-caps them, Cohere and
# Granite scale them): their loss is computed from the model's own logits, never without the transform.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
# Encoder-decoder families whose causal-LM class is their decoder alone and sets is_decoder itself.
SELF_CAUSAL_DECODERS = ("bart", "mbart", "mvp")


def logit_transform(hf_config) -> str | None:
    return next((k for k in LOGIT_TRANSFORMS if getattr(hf_config, k, None) not in (None, 1, 1.0)), None)


def context_length(hf_cfg) -> int | None:
    """Positions the model has (GPT-2 names it n_positions, most other HF models max_position_embeddings)."""
    return getattr(hf_cfg, "n_positions", getattr(hf_cfg, "max_position_embeddings", None))


def model_source(name: str) -> str:
    """A local folder (user paths expanded) or, failing that, the hub name as given."""
    return str(Path(name).expanduser()) if Path(name).expanduser().is_dir() else name


def padded_vocab(tokens: int, multiple: int) -> int:
    """The vocabulary rounded up to `multiple`. GEMMs whose N is not a multiple of 8 miss the tensor-core
    kernels: on an H100 GPT-2's lm_head (N = 50257) ran a cutlass sm80 fallback (profiled). nanoGPT pads to
    50304, litgpt to multiples of 512. The extra ids are never targets, so training pushes their logits
    down, and generation never emits them (they are suppressed in the generation config)."""
    return -(-tokens // max(1, multiple)) * max(1, multiple)


def padding_ids(hf_cfg) -> list[int] | None:
    """The ids that model.vocab_multiple added (no token of the tokenizer), None where there are none."""
    used = getattr(hf_cfg, "tokenizer_size", None)
    return list(range(used, hf_cfg.vocab_size)) if used and used < hf_cfg.vocab_size else None


def scratch_config(cfg: Config, tokenizer):
    """The HF config of a new model of family `model.arch`, shardlm's size keys mapped to the family's names."""
    from transformers import AutoConfig, GPT2Config

    m, eos = cfg.model, tokenizer.eos_token_id
    positions = m.n_positions or cfg.data.seq_len
    vocab = padded_vocab(len(tokenizer), m.vocab_multiple)
    if m.arch == "gpt2":
        inner: dict[str, Any] = {"n_inner": m.intermediate_size} if m.intermediate_size else {}
        return GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=m.n_embd, n_layer=m.n_layer,
                          n_head=m.n_head, bos_token_id=eos, eos_token_id=eos, use_cache=False,
                          **inner, **m.config_overrides)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS

    if m.arch not in CAUSAL_LMS:
        hint = nearest(m.arch, list(CAUSAL_LMS))
        raise ShardlmError(f"model.arch={m.arch!r} is not a causal LM family of transformers.{hint} "
                           f"Tested: {', '.join(TESTED_FAMILIES)}; any model_type of AutoModelForCausalLM works.")
    defaults = AutoConfig.for_model(m.arch)
    sizes = {"vocab_size": vocab, "hidden_size": m.n_embd, "num_hidden_layers": m.n_layer,
             "num_attention_heads": m.n_head, "max_position_embeddings": positions,
             "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "use_cache": False}
    if hasattr(defaults, "num_key_value_heads"):
        sizes["num_key_value_heads"] = m.n_kv_head or m.n_head
    if hasattr(defaults, "head_dim"):  # Gemma, Qwen3, Mistral default to a fixed 128/256, not width/heads
        sizes["head_dim"] = m.n_embd // m.n_head
    if hasattr(defaults, "word_embed_proj_dim"):  # OPT projects embeddings unless this equals the width
        sizes["word_embed_proj_dim"] = m.n_embd
    mlp = "ffn_dim" if hasattr(defaults, "ffn_dim") else "intermediate_size"
    sizes[mlp] = m.intermediate_size or 4 * m.n_embd
    return AutoConfig.for_model(m.arch, **{**sizes, **m.config_overrides})


def pretrained_config(cfg: Config):
    """The config of `model.name` (a folder or a hub name), or one line saying why it cannot be read."""
    from transformers import AutoConfig

    m = cfg.model
    if m.name is None:
        raise ValueError("pretrained_config needs model.name (a model from scratch has scratch_config)")
    check_model_path(m.name)
    try:
        source = model_source(m.name)
        return AutoConfig.from_pretrained(source, trust_remote_code=m.trust_remote_code, **hub_kwargs(source))
    except (OSError, ValueError) as e:
        if Path(m.name).exists():
            why = "it is a folder without a config.json"
        elif hub_reachable():
            why = ("it is not a local folder and the Hugging Face Hub did not serve it "
                   f"({str(e).splitlines()[0][:160]})")
        else:
            why = ("it is not a local folder, the Hugging Face Hub cannot be reached and it is not in the "
                   "local HF cache")
        raise ShardlmError(
            f"cannot load model '{m.name}': {why}. Offline, point model.name at a local folder holding "
            "config.json and model.safetensors (e.g. one saved with save_pretrained or `shardlm export`)."
        ) from None


def model_config(cfg: Config, tokenizer):
    """The HF config of the model to train: read from the hub/folder, or built from cfg for scratch."""
    m = cfg.model
    if m.name is None and m.rope_scaling:
        raise ShardlmError("model.rope_scaling stretches a pretrained model's context (model.name); from scratch, set "
                           "model.n_positions to the context you train at.")
    hf_cfg = scratch_config(cfg, tokenizer) if m.name is None else \
        apply_overrides(pretrained_config(cfg), m.config_overrides, m.rope_scaling)
    dropouts = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout")
    for key in dropouts:
        if hasattr(hf_cfg, key):
            setattr(hf_cfg, key, m.dropout)
    hf_cfg.use_cache = False
    if m.name is None and hf_cfg.vocab_size > len(tokenizer):
        hf_cfg.tokenizer_size = len(tokenizer)  # the padded ids above it are suppressed in generation
    check_tokenizer(hf_cfg, tokenizer, cfg)
    check_model(hf_cfg, cfg)
    if getattr(hf_cfg, "activation_function", None) == "gelu_new":
        # The same tanh-GELU as one fused op instead of seven: saves ~30% of block activation memory
        # (measured with shardlm estimate) and several memory passes per step. HF reads the name back.
        hf_cfg.activation_function = "gelu_pytorch_tanh"
    hf_cfg._attn_implementation = attention(hf_cfg) if m.attention == "auto" else check_attention(m.attention, hf_cfg)
    return hf_cfg


def check_tokenizer(hf_cfg, tokenizer, cfg: Config) -> None:
    """A tokenizer that is not the model's would train without complaint on ids the model never learned."""
    name = tokenizer_spec(cfg.model)
    vocab = getattr(hf_cfg, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab and cfg.model.chat_template in BUILTIN_TEMPLATES:
        raise ShardlmError(f"model.chat_template={cfg.model.chat_template} adds special tokens to tokenizer '{name}' "
                           f"({len(tokenizer)} tokens) that the model's vocabulary of {vocab} has no room for: use "
                           "model.chat_template=plain (it adds no tokens), or a .jinja template written with the "
                           "model's own tokens.")
    if vocab is not None and len(tokenizer) > vocab:
        raise ShardlmError(f"tokenizer '{name}' has {len(tokenizer)} tokens but the model's vocabulary "
                           f"holds {vocab}: use the model's own tokenizer (leave model.tokenizer unset).")
    eos = getattr(hf_cfg, "eos_token_id", None)
    expected: set[int] = set(eos) if isinstance(eos, list) else set() if eos is None else {eos}
    if cfg.model.name is not None and expected and tokenizer.eos_token_id not in expected:
        raise ShardlmError(
            f"tokenizer '{name}' is not the tokenizer of model '{cfg.model.name}': its end-of-text id is "
            f"{tokenizer.eos_token_id}, the model's is {sorted(expected)[0]}. Leave model.tokenizer unset to use "
            "the model's own tokenizer.")


def bidirectional_flag(hf_cfg) -> str | None:
    """The config flag that makes an encoder family (BERT, RoBERTa, XLM, ...) attend causally, where it is off.
    AutoModelForCausalLM builds these with a head for next tokens but a bidirectional mask unless the flag is set,
    so each position would see the token it is trained to predict: a loss near zero that generates nothing."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED_LMS

    kind = hf_cfg.model_type
    if kind not in CAUSAL_LMS or kind not in MASKED_LMS or kind in SELF_CAUSAL_DECODERS:
        return None
    flag = "causal" if kind == "xlm" else "is_decoder"
    return None if getattr(hf_cfg, flag, False) else flag


def check_model(hf_cfg, cfg: Config) -> None:
    """What this model cannot train as configured: refused before any weight is read."""
    if flag := bidirectional_flag(hf_cfg):
        raise ShardlmError(f"model family '{hf_cfg.model_type}' is a bidirectional encoder ({flag}=false): every "
                           "position would see the token it is trained to predict. Train a causal LM (GPT-2, Llama, "
                           f"Qwen, ...), or set model.config_overrides='{{\"{flag}\": true}}' to train it as a "
                           "decoder.")
    if not objectives.spec(cfg).router_loss and is_moe(hf_cfg) and getattr(hf_cfg, "output_router_logits", False):
        raise ShardlmError(f"train.objective={cfg.train.objective} on a mixture-of-experts model whose config adds the "
                           "router's load-balancing loss (output_router_logits=true): shardlm's preference losses do "
                           "not add it yet. Set model.config_overrides='{\"output_router_logits\": false}' to "
                           "preference-tune it without that term.")
    if (transform := logit_transform(hf_cfg)) and cfg.train.loss_chunk_size:
        raise ShardlmError(f"{hf_cfg.model_type} transforms its logits ({transform}={getattr(hf_cfg, transform)}), "
                           "which the chunked loss does not apply: set train.loss_chunk_size=0 or leave it null.")
    positions = context_length(hf_cfg)
    if positions is not None and cfg.data.seq_len > positions:
        rope = hasattr(hf_cfg, "rope_theta") or getattr(hf_cfg, "rope_parameters", None)
        stretch = (", or stretch its context with model.rope_scaling='{type: yarn, factor: "
                   f"{-(-cfg.data.seq_len // positions)}}}'" if cfg.model.name is not None and not
                   cfg.model.rope_scaling and rope else "")
        raise ShardlmError(f"data.seq_len={cfg.data.seq_len} exceeds the model's {positions} positions; "
                           f"set data.seq_len<={positions}{stretch}.")


def check_packing(hf_cfg, packing: bool) -> None:
    """Packed examples on a family whose attention would let them see each other are refused, never trained."""
    if packing and hf_cfg.model_type not in PACKING_FAMILIES:
        why = {"opt": "its attention mask ignores position ids",
               "gpt_oss": "in its attention (sinks) packed rows differ from each example alone"}.get(
            hf_cfg.model_type, "it is not among the families verified to keep packed examples apart")
        raise ShardlmError(f"data.packing=true would let packed examples attend to each other in model family "
                           f"'{hf_cfg.model_type}' ({why}; verified: {', '.join(PACKING_FAMILIES)}). Set "
                           "data.packing=false (each example padded in its own row).")

"""Attention for shardlm's blocks: which implementation a model is built with (`model.attention`), the causal
SDPA mask that lets compiled blocks take `is_causal=True`, and what transformers' mask builder is told about
packed rows. The tested families live here too: which ones get shardlm's SDPA mask and which keep packed
examples apart.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from shardlm import ShardlmError
from shardlm.models.moe import TESTED_MOE_FAMILIES

# model_types verified by tests/test_families.py (FSDP parity, ties, loss = the model's own, export, resume)
TESTED_FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "gpt_neox", "opt",
                   *TESTED_MOE_FAMILIES)
# Families whose transformers attention keeps packed examples apart given restarting position ids (verified by
# tests/test_examples.py: packed rows = each example alone). OPT builds its mask without the position ids; in
# GPT-OSS's (attention sinks, eager) packed rows differ from each example alone.
PACKING_FAMILIES = tuple(f for f in TESTED_FAMILIES if f not in ("opt", "gpt_oss"))


def check_attention(choice: str, hf_cfg) -> str:
    """`model.attention` as given, if the family supports it and what it needs is installed (transformers
    would refuse it later, in a build, with a traceback)."""
    import importlib.util

    model_class = causal_lm_class(hf_cfg)
    flag = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}.get(choice, "_supports_flash_attn")
    if choice != "eager" and model_class is not None and not getattr(model_class, flag, False):
        raise ShardlmError(f"model.attention={choice}: {model_class.__name__} does not support it in this "
                           "transformers version; use model.attention=auto (or eager).")
    package = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(choice)
    if package and importlib.util.find_spec(package) is None:
        raise ShardlmError(f"model.attention={choice} needs the {package} package and a CUDA GPU "
                           f"(pip install {package.replace('_interface', '').replace('_', '-')}); "
                           "model.attention=auto uses SDPA's flash kernels without it.")
    return choice


def causal_lm_class(hf_cfg):
    """The transformers class AutoModelForCausalLM builds for this config; None for remote code."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping.get(type(hf_cfg), None)


CAUSAL_SDPA = "shardlm_sdpa"


def attention(hf_cfg) -> str:
    """The attention a model is built with: `model.attention` where model_config set it, else `auto`'s choice:
    SDPA (flash / memory-efficient kernels) where the family supports it, as `CAUSAL_SDPA` for the tested
    families (some others, e.g. Falcon, branch on the name "sdpa" in their own code); eager where it does
    not (Gemma 2 soft-caps attention logits, which SDPA cannot)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    if getattr(hf_cfg, "_attn_implementation", None) not in (None, CAUSAL_SDPA):
        return hf_cfg._attn_implementation
    model_class = causal_lm_class(hf_cfg)
    if model_class is not None and not getattr(model_class, "_supports_sdpa", False):
        return "eager"
    if getattr(hf_cfg, "model_type", None) not in TESTED_FAMILIES:
        return "sdpa"
    skip_packing_probe()
    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, causal_sdpa_mask)
    return CAUSAL_SDPA


def causal_sdpa_mask(**kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, except that under torch.compile the causal mask of unpadded blocks is None.

    None lets SDPA take `is_causal=True`, whose flash / cuDNN kernels skip the masked half of the scores.
    Traced, transformers cannot rule out that position ids pack several sequences (it asks the data, which a
    graph cannot) and builds the full (batch, 1, T, T) mask: every compiled step (shardlm's default on CUDA)
    attended through an explicit mask, at twice the attention work. shardlm never packs sequences through
    position ids (its blocks run at positions 0..T-1), so that guess is always "one sequence" here. Eager
    calls, padding, sliding windows shorter than the block, custom mask functions and cache offsets get
    transformers' own mask."""
    from transformers.masking_utils import sdpa_mask

    q_offset, kv_offset, local = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0), kwargs.get("local_size")
    if (torch.compiler.is_compiling() and kwargs.get("attention_mask") is None and not kwargs.get("use_vmap")
            and kwargs["q_length"] == kwargs["kv_length"] and (local is None or kwargs["kv_length"] < local)
            and isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0):
        return None
    return sdpa_mask(**kwargs)


class _Rows:
    whole = False  # True while an eager CausalLM forward runs rows that are one sequence each (text blocks)


@contextlib.contextmanager
def one_sequence_per_row(whole: bool):
    """Tell transformers' mask builder, in eager forwards, that each row is one sequence (see `skip_packing_probe`)."""
    if torch.compiler.is_compiling():  # traced, transformers skips the probe itself
        yield
        return
    before, _Rows.whole = _Rows.whole, whole
    try:
        yield
    finally:
        _Rows.whole = before


def skip_packing_probe() -> None:
    """transformers' mask builder asks the device whether position ids restart within a row (packed
    sequences), and waits for the answer: one host sync per eager forward (FSDP2's outer forward is eager). On
    text blocks shardlm knows the answer is no, so that question returns "no" at once; packed examples
    (positions given) and every other caller still get transformers' own."""
    import transformers.masking_utils as masking

    original = masking.find_packed_sequence_indices
    if getattr(original, "shardlm", False):
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if _Rows.whole and not torch.compiler.is_compiling() else original(position_ids)

    find_packed_sequence_indices.shardlm = True  # type: ignore[attr-defined]
    masking.find_packed_sequence_indices = find_packed_sequence_indices

"""The one owner of state-dict key names, in both directions.

shardlm wraps the Hugging Face model as `CausalLM.hf`, so the model's state-dict keys are the HF model's with
`hf.` in front, and a checkpoint's DCP keys add the part they are saved under (`model.hf.`). Wrappers that
add a level to parameter names but not to state-dict keys (activation checkpointing, compile) are removed by
`state_key`. Everything else (build, load, generate, LoRA, XLA, checkpoints) spells keys through here.
"""

from __future__ import annotations

from typing import Any

import torch

HF = "hf."  # CausalLM's attribute holding the transformers model
CHECKPOINT = "model." + HF  # a checkpoint's model part, as DCP keys spell it
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def from_hf(state: dict[str, Any]) -> dict[str, Any]:
    """A transformers state dict keyed as CausalLM's (`transformer.wte.weight` -> `hf.transformer.wte.weight`)."""
    return {HF + k: v for k, v in state.items()}


def to_hf(state: dict[str, Any], prefix: str = HF) -> dict[str, Any]:
    """CausalLM's (or with `prefix=CHECKPOINT`, a checkpoint's) keys as the transformers model spells them."""
    return {k.removeprefix(prefix): v for k, v in state.items()}


def hf_name(name: str) -> str:
    """One CausalLM key or module name as the transformers model spells it."""
    return name.removeprefix(HF)


def is_hf(name: str) -> bool:
    """A CausalLM parameter or buffer name that belongs to the transformers model (not shardlm's own)."""
    return name.startswith(HF)


def checkpoint_key(hf_key: str) -> str:
    """The DCP key of a transformers state-dict key in a shardlm checkpoint."""
    return CHECKPOINT + hf_key


def state_key(name: str) -> str:
    """A parameter or module name as state dicts spell it: without the wrappers' levels."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tied_keys(model: torch.nn.Module) -> dict[str, str]:
    """State-dict key of each tied parameter's other names -> the key it is stored under (GPT-2's
    `hf.lm_head.weight` -> `hf.transformer.wte.weight`): one tensor, stored once."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = state_key(name)
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases

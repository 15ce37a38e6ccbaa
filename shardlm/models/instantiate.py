"""A Hugging Face model from its config: empty (on `meta`, no memory), or with its starting weights.

The meta tricks live here: parameters built on `meta` with real buffers, and the non-persistent buffers (rotary
tables, embedding scales) that no state dict holds, filled into a model loaded on `meta`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.config import Config
from shardlm.hub import hub_kwargs
from shardlm.models.attention import attention
from shardlm.models.hf_config import model_source, padding_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def empty_model(hf_cfg, device: torch.device | str) -> PreTrainedModel:
    """The architecture with no weights loaded (on `meta` it allocates nothing)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attention(hf_cfg),
                                                 trust_remote_code=getattr(hf_cfg, "trust_remote_code", False))
    model.generation_config.suppress_tokens = padding_ids(hf_cfg)
    return model


def initial_model(cfg: Config, hf_cfg, seed: int, **load: Any) -> PreTrainedModel:
    """A real CPU model with the starting weights: pretrained ones, or a seeded random init. `load` goes to
    `from_pretrained` (QLoRA: its 4-bit quantization config and the device to load onto)."""
    from transformers import AutoModelForCausalLM

    if cfg.model.name is None:
        torch.manual_seed(seed)
        return empty_model(hf_cfg, "cpu")
    source = model_source(cfg.model.name)
    try:
        return AutoModelForCausalLM.from_pretrained(source, config=hf_cfg, attn_implementation=attention(hf_cfg),
                                                    trust_remote_code=cfg.model.trust_remote_code,
                                                    dtype=torch.float32, **hub_kwargs(source), **load)
    except (OSError, ValueError) as e:
        raise ShardlmError(f"cannot load weights of '{cfg.model.name}': {str(e).splitlines()[0][:200]}") from None


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on `meta` (no memory, no init work) and real buffers."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:  # replaces the method
        register(self, name, param)
        if param is not None:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def fill_meta_buffers(hf_model: nn.Module) -> None:
    """A model built on `meta` and loaded from a state dict still lacks its non-persistent buffers (rotary
    tables, Gemma's embedding scale are in no state dict): take them from a skeleton built on CPU with its
    parameters on meta."""
    if not any(b.is_meta for b in hf_model.buffers()):
        return
    with parameters_on_meta():
        skeleton = empty_model(hf_model.config, "cpu")
    real = dict(skeleton.named_buffers())
    for name, buf in list(hf_model.named_buffers()):
        if buf.is_meta:
            owner, _, attr = name.rpartition(".")
            hf_model.get_submodule(owner)._buffers[attr] = real[name]

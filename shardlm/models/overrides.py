"""Changes to a pretrained model's config: `model.config_overrides` and `model.rope_scaling`.

From scratch every override goes into the new config. A pretrained model's weights fix its shapes, so there
an override is taken only if every weight keeps its name and shape (dropout, rope_theta, sliding_window,
router settings, ...), checked by building both architectures on the `meta` device (no memory, no init) and
comparing their state dicts: a shape-changing one is refused by name, never half-loaded.

RoPE scaling stretches a pretrained model past the context it was trained at (Llama 3.1's `llama3`, YaRN,
linear position interpolation, dynamic NTK, LongRoPE), as transformers defines each: the config gets the
family's own `rope_parameters` (`rope_scaling` in transformers 4) and `max_position_embeddings` becomes
factor x the original, so `data.seq_len` may go up to it. Checkpoints and exports carry that config, so
transformers (and engines that read the same fields, such as vLLM) load the stretched model.
"""

from __future__ import annotations

import copy
from typing import Any

from shardlm import ShardlmError
from shardlm.config import nearest

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")


def apply_overrides(hf_cfg: Any, overrides: dict[str, Any], rope_scaling: dict[str, Any] | None) -> Any:
    """A copy of the pretrained `hf_cfg` with `overrides` set and RoPE scaled; refused if a weight's shape changes."""
    if not overrides and not rope_scaling:
        return hf_cfg
    new = copy.deepcopy(hf_cfg)
    for key, value in overrides.items():
        if not hasattr(new, key):
            fields = [k for k in new.to_dict() if not k.startswith("_")]
            raise ShardlmError(f"model.config_overrides: {new.model_type} has no config field '{key}'."
                               f"{nearest(key, fields)} Its fields are those of the model's config.json.")
        setattr(new, key, value)
    if rope_scaling:
        scale_rope(new, rope_scaling)
    check_shapes(hf_cfg, new, [*overrides, *(["rope_scaling"] if rope_scaling else [])])
    return new


def scale_rope(hf_cfg: Any, scaling: dict[str, Any]) -> None:
    """Set `model.rope_scaling` ({type, factor, ...}) on a RoPE config, in place."""
    kind = scaling.get("type", scaling.get("rope_type"))
    params = getattr(hf_cfg, "rope_parameters", None)
    legacy = getattr(hf_cfg, "rope_scaling", None) if params is None else None
    if params is None and not hasattr(hf_cfg, "rope_theta"):
        raise ShardlmError(f"model.rope_scaling: {hf_cfg.model_type} has no rotary position embeddings (it learns its "
                           "positions), so there is nothing to scale; its context is fixed at "
                           f"{getattr(hf_cfg, 'n_positions', getattr(hf_cfg, 'max_position_embeddings', '?'))}.")
    if kind not in ROPE_TYPES:
        raise ShardlmError(f"model.rope_scaling needs type: one of {', '.join(ROPE_TYPES)} (transformers' RoPE "
                           f"types), got {kind!r}; e.g. model.rope_scaling='{{type: yarn, factor: 4}}'.")
    factor = scaling.get("factor")
    if not isinstance(factor, int | float) or factor <= 1:
        raise ShardlmError(f"model.rope_scaling needs factor > 1 (the new context / the trained one), got {factor!r}.")
    original = hf_cfg.max_position_embeddings
    rest = {k: v for k, v in scaling.items() if k not in ("type", "rope_type", "factor")}
    if kind == "llama3":  # Llama 3.1's published values unless given
        rest = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, **rest}
    spec = {"rope_type": kind, "factor": float(factor), "original_max_position_embeddings": original, **rest}
    if params is not None:  # transformers 5: rope_theta lives inside rope_parameters
        hf_cfg.rope_parameters = {**params, **spec}
    else:
        hf_cfg.rope_scaling = {**(legacy or {}), **spec, "type": kind}
    hf_cfg.max_position_embeddings = int(original * factor)
    try:
        if hasattr(hf_cfg, "validate_rope"):
            hf_cfg.validate_rope()
    except (ValueError, KeyError, TypeError) as e:
        raise ShardlmError(f"model.rope_scaling {scaling}: transformers refuses it: {str(e).splitlines()[0]}") from None


def check_shapes(before: Any, after: Any, keys: list[str]) -> None:
    """Refuse overrides that change any pretrained weight's name or shape (both models built on meta)."""
    old, new = (shapes(c) for c in (before, after))
    if old == new:
        return
    changed = sorted(set(old.items()) ^ set(new.items()))
    first = changed[0][0]
    what = f"{first}: {old.get(first, 'absent')} -> {new.get(first, 'absent')}"
    raise ShardlmError(f"model.config_overrides {', '.join(keys)} would change the pretrained weights' shapes ({what}; "
                       f"{len(changed)} tensors differ), so the weights could not load. On a pretrained model only "
                       "fields that keep every shape can change (dropout, rope_theta, sliding_window, router "
                       "settings, ...); train from scratch (model.name unset, model.arch) for another size.")


def shapes(hf_cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every state-dict tensor's shape of the architecture, built on `meta` (nothing allocated)."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf_cfg, trust_remote_code=getattr(hf_cfg, "trust_remote_code", False))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}

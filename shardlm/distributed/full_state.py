"""Full (unsharded) state from a sharded model: the one collective every rank must enter for rank 0 to get a
plain Hugging Face model with the trained weights (the end-of-training sample, generation-quality metrics,
tests). Sharded weights meet here with the model's own key names and folds (fp8 wrappers, LoRA adapters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from torch import nn

from shardlm.models.instantiate import empty_model, fill_meta_buffers
from shardlm.models.state_keys import to_hf

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def gather_hf_model(model: nn.Module, hf_config, dist, device: str = "cpu") -> PreTrainedModel | None:
    """A plain HF model with the trained weights, on rank 0 (None elsewhere).

    Shards stream to rank 0's CPU one tensor at a time (no GPU ever holds the whole model).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if dist.distributed or hasattr(model, "reshard"):
        state = get_model_state_dict(model, options=options)
    elif dist.device.type == "xla":  # `.cpu()` of a sharded XLA tensor compiles a gather graph, each time
        from shardlm.distributed.xla import host_copy

        state = host_copy(dict(model.state_dict()))
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if not dist.is_main:
        return None
    from shardlm.models.fp8 import plain_state_dict  # fp8 + FSDP: torchao's weight wrappers survive full state dicts

    state = plain_state_dict(state)
    from shardlm.models.lora import inference_state  # LoRA: fold the adapters into the base weights

    state = inference_state(state, model, hf_config)
    hf = empty_model(hf_config, "meta")
    hf.load_state_dict(to_hf(state), assign=True, strict=False)
    fill_meta_buffers(hf)  # non-persistent buffers (rotary tables) are in no state dict
    hf.tie_weights()
    hf.config.use_cache = True
    # transformers wraps PreTrainedModel.to in functools.wraps, whose type does not bind `self` in some releases
    return cast(Any, hf).to(device).eval()

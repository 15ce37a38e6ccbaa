"""Text generation with a KV cache (transformers' `generate`) from a plain, unsharded HF model."""

from __future__ import annotations

import torch
from torch import nn


def gather_hf_model(model: nn.Module, hf_config, dist, device: str = "cpu") -> nn.Module | None:
    """A plain HF model with the trained weights, on rank 0 (None elsewhere).

    Shards stream to rank 0's CPU one tensor at a time (no GPU ever holds the whole model).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from shardlm.model import empty_model

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options) if dist.distributed or hasattr(model, "reshard") \
        else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if not dist.is_main:
        return None
    hf = empty_model(hf_config, "meta")
    hf.load_state_dict({k.removeprefix("hf."): v for k, v in state.items()}, assign=True, strict=False)
    hf.tie_weights()
    hf.config.use_cache = True
    return hf.to(device).eval()


@torch.no_grad()
def generate_text(hf_model: nn.Module, tokenizer, prompt: str, max_new_tokens: int = 100,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  num_samples: int = 1) -> list[str]:
    """Samples (prompt included); temperature 0 is greedy decoding."""
    device = next(hf_model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] == 0:
        ids = torch.tensor([[tokenizer.eos_token_id]])
    ids = ids.to(device)
    limit = getattr(hf_model.config, "n_positions", getattr(hf_model.config, "max_position_embeddings", None))
    if limit is not None:
        max_new_tokens = max(0, min(max_new_tokens, limit - ids.shape[1]))
    torch.manual_seed(seed)
    greedy = temperature <= 0
    sampling = {} if greedy else {"temperature": temperature, "top_k": top_k or None, "top_p": top_p}
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=not greedy, num_return_sequences=1 if greedy else num_samples,
                            pad_token_id=tokenizer.eos_token_id, use_cache=True, **sampling)
    if greedy and num_samples > 1:
        out = out.repeat(num_samples, 1)
    return [tokenizer.decode(row, skip_special_tokens=False) for row in out.tolist()]


def generate_from_path(path: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                       top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1) -> list[str]:
    from shardlm.load import load_for_inference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, _cfg, _ckpt = load_for_inference(path, device)
    return generate_text(model, tokenizer, prompt, max_new_tokens, temperature, top_k, top_p, seed, num_samples)

"""Text generation with a KV cache (transformers' `generate`) from a plain, unsharded HF model."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.model import context_length, empty_model


def gather_hf_model(model: nn.Module, hf_config, dist, device: str = "cpu") -> nn.Module | None:
    """A plain HF model with the trained weights, on rank 0 (None elsewhere).

    Shards stream to rank 0's CPU one tensor at a time (no GPU ever holds the whole model).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options) if dist.distributed or hasattr(model, "reshard") \
        else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if not dist.is_main:
        return None
    # non-persistent buffers (rotary tables) are in no state dict: take the training model's, already right
    buffers = {k.replace("_orig_mod.", "").removeprefix("hf."): v.detach().cpu() for k, v in model.named_buffers()}
    from shardlm.fp8 import plain_state_dict  # fp8 + FSDP: torchao's weight wrappers survive full state dicts

    state = plain_state_dict(state)
    hf = empty_model(hf_config, "meta")
    hf.load_state_dict({k.removeprefix("hf."): v for k, v in state.items()}, assign=True, strict=False)
    for name, buf in buffers.items():
        owner, _, attr = name.rpartition(".")
        hf.get_submodule(owner)._buffers[attr] = buf
    hf.tie_weights()
    hf.config.use_cache = True
    return hf.to(device).eval()


@torch.no_grad()
def generate_tokens(hf_model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos: int,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                    num_samples: int = 1) -> list[list[int]]:
    """The new tokens of each sample, cut after its first EOS; temperature 0 is greedy decoding.

    Past the model's context the window slides, as in nanoGPT: each round keeps the last half-context as
    the prompt and continues with a fresh KV cache, so no position the model never trained is used.
    """
    context = max(2, context_length(hf_model.config) or len(prompt_ids) + max_new_tokens)
    torch.manual_seed(seed)
    greedy = temperature <= 0
    sampling = {} if greedy else {"temperature": temperature, "top_k": top_k or None, "top_p": top_p}
    out = torch.tensor([prompt_ids], device=next(hf_model.parameters()).device).repeat(1 if greedy else num_samples, 1)
    remaining = max_new_tokens
    while remaining > 0:
        window = out if out.shape[1] < context else out[:, -(context // 2):]
        steps = min(remaining, context - window.shape[1])
        new = hf_model.generate(window, attention_mask=torch.ones_like(window), max_new_tokens=steps,
                                do_sample=not greedy, pad_token_id=eos, eos_token_id=eos, use_cache=True,
                                **sampling)[:, window.shape[1]:]
        out, remaining = torch.cat([out, new], dim=1), remaining - steps
        if (out[:, len(prompt_ids):] == eos).any(dim=1).all():
            break
    rows = [row[len(prompt_ids):] for row in out.tolist()]
    rows = [row[:row.index(eos) + 1] if eos in row else row for row in rows]
    return rows * num_samples if greedy else rows


def generate_text(hf_model: nn.Module, tokenizer, prompt: str, max_new_tokens: int = 100,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  num_samples: int = 1) -> list[str]:
    """Samples, prompt included (see `generate_tokens`)."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]
    rows = generate_tokens(hf_model, ids, max_new_tokens, tokenizer.eos_token_id, temperature, top_k, top_p,
                           seed, num_samples)
    return [tokenizer.decode(ids + row, skip_special_tokens=False) for row in rows]


def generate_from_path(path: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                       top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 1) -> list[str]:
    from shardlm.load import load_for_inference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, _cfg, _ckpt = load_for_inference(path, device)
    return generate_text(model, tokenizer, prompt, max_new_tokens, temperature, top_k, top_p, seed, num_samples)

"""Model building: a Hugging Face causal LM (GPT-2 by default) wrapped with a memory-lean loss.

`CausalLM` is the module FSDP shards as its root: running the loss inside its forward means the tied
lm_head/wte weight is unsharded exactly while the loss needs it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.config import Config
from shardlm.hub import hub_kwargs, hub_reachable
from shardlm.loss import linear_cross_entropy

HUB_GPT2 = {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}


class CausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module, loss_chunk_size: int = 0):
        super().__init__()
        self.hf = hf_model
        self.loss_chunk_size = loss_chunk_size
        self.loss_fn = linear_cross_entropy  # parallelize may replace it with a compiled one

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of token losses and count of correct next-token predictions (targets -100 are ignored)."""
        hidden = self.hf.base_model(input_ids=tokens, use_cache=False).last_hidden_state
        head = self.hf.get_output_embeddings()
        return self.loss_fn(hidden.flatten(0, 1), head.weight, targets.flatten(), self.loss_chunk_size,
                            bias=getattr(head, "bias", None), with_accuracy=not self.training)


def auto_loss_chunk(configured: int | None, batch: int, seq_len: int, vocab: int, device: torch.device,
                    compiled: bool = False) -> int:
    """`train.loss_chunk_size`, with null resolved by the size of a micro-batch's fp32 logits.

    Chunking keeps one chunk's logits instead of all of them, but costs a Python loop and per-chunk
    launches, which on small models are the whole step. Compiled on CUDA, inductor fuses the plain loss
    (no fp32 copies): measured on an H100 (GPT-2 124M, batch 16 x 1024) it was faster than chunks of
    1024 (+11%) or 4096 (+5%) and no larger, so it is kept up to 8 GiB of logits, then chunks of 4096.
    Eager, the plain loss holds fp32 logits, log-softmax and gradient: chunked above 1 GiB (64 MiB on CPU).
    """
    if configured is not None:
        return configured
    logits = batch * seq_len * vocab * 4
    if compiled and device.type == "cuda":
        return 0 if logits <= 8 * 2**30 else 4096
    return 0 if logits <= (2**30 if device.type == "cuda" else 64 * 2**20) else 1024


def transformer_blocks(hf_model: nn.Module) -> nn.ModuleList:
    """The repeated decoder blocks (GPT-2's `transformer.h`, Llama's `model.layers`, ...)."""
    names = set(getattr(hf_model, "_no_split_modules", None) or [])
    for module in hf_model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in names:
            return module
    biggest = max((m for m in hf_model.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)
    if biggest is None:
        raise ShardlmError(f"cannot find the transformer blocks of {type(hf_model).__name__} to shard.")
    return biggest


def context_length(hf_cfg) -> int | None:
    """Positions the model has (GPT-2 names it n_positions, most other HF models max_position_embeddings)."""
    return getattr(hf_cfg, "n_positions", getattr(hf_cfg, "max_position_embeddings", None))


def model_source(name: str) -> str:
    """A local folder (user paths expanded) or, failing that, the hub name as given."""
    return str(Path(name).expanduser()) if Path(name).expanduser().is_dir() else name


def model_config(cfg: Config, tokenizer):
    """The HF config of the model to train: read from the hub/folder, or built from cfg for scratch."""
    from transformers import AutoConfig, GPT2Config

    m = cfg.model
    dropout = {"resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout}
    eos = tokenizer.eos_token_id
    if m.name is None:
        hf_cfg = GPT2Config(vocab_size=len(tokenizer), n_positions=m.n_positions or cfg.data.seq_len, n_embd=m.n_embd,
                            n_layer=m.n_layer, n_head=m.n_head, bos_token_id=eos, eos_token_id=eos,
                            use_cache=False, **dropout)
    else:
        try:
            source = model_source(m.name)
            hf_cfg = AutoConfig.from_pretrained(source, trust_remote_code=m.trust_remote_code, **hub_kwargs(source))
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
        for key, value in dropout.items():
            if hasattr(hf_cfg, key):
                setattr(hf_cfg, key, value)
        hf_cfg.use_cache = False
    vocab = getattr(hf_cfg, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ShardlmError(f"tokenizer '{m.tokenizer}' has {len(tokenizer)} tokens but the model's vocabulary "
                           f"holds {vocab}: use the model's own tokenizer (model.tokenizer).")
    positions = context_length(hf_cfg)
    if positions is not None and cfg.data.seq_len > positions:
        raise ShardlmError(f"data.seq_len={cfg.data.seq_len} exceeds the model's {positions} positions; "
                           f"set data.seq_len<={positions}.")
    if getattr(hf_cfg, "activation_function", None) == "gelu_new":
        # The same tanh-GELU as one fused op instead of seven: saves ~30% of block activation memory
        # (measured with shardlm estimate) and several memory passes per step. HF reads the name back.
        hf_cfg.activation_function = "gelu_pytorch_tanh"
    hf_cfg._attn_implementation = "sdpa"
    return hf_cfg


def empty_model(hf_cfg, device: torch.device | str) -> nn.Module:
    """The architecture with no weights loaded (on `meta` it allocates nothing)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa",
                                                trust_remote_code=getattr(hf_cfg, "trust_remote_code", False))


def initial_model(cfg: Config, hf_cfg, seed: int) -> nn.Module:
    """A real CPU model with the starting weights: pretrained ones, or a seeded random init."""
    from transformers import AutoModelForCausalLM

    if cfg.model.name is None:
        torch.manual_seed(seed)
        return empty_model(hf_cfg, "cpu")
    source = model_source(cfg.model.name)
    try:
        return AutoModelForCausalLM.from_pretrained(source, config=hf_cfg, attn_implementation="sdpa",
                                                    trust_remote_code=cfg.model.trust_remote_code,
                                                    dtype=torch.float32, **hub_kwargs(source))
    except (OSError, ValueError) as e:
        raise ShardlmError(f"cannot load weights of '{cfg.model.name}': {str(e).splitlines()[0][:200]}") from None


def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or (exclude_embeddings and name.endswith("wpe.weight")):
            continue
        seen.add(id(p))
        total += p.numel()
    return total

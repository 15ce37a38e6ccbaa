"""Model building: a Hugging Face causal LM (GPT-2 by default) wrapped with a memory-lean loss.

`CausalLM` is the module FSDP shards as its root: running the loss inside its forward means the tied
lm_head/wte weight is unsharded exactly while the loss needs it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from shardlm import ShardlmError
from shardlm.config import Config, nearest
from shardlm.hub import check_model_path, hub_kwargs, hub_reachable
from shardlm.models.attention import (
    PACKING_FAMILIES,
    TESTED_FAMILIES,
    attention,
    check_attention,
    one_sequence_per_row,
)
from shardlm.models.loss import IGNORE, linear_cross_entropy, logits_cross_entropy
from shardlm.models.moe import is_moe, router_objective
from shardlm.models.overrides import apply_overrides
from shardlm.tokenizer import BUILTIN_TEMPLATES, tokenizer_spec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Config keys of families that transform their logits after the head (Gemma 2 soft-caps them, Cohere and
# Granite scale them): their loss is computed from the model's own logits, never without the transform.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_packing(hf_cfg, packing: bool) -> None:
    """Packed examples on a family whose attention would let them see each other are refused, never trained."""
    if packing and hf_cfg.model_type not in PACKING_FAMILIES:
        why = {"opt": "its attention mask ignores position ids",
               "gpt_oss": "in its attention (sinks) packed rows differ from each example alone"}.get(
            hf_cfg.model_type, "it is not among the families verified to keep packed examples apart")
        raise ShardlmError(f"data.packing=true would let packed examples attend to each other in model family "
                           f"'{hf_cfg.model_type}' ({why}; verified: {', '.join(PACKING_FAMILIES)}). Set "
                           "data.packing=false (each example padded in its own row).")


def logit_transform(hf_config) -> str | None:
    return next((k for k in LOGIT_TRANSFORMS if getattr(hf_config, k, None) not in (None, 1, 1.0)), None)


class _NoPaddingAlarm(logging.Filter):
    """transformers warns when a row starts or ends with the pad id and no attention mask is given. shardlm's rows
    are packed with their own positions and sequence ids, and the pad id is usually EOS (text pairs end with it):
    the warning, two lines in every run on such data, is about nothing shardlm feeds a model."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("We strongly recommend passing in an `attention_mask`")


NO_PADDING_ALARM = _NoPaddingAlarm()


class CausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module, loss_chunk_size: int = 0):
        from transformers import PreTrainedModel

        super().__init__()
        logging.getLogger("transformers.modeling_utils").addFilter(NO_PADDING_ALARM)  # once: a set of filters
        if not isinstance(hf_model, PreTrainedModel):
            raise TypeError(f"CausalLM wraps a transformers PreTrainedModel, not a {type(hf_model).__name__}")
        self.hf: PreTrainedModel = hf_model
        self.loss_chunk_size = loss_chunk_size
        self.loss_fn = linear_cross_entropy  # parallelize may replace it with a compiled one
        self.full_logits = logit_transform(hf_model.config) is not None or hf_model.get_output_embeddings() is None
        self.router = router_objective(hf_model)  # mixture-of-experts: the auxiliary loss its forward adds
        # model.vocab_multiple's padding rows: trained down, but left out of evaluation, as the export trims them
        self.vocab: int | None = getattr(hf_model.config, "tokenizer_size", None)
        if self.router:  # aux loss sum, forwards, then tokens per (layer, expert): read and zeroed by the records
            self.register_buffer("router_stats", torch.zeros(2 + self.router.layers * self.router.num_experts),
                                 persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None, sequences: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of token losses and count of correct next-token predictions (targets -100 are ignored).
        `positions` restarting at 0 mark packed examples: transformers keeps attention inside each one. With
        `segments` (preference pairs), instead the summed log-probability of the targets of each of `sequences`
        sequences, and their target counts."""
        kwargs: dict = {} if positions is None else {"position_ids": positions}
        routed = self.router is not None and self.training and segments is None
        if routed:
            kwargs = {**kwargs, "output_router_logits": True}
        if self.full_logits:
            with one_sequence_per_row(positions is None):  # the model call only: a graph break inside a
                out = self.hf(input_ids=tokens, use_cache=False, **kwargs)  # context manager drops the frame
            if segments is not None:
                return sequence_logps(out.logits.flatten(0, 1), targets.flatten(), segments.flatten(), sequences)
            logits = out.logits if self.training or not self.vocab else out.logits[..., :self.vocab]
            loss = logits_cross_entropy(logits.flatten(0, 1), targets.flatten(), with_accuracy=not self.training)
            return self._with_router_loss(loss, out, targets) if routed else loss
        with one_sequence_per_row(positions is None):
            out = self.hf.base_model(input_ids=tokens, use_cache=False, **kwargs)
        loss = self._head_loss(out.last_hidden_state.flatten(0, 1), targets.flatten(), positions, segments, sequences)
        return self._with_router_loss(loss, out, targets) if routed else loss

    def _with_router_loss(self, loss: tuple[torch.Tensor, torch.Tensor], out: Any,
                          targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's auxiliary term added as its forward adds it to the mean loss (x this micro-batch's targets,
        so the step's division by its target count gives coef x aux), and the expert load recorded."""
        assert self.router is not None
        loss_sum, correct = loss
        aux = self.router.aux_loss(out.router_logits)
        counts = self.router.expert_counts(out.router_logits)
        stats: torch.Tensor = self.router_stats  # type: ignore[assignment]
        with torch.no_grad():
            stats[0] += aux.detach().float()
            stats[1] += 1
            stats[2:2 + counts.numel()] += counts.flatten()
        if self.router.in_loss:
            loss_sum = loss_sum + self.router.coef * aux * (targets != IGNORE).sum()
        return loss_sum, correct

    def _head_loss(self, hidden: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
                   segments: torch.Tensor | None, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.hf.get_output_embeddings()
        segments = None if segments is None else segments.flatten()
        if positions is not None and not torch.compiler.is_compiling():
            # examples: most positions are prompts or padding; the head and loss run on the targets alone
            # (the same sums; eager only, as the count is data-dependent)
            keep = (targets != IGNORE).nonzero().squeeze(1)
            hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
            segments = None if segments is None else segments.index_select(0, keep)
        if segments is not None:
            logits = F.linear(hidden, head.weight, getattr(head, "bias", None))
            return sequence_logps(logits, targets, segments, sequences)
        weight, bias = head.weight, getattr(head, "bias", None)
        if self.vocab and not self.training:  # the exported model's logits: real tokens only
            weight, bias = weight[:self.vocab], None if bias is None else bias[:self.vocab]
        return self.loss_fn(hidden, weight, targets, self.loss_chunk_size, bias=bias, with_accuracy=not self.training)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor,
                   sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's targets, their counts), in fp32 like the loss."""
    valid = targets != IGNORE
    token_logps = -F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="none")
    index = torch.where(valid, segments, sequences)  # non-targets go to a spare slot, dropped
    sums = torch.zeros(sequences + 1, device=logits.device, dtype=torch.float32).index_add(0, index, token_logps)
    counts = torch.zeros(sequences + 1, device=logits.device, dtype=torch.float32).index_add(0, index, valid.float())
    return sums[:sequences], counts[:sequences]


def auto_loss_chunk(configured: int | None, batch: int, seq_len: int, vocab: int, device: torch.device,
                    compiled: bool = False, itemsize: int = 4) -> int:
    """`train.loss_chunk_size`, with null resolved by the size of a micro-batch's logits.

    Chunking keeps one chunk's logits instead of all of them, but costs a Python loop and per-chunk
    launches, which on small models are the whole step. Compiled on CUDA, inductor fuses the plain loss: it
    holds the logits in the compute dtype (`itemsize` bytes: 2 in bf16) and no fp32 copies. Measured on an
    H100 (GPT-2 124M, batch 16 x 1024) it was faster than chunks of 1024 (+11%) or 4096 (+5%) and no
    larger, so it is kept up to 8 GiB of those logits (bf16: micro-batch 80 of GPT-2 at 1024), then chunks of
    4096, which run eager. Eager, the plain loss holds fp32 logits, log-softmax and gradient: chunked above
    1 GiB of fp32 logits (64 MiB on CPU).
    """
    if configured is not None:
        return configured
    tokens = batch * seq_len * vocab
    if compiled and device.type == "cuda":
        return 0 if tokens * itemsize <= 8 * 2**30 else 4096
    return 0 if tokens * 4 <= (2**30 if device.type in ("cuda", "xla") else 64 * 2**20) else 1024


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


def padded_vocab(tokens: int, multiple: int) -> int:
    """The vocabulary rounded up to `multiple`. GEMMs whose N is not a multiple of 8 miss the tensor-core
    kernels: on an H100 GPT-2's lm_head (N = 50257) ran a cutlass sm80 fallback (profiled). nanoGPT pads to
    50304, litgpt to multiples of 512. The extra ids are never targets, so training pushes their logits
    down, and generation never emits them (they are suppressed in the generation config)."""
    return -(-tokens // max(1, multiple)) * max(1, multiple)


def pretrained_config(cfg: Config):
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
    if cfg.train.objective != "sft" and is_moe(hf_cfg) and getattr(hf_cfg, "output_router_logits", False):
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
                   f"{-(-cfg.data.seq_len // positions)}}}'" if m.name is not None and not m.rope_scaling and rope
                   else "")
        raise ShardlmError(f"data.seq_len={cfg.data.seq_len} exceeds the model's {positions} positions; "
                           f"set data.seq_len<={positions}{stretch}.")
    if getattr(hf_cfg, "activation_function", None) == "gelu_new":
        # The same tanh-GELU as one fused op instead of seven: saves ~30% of block activation memory
        # (measured with shardlm estimate) and several memory passes per step. HF reads the name back.
        hf_cfg.activation_function = "gelu_pytorch_tanh"
    hf_cfg._attn_implementation = attention(hf_cfg) if m.attention == "auto" else check_attention(m.attention, hf_cfg)
    return hf_cfg


def empty_model(hf_cfg, device: torch.device | str) -> PreTrainedModel:
    """The architecture with no weights loaded (on `meta` it allocates nothing)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attention(hf_cfg),
                                                 trust_remote_code=getattr(hf_cfg, "trust_remote_code", False))
    model.generation_config.suppress_tokens = padding_ids(hf_cfg)
    return model


def padding_ids(hf_cfg) -> list[int] | None:
    """The ids that model.vocab_multiple added (no token of the tokenizer), None where there are none."""
    used = getattr(hf_cfg, "tokenizer_size", None)
    return list(range(used, hf_cfg.vocab_size)) if used and used < hf_cfg.vocab_size else None


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


def num_params(model: nn.Module, exclude_embeddings: bool = False, trainable_only: bool = False) -> int:
    """Parameters, each shared (tied) tensor once; full sizes also for DTensor shards."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or (exclude_embeddings and name.endswith("wpe.weight")) or \
                (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total

"""`shardlm estimate CONFIG`: per-rank peak memory before launching anything.

Parameters, gradients and AdamW state follow from the parameter count (counted on the `meta` device) and
the sharding strategy. Activations are what autograd saves per token per block: measured by running ONE
block on a 32-token input with a saved-tensor hook (architecture-exact, GELU variants included), then
scaled to the batch. The loss adds the logits (full or one chunk). Nothing model-sized is allocated.

With LoRA (`lora.r > 0`) the adapters are injected into the meta model: parameters count base + adapters, but
gradients and AdamW state only the adapters, and the block's saved activations are measured with the frozen
base (what autograd keeps differs: frozen weights need no inputs saved for their gradients). QLoRA
(`lora.quantize=nf4`) holds the blocks' linear weights in 4 bits plus their quantization constants.

Online RL (`train.objective` grpo, rloo) has a third phase, generation, between optimizer steps: the whole model
gathered at once, the KV cache of the rank's completions of a round and the sampling step's logits (see
`generation_bytes`); the peak is the largest of the three phases. Its micro-batches are rows as
shardlm.objectives.rl.step packs them (`rl_rows`). With `grpo.beta > 0` and no LoRA the frozen reference is one more
model, sharded as the policy.

Distillation (`train.objective=distill`) adds its frozen teacher and replaces the loss's rows by distill_loss's
chunks of both models' logits (shardlm.objectives.distill.memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from inspect import signature

import torch

from shardlm.config import Config
from shardlm.config.checks import ac_mode, wrap_size
from shardlm.distributed import context, tensor
from shardlm.distributed.checkpointing import SelectiveSaved, checkpointed
from shardlm.distributed.parallelize import DTYPES, STRATEGIES, compile_mode, fsdp_enabled, mesh_shape
from shardlm.distributed.wrapping import blocks_per_unit, owned_params, size_units
from shardlm.models import lora
from shardlm.models.causal_lm import auto_loss_chunk, num_params, transformer_blocks
from shardlm.models.hf_config import logit_transform, model_config
from shardlm.models.instantiate import empty_model
from shardlm.objectives import objective_family
from shardlm.objectives.base import Footprint
from shardlm.training.optim.optimizers import state_bytes_estimate

GB = 2**30
# bitsandbytes NF4 with double quantization: 4 bits a weight, an 8-bit scale per block of 64 weights and an fp32
# scale per 256 of those (the QLoRA paper's 4.127 bits per parameter)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass
class Estimate:
    parameters: int
    components: dict[str, float]  # bytes
    peak_bytes: float
    host: dict[str, float] = field(default_factory=dict)  # bytes in CPU RAM beside the device's peak (offload)
    notes: list[str] = field(default_factory=list)  # what is not device memory at the peak (a store on disk)

    def table(self) -> str:
        rows = [f"  {k:<48} {v / GB:8.3f} GiB" for k, v in self.components.items()]
        host = [f"  {'in CPU RAM: ' + k:<48} {v / GB:8.3f} GiB" for k, v in self.host.items()]
        return "\n".join([*rows, f"  {'estimated peak per rank':<48} {self.peak_bytes / GB:8.3f} GiB", *host,
                          *(f"  {n}" for n in self.notes)])


def four_bit_params(blocks: torch.nn.ModuleList) -> int:
    """Weights QLoRA holds in 4 bits: every linear layer of the blocks (not the adapters; the head stays fp32)."""
    from shardlm.models.lora import linear_types

    return sum(m.get_parameter("weight").numel() for block in blocks for n, m in block.named_modules()
               if issubclass(type(m), linear_types()) and ".lora_" not in f".{n}")


def torchao_nf4_bytes(blocks: torch.nn.ModuleList) -> float:
    """What QLoRA's torchao backend holds of the blocks' linears (shardlm.models.nf4: its groups of scales
    depend on each weight's size)."""
    from shardlm.models.lora import linear_types
    from shardlm.models.nf4 import bytes_per_weight

    sizes = [m.get_parameter("weight").numel() for block in blocks for n, m in block.named_modules()
             if issubclass(type(m), linear_types()) and ".lora_" not in f".{n}"]
    return sum(n * bytes_per_weight(n) for n in sizes)


def _device(cfg: Config) -> torch.device:
    return torch.device("cuda" if cfg.parallel.device != "cpu" and torch.cuda.is_available() else "cpu")


def _meta_model(cfg: Config, hf_cfg):
    model = empty_model(hf_cfg, "meta")
    if lora.enabled(cfg.lora):
        lora.apply(model, cfg.lora)
    return model


def block_saved_bytes_per_token(hf_cfg, dtype: torch.dtype, seq_len: int, cfg: Config | None = None,
                                selective: bool = False, masked: bool = False) -> float:
    """Bytes autograd keeps per token for one block at `seq_len` (weights excluded), measured on a real block
    at 32 and 64 tokens: per token it is a + b * seq_len, b > 0 where attention keeps (T x T) probabilities
    (eager attention, e.g. Gemma 2's soft-capped one; any attention given an explicit 4D mask, `masked`: SDPA
    then runs its math kernel, as online RL's rows that share a prompt do)."""
    meta = _meta_model(cfg, hf_cfg) if cfg is not None else empty_model(hf_cfg, "meta")
    block = transformer_blocks(meta)[0].to_empty(device="cpu")
    for p in block.parameters():
        with torch.no_grad():
            torch.nn.init.normal_(p, std=0.02)
    block.to(dtype).train()
    rotary = next((m for n, m in meta.named_modules() if n.endswith("rotary_emb")), None)
    small, large = (_saved_bytes(block, rotary, hf_cfg, dtype, t, selective, masked) / t for t in (32, 64))
    slope = max(0.0, (large - small) / 32)
    return small + slope * (seq_len - 32)


def _saved_bytes(block: torch.nn.Module, rotary, hf_cfg, dtype: torch.dtype, tokens: int, selective: bool,
                 masked: bool = False) -> float:
    """What autograd keeps of one block's forward; `selective`: what selective checkpointing keeps instead (its
    saved ops' outputs and the block's input)."""
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta" and t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(1, tokens, hf_cfg.hidden_size, dtype=dtype, requires_grad=True)
    kwargs = {}
    if rotary is not None:  # Llama-style blocks take the rotary (cos, sin) from the model
        positions = torch.arange(tokens).unsqueeze(0)
        # Gemma 3 keeps one rotary table per layer type (sliding / full attention)
        layer_type = {"layer_type": hf_cfg.layer_types[0]} if "layer_type" in signature(rotary.forward).parameters \
            else {}
        with torch.no_grad():
            kwargs = {"position_embeddings": type(rotary)(config=hf_cfg)(x, positions, **layer_type),
                      "position_ids": positions}
    if masked:
        kwargs["attention_mask"] = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
    if selective:
        with SelectiveSaved() as kept:
            block(x, **kwargs)
        return sum(kept.storages.values()) + x.untyped_storage().nbytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, **kwargs)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    return sum(saved.values())


def estimate(cfg: Config, tokenizer, world_size: int = 1, local_world_size: int | None = None) -> Estimate:
    whole_cfg = model_config(cfg, tokenizer)
    parameters = lora.count(_meta_model(cfg, whole_cfg))[1]
    # parallel.tensor: a rank's blocks are those of a model with 1/N of the heads and MLP width; counted (and a
    # block measured) on that model, every term below is per rank
    hf_cfg = tensor.local_config(whole_cfg, cfg.parallel.tensor)
    meta = _meta_model(cfg, hf_cfg)
    blocks = transformer_blocks(meta)
    trainable, total = lora.count(meta)
    # the largest block: a mixture of experts may keep dense blocks beside routed ones (DeepSeek's first layers)
    per_block = max(num_params(b) for b in blocks)
    per_block_trainable = max(num_params(b, trainable_only=True) for b in blocks)
    root = total - sum(num_params(b) for b in blocks)
    p = cfg.parallel
    use_fsdp = fsdp_enabled(cfg, world_size)
    reshard = STRATEGIES[p.sharding][1]
    shard = mesh_shape(cfg, world_size, local_world_size or world_size)[-1] if use_fsdp else 1  # ranks per copy
    compute = DTYPES[p.precision]
    csize = torch.finfo(compute).bits // 8
    B, T, C, V = cfg.train.batch_size, cfg.data.seq_len, hf_cfg.hidden_size, hf_cfg.vocab_size
    shared = False  # online RL's rows holding a prompt's group of completions under a 4D mask
    objective = objective_family(cfg.train.objective)
    B, T, shared = objective.memory_rows(cfg, hf_cfg)  # online RL: a prompt's group of completions in a row
    on_device = 0.0 if p.cpu_offload else 1.0
    comp: dict[str, float] = {}
    four_bit = four_bit_params(blocks) if lora.quantized(cfg.lora) else 0
    comp["parameters (fp32, sharded)"] = 4 * (total - four_bit) / shard * on_device
    if four_bit and lora.backend(cfg.lora, _device(cfg), use_fsdp) == "torchao":  # sharded like the rest
        comp["base linears (4-bit NF4, torchao, sharded)"] = torchao_nf4_bytes(blocks) / shard * \
            (on_device if shard > 1 else 1.0)  # a shard group of one rank holds them whole, on the device
    elif four_bit:
        comp["base linears (4-bit NF4, double quantization)"] = four_bit * NF4_BYTES
    label, state = state_bytes_estimate(cfg, meta, shard)  # the optimizer's own: AdamW 8 bytes, 8-bit ~2, ...
    comp[label if trainable == total else f"{label}; adapters"] = state * on_device
    if use_fsdp:  # gathered copies: root (embeddings) + the blocks held at once (all when not resharding)
        k = blocks_per_unit(p.wrap, blocks)  # units of k blocks: the one running and those prefetched
        held = len(blocks) if not reshard else min(len(blocks), k * (1 + max(1, p.prefetch)))
        both_fp32_whole = shard == 1 and compute == torch.float32  # the local shard is the whole tensor
        gathered = _held_by_units(cfg, meta, reshard) if wrap_size(p.wrap) else root + held * per_block
        comp["gathered parameters"] = 0.0 if both_fp32_whole else gathered * csize
    elif compute != torch.float32:
        comp["autocast weight copies"] = (total - four_bit) * csize  # 4-bit ones are dequantized per matmul
    # Step phases: forward/loss (activations + loss buffers live, gradients not yet) versus the end of
    # backward and the optimizer step (all gradients live, activations freed). The peak is the larger.
    per_token = block_saved_bytes_per_token(hf_cfg, compute, T, cfg=cfg, masked=shared)
    tokens = B * context.share(T, p.context)  # parallel.context: this rank's share of each row
    forward: dict[str, float] = {}
    host = activations(cfg, hf_cfg, len(blocks), per_token, tokens, compute, forward)
    forward["embeddings + final norm activations"] = tokens * C * csize * 3
    device = torch.device("cuda" if p.device != "cpu" and torch.cuda.is_available() else "cpu")
    if p.context > 1:
        forward["context: the split's mask, gathered keys/values"] = context.split_bytes(
            hf_cfg, B, T, p.context, csize, len(blocks), device.type)
    compiled = compile_mode(p.compile, device) == "model"
    transform = logit_transform(hf_cfg)
    full_logits = transform is not None or meta.get_output_embeddings() is None  # as CausalLM decides
    chunk = 0 if full_logits else auto_loss_chunk(cfg.train.loss_chunk_size, B, T, V, device, compiled=compiled,
                                                    itemsize=csize)
    if chunk:  # the head's weight gradient only where the head trains (LoRA freezes it)
        rows, head = min(chunk, tokens), meta.get_output_embeddings()
        head_grad = V * C * 4 if head is not None and head.weight.requires_grad else 0
        forward["loss: one chunk buffer + head/hidden grads"] = rows * V * (4 + (csize if csize != 4 else 0)) \
            + head_grad + tokens * C * csize
    elif compiled:  # inductor fuses log-softmax and its gradient: the logits and their gradient remain
        forward["loss: logits and their gradient (compiled)"] = tokens * V * 2 * csize
    else:
        forward["loss: logits, log-softmax, their gradients"] = tokens * V * (csize + 4 + 4)
    if transform and not compiled:  # soft-capping keeps its tanh output for the backward
        forward["loss: the transformed logits"] = tokens * V * csize
    head = meta.get_output_embeddings()
    terms = objective.memory(cfg, Footprint(
        hf_cfg, tokenizer, tokens, shard, csize, on_device, use_fsdp, chunk,
        (V, C, head is not None and head.weight.requires_grad), full_logits, len(blocks),
        initial_model=4 * (total - four_bit) / shard * on_device, gathered=comp.get("gathered parameters", 0.0),
        whole=(total - four_bit) * csize))
    comp.update(terms.resident)  # a frozen reference, a teacher
    if terms.loss is not None:  # the objective's own loss buffers replace the next-token loss's
        forward = {k: v for k, v in forward.items() if not k.startswith("loss")} | terms.loss
    grads = 4 * trainable / shard * on_device + (2 * per_block_trainable * 4 if use_fsdp and shard > 1 else 0)
    phase = forward if sum(forward.values()) >= grads else \
        {"gradients (fp32, sharded; peak at the optimizer step)": grads}
    if terms.phase is not None and sum(terms.phase.values()) > sum(phase.values()):  # online RL's generation
        phase = terms.phase
    comp.update(phase)
    comp["batch and framework overhead"] = tokens * 8 * 2 + 16 * 2**20
    peak = sum(comp.values())
    return Estimate(parameters, comp, peak, host, terms.notes)


def describe(cfg: Config, tokenizer, world_sizes: list[int]) -> str:
    one = lora.quantized(cfg.lora) and cfg.lora.quant_backend == "bitsandbytes"  # auto: each world size its own
    lines = ["QLoRA with bitsandbytes runs in one process on one GPU: estimated for 1 rank"] if one else []
    split_by = cfg.parallel.context * cfg.parallel.tensor
    if skipped := [w for w in world_sizes if w % split_by]:
        lines.append(f"not estimated: {', '.join(map(str, skipped))} rank(s), which parallel.context x parallel.tensor "
                     f"({split_by}) does not divide")
    for w in [1] if one else [w for w in world_sizes if not w % split_by]:
        est = estimate(cfg, tokenizer, w)
        split = f", context {cfg.parallel.context}" if cfg.parallel.context > 1 else ""
        split += f", tensor {cfg.parallel.tensor}" if cfg.parallel.tensor > 1 else ""
        lines.append(f"{cfg.parallel.sharding} x {w} rank(s){split}, batch {cfg.train.batch_size} x seq "
                     f"{cfg.data.seq_len}, "
                     f"{cfg.parallel.precision}, AC {cfg.parallel.activation_checkpointing}, "
                     + (f"wrap {cfg.parallel.wrap}, " if cfg.parallel.wrap not in ("auto", "block") else "") +
                     f"loss chunk {_chunk_name(cfg.train.loss_chunk_size)}; {est.parameters / 1e6:.1f}M parameters")
        lines.append(est.table())
    return "\n".join(lines)


def activations(cfg: Config, hf_cfg, n: int, per_token: float, tokens: int, compute: torch.dtype,
                forward: dict[str, float]) -> dict[str, float]:
    """The blocks' saved activations by parallel.activation_checkpointing, into `forward`; what offload keeps in
    CPU RAM is returned. A recomputed block holds its input; during its backward one block's forward is live
    again. `selective` keeps its saved ops' outputs, measured on one block as `per_token` is."""
    mode, _ = ac_mode(cfg.parallel.activation_checkpointing)
    wrapped = len(checkpointed(cfg.parallel.activation_checkpointing, n))
    boundary = hf_cfg.hidden_size * (torch.finfo(compute).bits // 8)  # a block's input, per token
    on_gpu = cfg.parallel.device != "cpu" and torch.cuda.is_available()
    if mode in ("full", "every"):
        forward[f"activations ({wrapped} checkpointed, {n - wrapped} whole blocks)"] = \
            tokens * (wrapped * boundary + (n - wrapped) * per_token + per_token)
    elif mode == "selective":
        kept = block_saved_bytes_per_token(hf_cfg, compute, cfg.data.seq_len, cfg=cfg, selective=True)
        forward["activations (selective: matmul outputs kept)"] = \
            tokens * (n * kept + per_token - kept)
    elif mode == "offload" and on_gpu:  # the block being computed and the one whose copy is in flight
        forward["activations (offload: 2 blocks on the device)"] = tokens * 2 * per_token
        return {"offloaded activations (pinned)": tokens * n * per_token}
    else:
        forward["activations"] = tokens * n * per_token
    return {}


def _held_by_units(cfg: Config, hf, reshard: bool) -> int:
    """parallel.wrap=size:N: the parameters gathered at once: the root's own and the two largest units (the one
    running and the next, FSDP2's implicit prefetch), or every unit without resharding."""
    p = cfg.parallel
    device = torch.device("cuda" if p.device != "cpu" and torch.cuda.is_available() else "cpu")
    names, _ = size_units(hf, wrap_size(p.wrap), compile_mode(p.compile, device) != "false")
    owned = owned_params(hf, names)
    sizes = sorted((owned[n] for n in names), reverse=True)
    return owned[""] + sum(sizes if not reshard else sizes[:2])


def _chunk_name(chunk: int | None) -> str:
    return "auto" if chunk is None else str(chunk or "off")

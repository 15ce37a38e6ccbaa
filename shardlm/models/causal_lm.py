"""`CausalLM`: a Hugging Face causal LM (GPT-2 by default) with a memory-lean loss, the module FSDP shards.

Running the loss inside the module means the tied lm_head/wte weight is unsharded exactly while the loss needs
it. Its entry points return one thing each: `forward` the token loss, `sequence_logps` the summed
log-probabilities of whole sequences (preference pairs), `completion_logps` the per-token log-probabilities of
sampled completions (online RL), `distill` the distillation loss to a teacher and `teacher_view` what a teacher
gives it. Its HF config is built in `hf_config`, its weights loaded in `instantiate`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardlm import ShardlmError
from shardlm.models.attention import CAUSAL_SDPA, one_sequence_per_row
from shardlm.models.distill_loss import LiveTeacher, TopKTeacher, distill_loss
from shardlm.models.hf_config import logit_transform
from shardlm.models.loss import IGNORE, linear_cross_entropy, logits_cross_entropy
from shardlm.models.moe import router_objective


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

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of token losses and count of correct next-token predictions (targets -100 are ignored).
        `positions` restarting at 0 mark packed examples: transformers keeps attention inside each one."""
        routed = self.router is not None and self.training
        out = self._body(tokens, positions, routed)
        if self.full_logits:
            logits = out.logits if self.training or not self.vocab else out.logits[..., :self.vocab]
            loss = logits_cross_entropy(logits.flatten(0, 1), targets.flatten(), with_accuracy=not self.training)
        else:
            hidden, kept = at_targets(positions, targets, out.last_hidden_state, targets)
            weight, bias = self._head()
            if self.vocab and not self.training:  # the exported model's logits: real tokens only
                weight, bias = weight[:self.vocab], None if bias is None else bias[:self.vocab]
            loss = self.loss_fn(hidden, weight, kept, self.loss_chunk_size, bias=bias, with_accuracy=not self.training)
        return self._with_router_loss(loss, out, targets) if routed else loss

    def sequence_logps(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
                       segments: torch.Tensor, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed log-probability of the targets of each of `sequences` sequences, and their target counts
        (fp32, like the loss); `segments` holds each position's sequence (preference pairs: 2 x pair + side).

        A forward of its own: nn.Module's hooks see `forward` alone, so parallelize registers this one with
        FSDP2 (its gathers) and compiles it beside forward, and `before_every_forward` hooks both."""
        out = self._body(tokens, positions)
        if self.full_logits:
            return sequence_sums(out.logits.flatten(0, 1), targets.flatten(), segments.flatten(), sequences)
        hidden, kept, seg = at_targets(positions, targets, out.last_hidden_state, targets, segments)
        weight, bias = self._head()
        return sequence_sums(F.linear(hidden, weight, bias), kept, seg, sequences)

    def completion_logps(self, tokens: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                         temperature: float = 1.0, with_entropy: bool = False, mask: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each target's log-probability (fp32, in the order of `targets != -100` read row by row) at the sampling
        `temperature` (logits divided by it first, as the sampler drew them), and the entropy of each target's
        distribution (no gradient) if asked: online RL's policy, old and reference scores of its completions.

        The head runs on the targets alone, in chunks whose logits are recomputed in backward
        (`target_logps`): no (tokens x vocab) logits are kept. A forward of its own, registered with FSDP2 as
        `sequence_logps` is. `mask`: a (rows, 1, T, T) boolean attention mask (True: attend) for rows that share a
        prompt among several completions (shardlm.objectives.rl.step), for the SDPA families `shares_prefix` names."""
        out = self._body(tokens, positions, mask=mask)
        scale = 1.0 / temperature if temperature > 0 else 1.0
        if self.full_logits:  # the padding vocabulary left out: the sampler never draws it
            keep = (targets.flatten() != IGNORE).nonzero().squeeze(1)
            logits = out.logits[..., :self.vocab or None].flatten(0, 1).index_select(0, keep).float() * scale
            picked = targets.flatten().index_select(0, keep)
            logps = logits.log_softmax(-1)
            entropy = -(logps.exp() * logps).sum(-1).detach() if with_entropy else None
            return logps.gather(1, picked[:, None]).squeeze(1), entropy
        if positions is None:  # at_targets selects the targets only when positions are given
            raise ValueError("completion_logps needs the rows' positions")
        hidden, kept = at_targets(positions, targets, out.last_hidden_state, targets)
        weight, bias = self._head()
        if self.vocab:
            weight, bias = weight[:self.vocab], None if bias is None else bias[:self.vocab]
        chunk = self.loss_chunk_size or 1024
        return target_logps(hidden, weight, bias, kept, scale, chunk, with_entropy)

    def distill(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
                teacher: LiveTeacher | TopKTeacher, *, beta: float, temperature: float, alpha: float,
                vocab: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Distillation's loss sum of the targets and its parts' sums (shardlm.models.distill_loss), the head used
        inside this forward as `forward` uses it (under FSDP2 gathered exactly while the loss needs it). `teacher`
        holds one row per target, read row by row (`teacher_view`'s, or stored top-K scores). A forward of its own,
        registered with FSDP2 as `sequence_logps` is."""
        if self.full_logits:
            raise ShardlmError(f"{self.hf.config.model_type} computes its logits in its own forward (a logit "
                               "transform, or no head to take), which distillation's chunked loss does not apply: "
                               "distill into a family without one (GPT-2, Llama, Qwen, Mistral, ...).")
        hidden, kept = valid_targets(targets, self._body(tokens, positions).last_hidden_state)
        weight, bias = self._head()
        return distill_loss(hidden, weight, bias, kept, teacher, beta=beta, temperature=temperature, alpha=alpha,
                            vocab=vocab, chunk_size=self.loss_chunk_size)

    @torch.no_grad()
    def teacher_view(self, tokens: torch.Tensor, targets: torch.Tensor,
                     positions: torch.Tensor | None) -> LiveTeacher:
        """What a student's `distill` needs of this model as its teacher: the final hidden states at the targets (row
        by row) and the head. Under FSDP2 the head is copied out of the gathered root (gathered once per call, not
        per chunk of the loss): the gathered weights are freed when the forward's unit reshards."""
        if self.full_logits:
            raise ShardlmError(f"the teacher's family ({self.hf.config.model_type}) computes its logits in its own "
                               "forward (a logit transform, or no head to take), which distillation's chunked loss "
                               "does not apply: use a teacher of a family without one.")
        hidden, _ = valid_targets(targets, self._body(tokens, positions).last_hidden_state)
        weight, bias = self._head()
        copy = isinstance(self, FSDPModule)
        return LiveTeacher(hidden, weight.detach().clone() if copy else weight.detach(),
                           None if bias is None else bias.detach().clone() if copy else bias.detach())

    def _body(self, tokens: torch.Tensor, positions: torch.Tensor | None, routed: bool = False,
              mask: torch.Tensor | None = None) -> Any:
        """The HF model's outputs: its logits where the family transforms them (or has no head to take), else
        the body's last hidden state for shardlm's own head and loss."""
        kwargs: dict = {} if positions is None else {"position_ids": positions}
        if mask is not None:  # 4D: transformers takes it as is, and builds no mask of its own
            kwargs["attention_mask"] = mask
        if routed:
            kwargs = {**kwargs, "output_router_logits": True}
        body = self.hf if self.full_logits else self.hf.base_model
        with one_sequence_per_row(positions is None):  # the model call only: a graph break inside a
            return body(input_ids=tokens, use_cache=False, **kwargs)  # context manager drops the frame

    def _head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.hf.get_output_embeddings()
        return head.weight, getattr(head, "bias", None)

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


def at_targets(positions: torch.Tensor | None, targets: torch.Tensor,
               *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` with their (batch, position) dimensions flattened; for examples (`positions` given) only at the
    targets: most positions are prompts or padding, and the head and loss then run on the targets alone (the
    same sums; eager only, as the count is data-dependent)."""
    flat = [t.flatten(0, 1) for t in tensors]
    if positions is None or torch.compiler.is_compiling():
        return tuple(flat)
    keep = (targets.flatten() != IGNORE).nonzero().squeeze(1)
    return tuple(t.index_select(0, keep) for t in flat)


def valid_targets(targets: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden rows, targets) at the targets != -100 alone, row by row, on text as on examples: a teacher's rows and
    stored top-K scores are addressed in this order, so both models must select the same positions."""
    keep = (targets.flatten() != IGNORE).nonzero().squeeze(1)
    return hidden.flatten(0, 1).index_select(0, keep), targets.flatten().index_select(0, keep)


def sequence_sums(logits: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor,
                  sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's targets, their counts), in fp32 like the loss."""
    valid = targets != IGNORE
    token_logps = -F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="none")
    index = torch.where(valid, segments, sequences)  # non-targets go to a spare slot, dropped
    sums = torch.zeros(sequences + 1, device=logits.device, dtype=torch.float32).index_add(0, index, token_logps)
    counts = torch.zeros(sequences + 1, device=logits.device, dtype=torch.float32).index_add(0, index, valid.float())
    return sums[:sequences], counts[:sequences]


class _TargetLogps(torch.autograd.Function):
    """Log-probabilities of targets through the head, chunk by chunk; the backward recomputes each chunk's logits
    (one matmul more than keeping them) instead of holding (targets x vocab) fp32 logits from forward to backward.
    d logp / d z = onehot(target) - softmax(z), times the temperature's scale."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, chunk, with_entropy):
        w = weight.to(hidden.dtype)
        b = None if bias is None else bias.to(hidden.dtype)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(hidden.shape[0] if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            z = F.linear(hidden[s:s + chunk], w, b).float() * scale
            lse = z.logsumexp(-1)
            out[s:s + chunk] = z.gather(1, targets[s:s + chunk, None]).squeeze(1) - lse
            if with_entropy:  # H = lse - sum p z, from the logits at hand: one more chunk-sized tensor, no matmul
                entropy[s:s + chunk] = lse - (z - lse[:, None]).exp_().mul_(z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.mark_non_differentiable(entropy)  # a statistic
        return out, entropy

    @staticmethod
    def backward(ctx, grad, _grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        w = weight.to(hidden.dtype)
        b = None if bias is None else bias.to(hidden.dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if need_b and bias is not None else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h, g = hidden[s:s + ctx.chunk], grad[s:s + ctx.chunk].float()
            z = F.linear(h, w, b).float() * ctx.scale
            dz = z.softmax(-1).mul_(-g[:, None])
            dz[torch.arange(len(g), device=g.device), targets[s:s + ctx.chunk]] += g
            dz.mul_(ctx.scale)
            if grad_h is not None:
                grad_h[s:s + ctx.chunk] = (dz.to(h.dtype) @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w += dz.t() @ h.float()
            if grad_b is not None:
                grad_b += dz.sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


SHARED_PREFIX_FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "gpt_neox")


def shares_prefix(model: CausalLM) -> bool:
    """Whether completions of one prompt can share its tokens in one row under a 4D mask (`completion_logps`): SDPA
    families that take such a mask as the whole mask (no sliding window to apply, positions from position_ids)."""
    cfg = model.hf.config
    return (getattr(cfg, "model_type", None) in SHARED_PREFIX_FAMILIES and getattr(cfg, "_attn_implementation", None)
            in ("sdpa", CAUSAL_SDPA) and not (getattr(cfg, "use_sliding_window", False)
                                            and getattr(cfg, "sliding_window", None)) and model.router is None)


def target_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 scale: float = 1.0, chunk: int = 1024, with_entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(scale x (hidden W^T + b)) at `targets`, each row's entropy or None): fp32, one chunk's logits at
    a time. The entropy is a statistic (no gradient), taken from the same chunk's logits."""
    logps, entropy = _TargetLogps.apply(hidden, weight, bias, targets, scale, max(1, chunk), with_entropy)
    return logps, (entropy if with_entropy else None)


# CausalLM's forwards besides `forward`: parallelize registers them with FSDP2, before_every_forward hooks them
FORWARDS = ("sequence_logps", "completion_logps", "distill", "teacher_view")


def before_every_forward(model: nn.Module, hook: Callable[[nn.Module, tuple], None]) -> None:
    """`hook(model, args)` first thing in each of the model's forwards (`forward`, `sequence_logps`,
    `completion_logps`), ahead of FSDP2's gathers: nn.Module's forward pre-hooks see `forward` alone. Call it after
    parallelize."""
    model.register_forward_pre_hook(hook, prepend=True)
    for name in FORWARDS:
        method = getattr(model, name, None)
        if method is not None:
            setattr(model, name, _hooked(model, method, hook))


def _hooked(model: nn.Module, method: Callable, hook: Callable[[nn.Module, tuple], None]) -> Callable:
    @functools.wraps(method)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        hook(model, args)
        return method(*args, **kwargs)

    return hooked


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

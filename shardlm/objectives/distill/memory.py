"""What `train.objective=distill` adds to `shardlm estimate`: the teacher and the distillation loss's chunks.

The teacher (distill.teacher) is built as the student is, so it is counted as the student's parameters
are: fp32, sharded over the same ranks, gathered a unit at a time in parallel.precision, and holds no gradients
or optimizer state. It runs under no_grad before the student's forward, so of its activations only its final
hidden states at the targets stay live through the student's step (one layer's working set during its own
forward, smaller than the student's saved activations), plus its head copied out of FSDP2's gather. The loss
(shardlm.models.distill_loss) holds, per chunk of positions, both models' (rows x vocab) fp32 logits and the
divergence's temporaries, and keeps its closed-form gradients (hidden states, head) until the backward.
With distill.teacher_topk=K the teacher is let go once it has scored the data: training holds the stored
scores of a micro-batch only, and the store takes 8 K bytes a scored target on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.config import Config

# (rows x vocab) fp32 tensors live together in a chunk of distill_loss: the student's logits (then its gradient),
# the tempered log-probabilities of both models, the student's probabilities, and the divergence's mixture, gap
# and one temporary; measured on CPU within the test's 15%
CHUNK_TENSORS = 8


@dataclass
class DistillMemory:
    resident: dict[str, float] = field(default_factory=dict)  # held through the step
    loss: dict[str, float] = field(default_factory=dict)  # replaces the next-token loss's rows
    notes: list[str] = field(default_factory=list)


def teacher_config_of(cfg: Config):
    """The teacher's HF config, read as the run reads it (no weights loaded)."""
    from shardlm.objectives.distill.teacher import teacher_hf_config, teacher_source, teacher_tokenizer

    src = teacher_source(cfg.distill.teacher)
    return teacher_hf_config(cfg, src, teacher_tokenizer(src, cfg.model.trust_remote_code))


def distill_memory(cfg: Config, tokens: int, shard: int, csize: int, on_device: float, use_fsdp: bool,
                   chunk: int, student_head: tuple[int, int, bool], tokenizer) -> DistillMemory:
    """`tokens` of a micro-batch (every one a target at most), `chunk` the loss's rows at a time (0: whole
    logits), student_head (vocab rows, hidden, trains)."""
    from shardlm.models.causal_lm import num_params, transformer_blocks
    from shardlm.models.instantiate import empty_model

    out = DistillMemory()
    d = cfg.distill
    V, Hs, head_trains = student_head
    vocab = len(tokenizer)
    if d.teacher_topk:
        k = d.teacher_topk
        out.resident["teacher: a micro-batch's top-K scores"] = tokens * k * 12.0
        out.notes.append(f"on disk: the teacher's top-{k} scores, {8 * k} bytes a scored target "
                         f"({8 * k * 1e6 / 2**30:.2f} GiB per million targets), beside the example cache; the "
                         "teacher is held only while it scores the data before the first step")
        rows = min(chunk, tokens) if chunk else tokens
        out.loss[f"loss: a chunk of logits, top-{k} divergence"] = rows * V * 4 * (CHUNK_TENSORS - 2) \
            + (V * Hs * 4 if head_trains else 0) + tokens * Hs * csize
        return out
    hf_t = teacher_config_of(cfg)
    meta = empty_model(hf_t, "meta")
    total, blocks = num_params(meta), transformer_blocks(meta)
    per_block = max(num_params(b) for b in blocks)
    root = total - sum(num_params(b) for b in blocks)
    Ht = hf_t.hidden_size
    out.resident["teacher (fp32, sharded, frozen: no grads/state)"] = 4 * total / shard * on_device
    if use_fsdp and not (shard == 1 and csize == 4):
        out.resident["teacher: its head copied out of the gather"] = hf_t.vocab_size * Ht * csize
    out.loss["teacher: final hidden states at the targets"] = tokens * Ht * csize
    rows = min(chunk, tokens) if chunk else tokens
    grads = (V * Hs * 4 if head_trains else 0) + tokens * Hs * csize
    if chunk:
        out.loss["loss: a chunk of both models' logits + grads"] = rows * (V + vocab * (CHUNK_TENSORS - 1)) * 4 \
            + grads
    else:  # the reference: whole logits of both models through autograd
        out.loss["loss: both models' whole logits (autograd)"] = tokens * (V * (csize + 8) + vocab * 4 * 10)
    if use_fsdp:
        out.notes.append(f"the teacher's forward gathers its root and a block at a time, "
                         f"{(root + per_block) * csize / 2**30:.3f} GiB, before the student's step")
    return out

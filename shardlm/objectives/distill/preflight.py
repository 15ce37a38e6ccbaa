"""Distillation before the run: the dry run's lines on the teacher (found, its tokenizer checked against the
student's, its config read and its parameters counted on `meta`, no weights loaded) and on the loss's settings,
and the checks the run makes of a live teacher, here before it is built."""

from __future__ import annotations

from typing import Any

from shardlm import ShardlmError
from shardlm.config import Config
from shardlm.models.hf_config import logit_transform


def full_logits(model: Any) -> bool:
    """Whether the family computes its logits in its own forward (a logit transform, or no head to take): as
    shardlm.models.causal_lm.CausalLM decides, on a model of any device (`meta` in the dry run)."""
    return logit_transform(model.config) is not None or model.get_output_embeddings() is None


def check_live_teacher(family: str, transforms: bool) -> None:
    """A live teacher lends its hidden states and head to the student's chunked loss, which applies no logit
    transform: such a teacher is refused before the run (its top-K scores, taken from its own logits, are not)."""
    if transforms:
        raise ShardlmError(f"the teacher's family ({family}) computes its logits in its own forward (a logit "
                           "transform, or no head to take), which distillation's chunked loss does not apply: set "
                           "distill.teacher_topk=K (its top-K scores are taken from its own logits), or use a "
                           "teacher of a family without one.")


def check_teacher_family(cfg: Config) -> None:
    """A live teacher's family read from its config (no weights loaded), refused where it transforms its logits;
    a hub name the Hub cannot give offline is left to the run, which fails on it in one line anyway."""
    from shardlm.models.instantiate import empty_model
    from shardlm.objectives.distill.memory import teacher_config_of

    try:
        hf_cfg = teacher_config_of(cfg)
    except ShardlmError:  # a teacher that does not load: named when it is built, with the run's own message
        return
    check_live_teacher(hf_cfg.model_type, full_logits(empty_model(hf_cfg, "meta")))


def teacher_lines(cfg: Config, tokenizer: Any) -> list[str]:
    """train.objective=distill: the teacher found, its tokenizer checked against the student's and its config read
    (parameters counted on `meta`, no weights loaded) by the run's own functions, and the loss's settings."""
    from shardlm.hub import hub_reachable
    from shardlm.models.causal_lm import num_params
    from shardlm.models.instantiate import empty_model
    from shardlm.objectives.distill.teacher import (
        check_teacher_tokenizer,
        teacher_hf_config,
        teacher_source,
        teacher_tokenizer,
    )

    d = cfg.distill
    src = teacher_source(d.teacher)
    try:
        teacher_tok = teacher_tokenizer(src, cfg.model.trust_remote_code)
    except ShardlmError as e:
        if src.checkpoint is None and "cannot be reached" in str(e) and not hub_reachable():
            return [f"teacher: {src.describe()}; not checked: a hub name the Hub cannot give offline (it downloads "
                    "when online)", _loss_line(cfg)]
        raise
    if tokenizer is not None:
        check_teacher_tokenizer(tokenizer, src, teacher_tok=teacher_tok)
    hf_cfg = teacher_hf_config(cfg, src, teacher_tok)
    meta = empty_model(hf_cfg, "meta")
    if d.teacher_topk == 0:
        check_live_teacher(hf_cfg.model_type, full_logits(meta))
    n = num_params(meta)
    shared = "the student's tokenizer" if tokenizer is not None else "its tokenizer not compared (the student's " \
        "cannot be reached)"
    return [f"teacher: {src.describe()}, {n / 1e6:.2f}M parameters, {hf_cfg.num_hidden_layers} layers "
            f"({hf_cfg.model_type}), vocabulary {len(teacher_tok)} tokens ({hf_cfg.vocab_size} head rows); {shared}; "
            "frozen, sharded as the student", _loss_line(cfg)]


def _loss_line(cfg: Config) -> str:
    d = cfg.distill
    kind = "forward KL(teacher||student)" if d.beta == 0 else "reverse KL(student||teacher)" if d.beta == 1 else \
        "generalized JSD"
    mix = "distillation alone" if d.alpha == 1 else f"{d.alpha:g} x distillation + {1 - d.alpha:g} x next-token loss"
    scores = f"the teacher's top-{d.teacher_topk} log-probs stored once before the first step" \
        if d.teacher_topk else "the live teacher each step"
    policy = f"; on-policy on {d.on_policy:.0%} of the steps (completions of up to {d.max_new_tokens} tokens at " \
        f"sample_temperature {d.sample_temperature:g})" if d.on_policy else "; off-policy (the data's answers)"
    return f"distill: beta {d.beta:g} ({kind}), temperature {d.temperature:g}, alpha {d.alpha:g} ({mix}); " \
        f"{scores}{policy}"


def check_teacher_resume(cfg: Config, resumed: Any, on_main: Any) -> None:
    """A resume names the run's teacher: the checkpoint's `teacher_key` against the one distill.teacher has now,
    refused before anything is written (the run refuses it again when it loads its state)."""
    import json

    from shardlm.checkpoint import layout
    from shardlm.objectives.distill.teacher import (
        former_key,
        identity_key,
        teacher_changed,
        teacher_identity,
        teacher_source,
    )

    def keys() -> str:
        state_file = resumed / layout.TRAINER_STATE
        saved = json.loads(state_file.read_text()).get("teacher_key") if state_file.is_file() else None
        if saved is None:
            return json.dumps([None, None, None])
        src = teacher_source(cfg.distill.teacher)
        identity = teacher_identity(src)
        return json.dumps([saved, identity_key(identity), former_key(src, identity)])

    saved, now, former = json.loads(on_main(keys))
    if saved is not None and saved not in (now, former):
        raise teacher_changed(cfg, saved, now)

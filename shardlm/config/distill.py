"""Checks of the `distill:` section for train.objective distill, before anything is loaded: ranges, the teacher
being named, and the combinations that cannot work (on-policy samples need prompts; stored top-K scores cannot
cover completions sampled during training). The teacher itself (loads, shares the tokenizer) is checked where it is
loaded (shardlm.objectives.distill.teacher)."""

from __future__ import annotations

from shardlm import ShardlmError
from shardlm.config.schema import Config


def _within(name: str, value: float, ok: bool, want: str) -> None:
    if not ok:
        raise ShardlmError(f"{name} must be {want}, got {value}.")


def check_distill(cfg: Config) -> None:
    d = cfg.distill
    _within("distill.beta", d.beta, 0.0 <= d.beta <= 1.0,
            "in [0, 1] (0 = forward KL(teacher||student), 1 = reverse KL, between = generalized JSD)")
    _within("distill.temperature", d.temperature, d.temperature > 0, "> 0 (1 = the models' own distributions)")
    _within("distill.alpha", d.alpha, 0.0 <= d.alpha <= 1.0,
            "in [0, 1] (1 = distillation alone, 0 = the next-token loss alone)")
    _within("distill.teacher_topk", d.teacher_topk, d.teacher_topk >= 0, ">= 0 (0 = the live teacher each step)")
    _within("distill.on_policy", d.on_policy, 0.0 <= d.on_policy <= 1.0,
            "in [0, 1] (the share of steps on the student's own completions; 0 = off)")
    if not d.teacher:
        raise ShardlmError("train.objective=distill needs a teacher: set distill.teacher to an HF model folder, a hub "
                           "name, a shardlm run folder or an export sharing the student's tokenizer.")
    if cfg.data.format == "preference":
        raise ShardlmError("train.objective=distill trains on text or examples, not preference pairs "
                           "(data.format=preference): use prompt/completion or chat data, or train.objective=dpo.")
    if d.on_policy > 0:
        if cfg.data.format == "text":
            raise ShardlmError(f"distill.on_policy={d.on_policy} samples the student's answers to prompts, and "
                               "data.format=text has none: use examples (prompt/completion or chat), or set "
                               "distill.on_policy=0.")
        if d.teacher_topk > 0:
            raise ShardlmError(f"distill.teacher_topk={d.teacher_topk} stores the teacher's scores of the data once, "
                               f"and cannot cover the completions distill.on_policy={d.on_policy} samples during "
                               "training: set distill.teacher_topk=0 (the live teacher) or distill.on_policy=0.")
        _within("distill.max_new_tokens", d.max_new_tokens, d.max_new_tokens >= 1, ">= 1")
        if d.max_new_tokens >= cfg.data.seq_len:
            raise ShardlmError(f"distill.max_new_tokens={d.max_new_tokens} leaves no room for a prompt in "
                               f"data.seq_len={cfg.data.seq_len} (prompt + completion): raise data.seq_len or "
                               "lower distill.max_new_tokens.")
        _within("distill.sample_temperature", d.sample_temperature, d.sample_temperature > 0,
                "> 0 (1 = the student's own distribution)")

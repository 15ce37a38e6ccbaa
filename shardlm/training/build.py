"""Everything a run needs, built in the order of the design: dist -> tokenizer -> data -> model ->
parallelize -> weights -> optimizer. `build()` returns them; the Trainer only runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardlm.config import Config
from shardlm.data import Split
from shardlm.distributed import context, tensor
from shardlm.distributed import process_group as dist_mod
from shardlm.distributed.parallelize import Plan, parallelize, plan
from shardlm.distributed.process_group import Dist
from shardlm.models import lora, nf4
from shardlm.models.causal_lm import CausalLM, auto_loss_chunk
from shardlm.models.hf_config import model_config
from shardlm.models.instantiate import empty_model, initial_model
from shardlm.models.state_keys import from_hf, hf_name, is_hf
from shardlm.objectives import objective_family
from shardlm.tokenizer import model_tokenizer
from shardlm.training import checks
from shardlm.training.optim import optimizers
from shardlm.training.schedule import Schedule, make_schedule

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

Weights = Callable[[], nn.Module]  # a model's starting weights as a CPU HF model (rank 0's, under FSDP2)


@dataclass
class Run:
    cfg: Config
    dist: Dist
    plan: Plan
    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    model: CausalLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train: Split  # TokenBlocks of one source, MixtureBlocks of a list data.train, PromptRows for grpo/rloo
    val: Split
    total_steps: int
    out_dir: Path


def init_dist(cfg: Config) -> tuple[Dist, Plan]:
    """Detect the launch, choose the device, check the plan is feasible, then start the process group."""
    info = dist_mod.detect_launch(launcher=cfg.parallel.launcher)
    device = dist_mod.pick_device(cfg.parallel.device, info.local_rank)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls on Ampere and newer
    pl = plan(cfg, info.world_size, info.local_world_size, device)
    d = dist_mod.init(info, device, cfg.parallel.timeout_s, force_group=pl.use_fsdp)
    context.attach(d, cfg)
    return d, pl


def materialize(model: CausalLM, cfg: Config, hf_cfg, dist: Dist, weights: Weights | None = None) -> None:
    """Sharded model on meta -> allocate this rank's shards -> rank 0's weights broadcast into them.

    Random init must happen on one rank: DTensor random ops on a CPU mesh draw the same values on
    every rank, so a local init would give wrong shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device="cpu" if cfg.parallel.cpu_offload else dist.device)
    reference = (weights() if weights else _initial_hf(cfg, hf_cfg)) if dist.is_main else None
    full = from_hf(reference.state_dict()) if reference is not None else {}
    four_bit = nf4.split_off(model, full)  # QLoRA (torchao): its 4-bit weights load apart, quantized whole on rank 0
    # GPT-2's q|k|v split by heads (a strided shard): torch's loading slices it as a plain one (2.13) or fails
    # (2.9), so it is placed on its own
    keys = tensor.strided_keys(model) if cfg.parallel.tensor > 1 else []
    strided = {k: full.pop(k) for k in keys if k in full}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=not four_bit and not keys))
    if keys:
        tensor.place_strided(model, strided)
    nf4.load_sharded(model, four_bit, dist)
    for name, buf in model.named_buffers():  # non-persistent buffers (e.g. rotary tables) are not in the dict
        if not is_hf(name):  # shardlm's own (a router's statistics): they start at zero
            buf.zero_()
            continue
        if reference is not None:
            buf.copy_(reference.get_buffer(hf_name(name)))
        if dist.distributed:
            torch.distributed.broadcast(buf, src=0)


def _initial_hf(cfg: Config, hf_cfg, device: torch.device | None = None) -> nn.Module:
    """The starting HF model on CPU: pretrained or seeded random weights, plus LoRA adapters (seeded) if on.
    QLoRA: bitsandbytes' 4-bit base is loaded straight onto `device` (it quantizes as it loads); torchao's is
    quantized here in one process, and by materialize (`device` None: FSDP2's reference) from full precision."""
    backend = lora.backend(cfg.lora, device, sharded=device is None)
    if backend == "bitsandbytes":
        assert device is not None
        hf = lora.quantized_base(cfg, hf_cfg, device)
    else:
        hf = initial_model(cfg, hf_cfg, cfg.train.seed)
    if backend == "torchao" and device is None:
        nf4.as_linears(hf)
    elif backend == "torchao":
        nf4.quantize(hf)
    return lora.apply(hf, cfg.lora, seed=cfg.train.seed) if lora.enabled(cfg.lora) else hf


def build_model(cfg: Config, hf_cfg, pl: Plan, dist: Dist, weights: Weights | None = None) -> CausalLM:
    """With `lora.r > 0` the adapters are injected before parallelize (see shardlm.models.lora): only they train.
    `weights`: the CPU model to start from where model.name cannot give it (a distillation teacher's checkpoint)."""
    chunk = auto_loss_chunk(cfg.train.loss_chunk_size, cfg.train.batch_size, cfg.data.seq_len, hf_cfg.vocab_size,
                            dist.device, compiled=pl.compile == "model", itemsize=pl.dtype.itemsize)
    if pl.use_fsdp:
        hf = empty_model(hf_cfg, "meta")
        if lora.backend(cfg.lora, dist.device, sharded=True) == "torchao":  # 4-bit on meta; materialize fills them
            nf4.quantize(hf, mesh=pl.mesh_shape)
        model = CausalLM(lora.apply(hf, cfg.lora) if lora.enabled(cfg.lora) else hf, chunk)
        parallelize(model, cfg, pl, dist)
        materialize(model, cfg, hf_cfg, dist, weights)
    else:
        model = CausalLM(weights() if weights else _initial_hf(cfg, hf_cfg, dist.device), chunk)
        if dist.device.type != "xla" and lora.backend(cfg.lora, dist.device) != "bitsandbytes":  # xla moves its own
            model.to(dist.device)
        parallelize(model, cfg, pl, dist)
    return model


def build_optimizer(model: nn.Module, cfg: Config, total_steps: int):
    """The optimizer of train.optimizer (shardlm.training.optim) and the LambdaLR of train.schedule over
    `total_steps`. AdamW, the default, is the fused torch AdamW on the local shards, as it always was."""
    optimizer = optimizers.build_optimizer(model, cfg)
    schedule = make_schedule(cfg.train, total_steps, optimizers.optimizer_name(cfg.train.optimizer))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def describe_optimizer(run: Run) -> str:
    """The run header's line: optimizer, its parameter groups (tensors, parameters, peak lr) and the schedule."""
    schedule = next((f for f in run.scheduler.lr_lambdas if isinstance(f, Schedule)), None)
    return optimizers.describe(run.optimizer, schedule.describe() if schedule is not None else None)


def load_data(cfg: Config, tokenizer, dist: Dist) -> tuple[Split, Split]:
    """The training and validation splits the objective reads: prompts for online RL (what is sampled from), else
    blocks of text or examples."""
    return objective_family(cfg.train.objective).load_data(cfg, tokenizer, dist)


def build(cfg: Config) -> Run:
    """The run's checks (shardlm.training.checks, the list `--dry-run` runs too) come before the work they guard:
    those that need no data (out_dir, the tokenizer, the model's config against data.seq_len) before tokenizing,
    so a config that can never work fails in seconds, not after the cache is built; all of them before the model
    is built or anything written."""
    d, pl = init_dist(cfg)
    out, resumed = checks.check_setup(cfg, pl, d.device, d.run_on_main)
    tokenizer = model_tokenizer(cfg.model)
    hf_cfg = model_config(cfg, tokenizer)
    context.check_model(hf_cfg, cfg)
    train, val = load_data(cfg, tokenizer, d)
    total = checks.check_data(cfg, hf_cfg, train, val, d.data_parallel, d.print)
    checks.check_resume(cfg, hf_cfg, train, val, resumed, d.run_on_main)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, hf_cfg, pl, d)
    optimizer, scheduler = build_optimizer(model, cfg, total)
    return Run(cfg, d, pl, tokenizer, hf_cfg, model, optimizer, scheduler, train, val, total, out)

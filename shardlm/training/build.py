"""Everything a run needs, built in the order of the design: dist -> tokenizer -> data -> model ->
parallelize -> weights -> optimizer. `build()` returns them; the Trainer only runs them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.config import Config
from shardlm.data import Blocks, describe, prepare_data
from shardlm.distributed import process_group as dist_mod
from shardlm.distributed.parallelize import Plan, parallelize, plan
from shardlm.distributed.process_group import Dist
from shardlm.models import lora
from shardlm.models.causal_lm import CausalLM, auto_loss_chunk
from shardlm.models.hf_config import check_packing, model_config
from shardlm.models.instantiate import empty_model, initial_model
from shardlm.models.state_keys import from_hf, hf_name, is_hf
from shardlm.tokenizer import model_tokenizer
from shardlm.training.optim import optimizers
from shardlm.training.preference import check_objective
from shardlm.training.schedule import Schedule, check_schedule, make_schedule

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


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
    train: Blocks  # TokenBlocks of one source, MixtureBlocks of a list data.train
    val: Blocks
    total_steps: int
    out_dir: Path


def check_out_dir(path: str) -> Path:
    """`out_dir` as a Path, checked but not created: a command that fails before training leaves nothing
    behind (the folder is made by the first thing a run writes)."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise ShardlmError(f"out_dir '{out}' is a file, not a folder. Choose another out_dir.")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ShardlmError(f"cannot create out_dir '{out}': '{existing}' is a file. Choose another out_dir.")
    if not os.access(existing, os.W_OK):
        raise ShardlmError(f"out_dir '{out}' is not writable ('{existing}' is not). Choose a writable out_dir.")
    return out


def init_dist(cfg: Config) -> tuple[Dist, Plan]:
    """Detect the launch, choose the device, check the plan is feasible, then start the process group."""
    info = dist_mod.detect_launch(launcher=cfg.parallel.launcher)
    device = dist_mod.pick_device(cfg.parallel.device, info.local_rank)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls on Ampere and newer
    pl = plan(cfg, info.world_size, info.local_world_size, device)
    d = dist_mod.init(info, device, cfg.parallel.timeout_s, force_group=pl.use_fsdp)
    return d, pl


def materialize(model: CausalLM, cfg: Config, hf_cfg, dist: Dist) -> None:
    """Sharded model on meta -> allocate this rank's shards -> rank 0's weights broadcast into them.

    Random init must happen on one rank: DTensor random ops on a CPU mesh draw the same values on
    every rank, so a local init would give wrong shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device="cpu" if cfg.parallel.cpu_offload else dist.device)
    reference = _initial_hf(cfg, hf_cfg) if dist.is_main else None
    full = from_hf(reference.state_dict()) if reference is not None else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
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
    QLoRA's 4-bit base is loaded straight onto `device` (bitsandbytes quantizes as it loads)."""
    if lora.quantized(cfg.lora):
        assert device is not None
        hf = lora.quantized_base(cfg, hf_cfg, device)
    else:
        hf = initial_model(cfg, hf_cfg, cfg.train.seed)
    return lora.apply(hf, cfg.lora, seed=cfg.train.seed) if lora.enabled(cfg.lora) else hf


def build_model(cfg: Config, hf_cfg, pl: Plan, dist: Dist) -> CausalLM:
    """With `lora.r > 0` the adapters are injected before parallelize (see shardlm.models.lora): only they train."""
    chunk = auto_loss_chunk(cfg.train.loss_chunk_size, cfg.train.batch_size, cfg.data.seq_len, hf_cfg.vocab_size,
                            dist.device, compiled=pl.compile == "model", itemsize=pl.dtype.itemsize)
    if pl.use_fsdp:
        hf = empty_model(hf_cfg, "meta")
        model = CausalLM(lora.apply(hf, cfg.lora) if lora.enabled(cfg.lora) else hf, chunk)
        parallelize(model, cfg, pl, dist)
        materialize(model, cfg, hf_cfg, dist)
    else:
        model = CausalLM(_initial_hf(cfg, hf_cfg, dist.device), chunk)
        if dist.device.type != "xla" and not lora.quantized(cfg.lora):  # xla moves it itself; QLoRA's is there
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


def check_resumed_optimizer(cfg: Config, out: Path, dist: Dist) -> None:
    """The checkpoint a run resumes holds its optimizer's state: another optimizer cannot load it (DCP would stop on
    the first missing key, with a traceback)."""
    from shardlm.checkpoint.layout import CONFIG, checkpoints_dir, read_config, resume_target

    def saved() -> str:
        path = resume_target(cfg.checkpoint.resume, checkpoints_dir(out), log=lambda _: None)
        if path is None or not (path / CONFIG).is_file():
            return ""
        return f"{read_config(path).train.optimizer}\t{path}"

    found = dist.run_on_main(saved)
    if not found:
        return
    old, path = found.split("\t", 1)
    before, now = optimizers.optimizer_name(old), optimizers.optimizer_name(cfg.train.optimizer)
    if before != now:
        raise ShardlmError(f"checkpoint '{path}' holds the state of train.optimizer={before}, and this run asks for "
                           f"{now}: resume with train.optimizer={before}, or start a new run from its weights "
                           f"(shardlm export {path} DIR, then model.name=DIR).")


def count_steps(cfg: Config, train: Blocks, world: int) -> int:
    """train.epochs counts the blocks of all sampled sources of a mixture together (weight 0: left out)."""
    t = cfg.train
    global_batch = world * t.batch_size * t.grad_accum
    blocks = getattr(train, "sampled_blocks", len(train))  # a mixture's weight-0 sources are left out
    if blocks < global_batch:
        raise ShardlmError(
            f"the training data has {blocks} blocks of {cfg.data.seq_len} tokens, fewer than one global "
            f"batch of {global_batch} (= {world} devices x train.batch_size={t.batch_size} x "
            f"train.grad_accum={t.grad_accum}). Use more data or lower train.batch_size / data.seq_len.")
    if t.max_steps is not None:
        return t.max_steps
    return int(t.epochs * blocks // global_batch)


def build(cfg: Config) -> Run:
    """Checks that need no data (out_dir, tokenizer, the model's config against data.seq_len) come before
    tokenizing, so a config that can never work fails in seconds, not after the cache is built."""
    d, pl = init_dist(cfg)
    lora.check(cfg.lora, d.device, sharded=pl.use_fsdp)  # QLoRA's refusals come before any data work
    optimizers.check_optimizer(cfg)  # a misspelled optimizer or a missing library too
    out = Path(d.run_on_main(lambda: str(check_out_dir(cfg.out_dir))))
    check_resumed_optimizer(cfg, out, d)
    tokenizer = model_tokenizer(cfg.model)
    hf_cfg = model_config(cfg, tokenizer)
    train, val = prepare_data(cfg.data, tokenizer, d)
    check_packing(hf_cfg, cfg.data.packing and bool(describe(train)))
    check_objective(cfg, train, val)
    total = count_steps(cfg, train, d.data_parallel)
    check_schedule(cfg.train, total, optimizers.optimizer_name(cfg.train.optimizer))
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, hf_cfg, pl, d)
    optimizer, scheduler = build_optimizer(model, cfg, total)
    return Run(cfg, d, pl, tokenizer, hf_cfg, model, optimizer, scheduler, train, val, total, out)

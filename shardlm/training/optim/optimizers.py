"""The optimizers of `train.optimizer`, each on FSDP2's sharded parameters (DTensors) and in the checkpoint:

    adamw                torch's fused AdamW on the local shards (ShardLocalAdamW): the default, unchanged
    muon                 Newton-Schulz orthogonalized momentum for the 2-D matrices of the transformer blocks,
                         AdamW for the rest (embeddings, head, norms, biases), each with its own learning rate
    adamw8bit            torchao's AdamW8bit: both moments in 8 bits, blockwise scaled (~2 bytes per parameter)
    adafactor            torch.optim.Adafactor: the second moment factored into row and column statistics
    schedule_free_adamw  the `schedulefree` package's AdamWScheduleFree: no decay horizon (train.schedule constant)
    sgd                  torch.optim.SGD with momentum 0.9

How Muon runs on FSDP2's shards: optim.muon; the wrappers of Adafactor, torchao's AdamW8bit and schedulefree
(and how schedule-free AdamW keeps x and y): optim.variants; AdamW on the local shards: optim.adamw; which update
a run's steps take (sync-free or synchronous clip-and-skip): optim.update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.config import Config, nearest
from shardlm.config.checks import canonical_choice
from shardlm.distributed.shards import local_shard
from shardlm.models.causal_lm import transformer_blocks
from shardlm.training.optim.adamw import ShardLocalAdamW, fused_on
from shardlm.training.optim.base import KeepsImplementation
from shardlm.training.optim.muon import Muon
from shardlm.training.optim.update import UpdatePlan, plan_update
from shardlm.training.optim.variants import Adafactor, adamw8bit, import_problem, schedule_free_adamw

OPTIMIZERS = ("adamw", "muon", "adamw8bit", "adafactor", "schedule_free_adamw", "sgd")
# Other trainers' names (HF Trainer's `optim`, ...), keyed as config.checks.choice_key spells them
OPTIMIZER_ALIASES = {
    "adamwtorch": "adamw", "adamwtorchfused": "adamw", "adamwhf": "adamw", "adamwfused": "adamw",
    "adamwtorch8bit": "adamw8bit", "adamwtorchao8bit": "adamw8bit", "adamwbnb8bit": "adamw8bit",
    "adam8bit": "adamw8bit", "adamwschedulefree": "schedule_free_adamw", "sfadamw": "schedule_free_adamw",
    "schedulefree": "schedule_free_adamw",
}
# train.optimizer_args each optimizer takes, with shardlm's defaults (docs/optimizers.md)
OPTIMIZER_ARGS: dict[str, dict[str, Any]] = {
    "adamw": {"eps": 1e-8},
    "muon": {"nesterov": True, "ns_steps": 5, "ns_coefficients": (3.4445, -4.775, 2.0315)},
    "adamw8bit": {"eps": 1e-8, "block_size": 256, "bf16_stochastic_round": False},
    "adafactor": {"beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0},
    "schedule_free_adamw": {"eps": 1e-8, "r": 0.0, "weight_lr_power": 2.0},
    "sgd": {"momentum": 0.9, "nesterov": False, "dampening": 0.0},
}
ADAMW_ONLY = ("betas", "beta1", "beta2", "amsgrad", "eps")  # what Muon's matrices do not take
MUON_KEYS = {"muon_lr": None, "muon_momentum": 0.95, "muon_adjust_lr": "match_rms_adamw"}  # key: its default
ADJUST_LR = ("match_rms_adamw", "original")
INSTALL = {"adamw8bit": ("torchao", "pip install torchao (or pip install 'shardlm[optim]')"),
           "schedule_free_adamw": ("schedulefree", "pip install schedulefree (or pip install 'shardlm[optim]')")}
# what each imports, and which torch its releases need (pip cannot choose a torchao by the torch installed)
IMPORTS = {"adamw8bit": ("torchao.optim", "torchao 0.17 needs torch >= 2.10, 0.18 torch >= 2.11"),
           "schedule_free_adamw": ("schedulefree", "")}


def optimizer_name(name: str) -> str:
    """`train.optimizer` as one of OPTIMIZERS: any case, with or without `_`, or another trainer's name."""
    found = canonical_choice(name, OPTIMIZERS, OPTIMIZER_ALIASES)
    if found is None:
        raise ShardlmError(f"train.optimizer={name!r} is not one of {', '.join(OPTIMIZERS)}."
                           f"{nearest(name, OPTIMIZERS)} HF Trainer's names work too: adamw_torch, adamw_torch_fused, "
                           "adamw_torch_8bit, adamw_bnb_8bit, schedule_free_adamw.")
    return found


def optimizer_args(cfg: Config) -> dict[str, Any]:
    """This optimizer's defaults, updated by train.optimizer_args; one it does not take is refused."""
    t, name = cfg.train, optimizer_name(cfg.train.optimizer)
    known = OPTIMIZER_ARGS[name]
    for arg in t.optimizer_args:
        if arg in known:
            continue
        if name == "muon" and arg in ADAMW_ONLY:
            raise ShardlmError(f"train.optimizer_args.{arg} is AdamW's, not Muon's: Muon's matrices take "
                               f"{', '.join(known)} here and train.muon_lr / train.muon_momentum; its AdamW part "
                               "(embeddings, head, norms, biases) uses train.beta1 and train.beta2. Remove it.")
        where = {"lr": "train.lr", "weight_decay": "train.weight_decay", "betas": "train.beta1 / train.beta2",
                 "momentum": "train.muon_momentum"}.get(arg) if name != "sgd" or arg != "momentum" else None
        hint = f" (set {where} instead)" if where else nearest(arg, list(known))
        raise ShardlmError(f"train.optimizer_args.{arg} is not an argument of train.optimizer={name}: it takes "
                           f"{', '.join(known)}.{hint}")
    args = {**known, **t.optimizer_args}
    for tupled in ("ns_coefficients", "eps"):
        if isinstance(args.get(tupled), list):  # YAML has no tuples
            args[tupled] = tuple(args[tupled])
    return args


def check_optimizer(cfg: Config) -> str:
    """The optimizer's name after the checks that need no model: its keys, its library, LoRA. Returns the name."""
    t = cfg.train
    name = optimizer_name(t.optimizer)
    optimizer_args(cfg)
    if name != "muon":
        for key, default in MUON_KEYS.items():
            if getattr(t, key) != default:
                raise ShardlmError(f"train.{key} applies to train.optimizer=muon, not {name}: remove it or set "
                                   "train.optimizer=muon.")
    else:
        if t.muon_adjust_lr not in ADJUST_LR:
            raise ShardlmError(f"train.muon_adjust_lr={t.muon_adjust_lr!r} is not one of {', '.join(ADJUST_LR)}."
                               f"{nearest(t.muon_adjust_lr, ADJUST_LR)}")
        if t.muon_lr is not None and t.muon_lr <= 0:
            raise ShardlmError(f"train.muon_lr must be > 0 (or null for train.lr), got {t.muon_lr}.")
        if not 0.0 <= t.muon_momentum < 1.0:
            raise ShardlmError(f"train.muon_momentum must be in [0, 1), got {t.muon_momentum}.")
    if name in INSTALL:
        import importlib.util

        module, command = INSTALL[name]
        if importlib.util.find_spec(module) is None:
            raise ShardlmError(f"train.optimizer={name} needs the {module} package, which is not installed: "
                               f"{command}; or choose another train.optimizer (adamw needs nothing more).")
        imported, needs = IMPORTS[name]
        if (problem := import_problem(imported)) is not None:
            raise ShardlmError(f"train.optimizer={name} needs the {module} package, which is installed but does not "
                               f"import with torch {torch.__version__} ({problem}): install a {module} built for this "
                               f"torch{f' ({needs})' if needs else ''}, or choose another train.optimizer.")
    return name


# ---- parameter groups --------------------------------------------------------------------------------------
@dataclass
class Group:
    """A parameter group as the run header names it: what it holds, its tensors and their parameters."""

    label: str
    tensors: int
    params: int
    lr: float


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _groups(model: nn.Module, cfg: Config, name: str) -> tuple[list[dict[str, Any]], list[Group]]:
    """AdamW's split (decay on >= 2-D tensors, none on norms and biases), or Muon's: the blocks' 2-D matrices,
    then the other >= 2-D tensors (embeddings, head), then norms and biases."""
    t = cfg.train
    params = _trainable(model)
    if name == "muon":
        in_blocks = {id(p) for p in transformer_blocks(getattr(model, "hf", model)).parameters()}
        matrices = [p for _, p in params if p.dim() == 2 and id(p) in in_blocks]
        taken = {id(p) for p in matrices}
        decay = [p for _, p in params if p.dim() >= 2 and id(p) not in taken]
        rest = [p for _, p in params if p.dim() < 2]
        muon_lr = t.muon_lr if t.muon_lr is not None else t.lr
        groups = [{"params": matrices, "weight_decay": t.weight_decay, "lr": muon_lr, "use_muon": True},
                  {"params": decay, "weight_decay": t.weight_decay, "use_muon": False},
                  {"params": rest, "weight_decay": 0.0, "use_muon": False}]
        labels = ["muon: block matrices", "adamw: embeddings, head", "adamw: norms, biases"]
        lrs = [muon_lr, t.lr, t.lr]
    else:
        decay = [p for _, p in params if p.dim() >= 2]
        rest = [p for _, p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        labels, lrs = ["decay: matrices, embeddings", "no decay: norms, biases"], [t.lr, t.lr]
    lists: list[list[nn.Parameter]] = [g["params"] for g in groups]  # type: ignore[misc]
    described = [Group(label, len(ps), sum(p.numel() for p in ps), lr)
                 for label, ps, lr in zip(labels, lists, lrs, strict=True)]
    return _loadable(groups), described


def _loadable(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups without the second and later ones that hold no parameters: DCP loads the state of at most one
    (Muon with LoRA had two, the frozen embeddings and head, norms and biases, and could not resume). The first
    stays, so the checkpoints of AdamW with LoRA (one empty group) keep resuming, their schedules group for group."""
    empty = [i for i, g in enumerate(groups) if not g["params"]]
    return [g for i, g in enumerate(groups) if i not in empty[1:]]


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The optimizer of `train.optimizer` over the model's trainable parameters; `optimizer.groups_described`
    lists its groups for the run header (`describe`)."""
    t = cfg.train
    name = check_optimizer(cfg)
    args = optimizer_args(cfg)
    groups, described = _groups(model, cfg, name)
    device = local_shard(next(model.parameters())).device
    betas = (t.beta1, t.beta2)
    optimizer: torch.optim.Optimizer
    if name == "adamw":
        fused = fused_on(device)  # XLA: foreach, traced into the step's graph
        if args == OPTIMIZER_ARGS["adamw"]:  # exactly the call of before train.optimizer (eps is AdamW's default)
            optimizer = ShardLocalAdamW(groups, lr=t.lr, betas=betas, fused=fused, foreach=not fused)
        else:
            optimizer = ShardLocalAdamW(groups, lr=t.lr, betas=betas, fused=fused, foreach=not fused, **args)
    elif name == "muon":
        optimizer = Muon(groups, lr=t.lr, betas=betas, weight_decay=t.weight_decay, momentum=t.muon_momentum,
                         adjust_lr=t.muon_adjust_lr, **args)
    elif name == "adamw8bit":
        optimizer = adamw8bit(groups, lr=t.lr, betas=betas, **args)
    elif name == "adafactor":
        optimizer = Adafactor(groups, lr=t.lr, **args)
    elif name == "schedule_free_adamw":
        optimizer = schedule_free_adamw(model, groups, lr=t.lr, betas=betas, **args)
    else:
        optimizer = SGD(groups, lr=t.lr, **args)
    optimizer.groups_described = described  # type: ignore[attr-defined]
    optimizer.shardlm_name = name  # type: ignore[attr-defined]
    optimizer.update_plan = plan_update(optimizer, cfg, device)  # type: ignore[attr-defined]
    return optimizer


class SGD(KeepsImplementation, torch.optim.SGD):
    """torch's SGD; a resume keeps this run's implementation (optim.base)."""


def update_plan(optimizer: torch.optim.Optimizer) -> UpdatePlan:
    """The update `build_optimizer` planned for this optimizer's steps (synchronous for one built elsewhere)."""
    return getattr(optimizer, "update_plan", UpdatePlan(False, "an optimizer not built by shardlm"))


def describe(optimizer: torch.optim.Optimizer, schedule: object = None) -> str:
    """One line for the run header: the optimizer, its groups (tensors, parameters, peak lr) and the schedule."""
    name = getattr(optimizer, "shardlm_name", type(optimizer).__name__)
    groups = "; ".join(f"{g.label}: {g.tensors} tensors, {_count(g.params)} parameters, lr {g.lr:g}"
                       for g in getattr(optimizer, "groups_described", []) if g.tensors)
    line = f"optimizer: {name} ({groups})"
    if isinstance(optimizer, Muon) and (plan := optimizer.exchange_plan()):
        line += f"; {plan}"
    line += f"; schedule: {schedule}" if schedule is not None else ""
    return line + f"\n{update_plan(optimizer).describe()}"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


# ---- state bytes (estimate, tune, the benchmark) ----------------------------------------------------------------
def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state as held: shards' local tensors, 8-bit codes with their scales."""
    seen: set[tuple[int, int]] = set()  # storage shared by several states (a quantization map) counts once

    def nbytes(t: torch.Tensor) -> int:
        if (local := local_shard(t)) is not t:
            return nbytes(local)
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):  # a tensor subclass: its inner tensors
            names, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, n)) for n in names)
        size = t.numel() * t.element_size()
        key = (t.data_ptr(), size)
        if size and key in seen:
            return 0
        seen.add(key)
        return size

    return sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def state_bytes_estimate(cfg: Config, model: nn.Module, shard: int = 1) -> tuple[str, float]:
    """(what, bytes per rank) of the optimizer state for `model`'s trainable parameters (a meta model works),
    sharded over `shard` ranks: for `shardlm estimate` and `shardlm tune`."""
    name = optimizer_name(cfg.train.optimizer)
    params = [p for _, p in _trainable(model)]
    total = sum(p.numel() for p in params)
    if name == "adamw":
        return "AdamW state (2 x fp32, sharded)", 8 * total / shard
    if name == "schedule_free_adamw":
        return "schedule-free AdamW state (z, v: 2 x fp32, sharded)", 8 * total / shard
    if name == "sgd":
        return "SGD momentum (fp32, sharded)", 4 * total / shard
    if name == "adamw8bit":
        block = optimizer_args(cfg)["block_size"]
        small = [p.numel() // shard < 4096 or (p.numel() // shard) % block for p in params]
        fp32 = sum(p.numel() for p, s in zip(params, small, strict=True) if s)
        qmaps = 2 * 256 * 4 * small.count(False)  # each 8-bit state carries its 256-entry code book
        return ("8-bit AdamW state (2 x 8 bits + a scale per block, sharded)",
                (2 * (1 + 4 / block) * (total - fp32) + 8 * fp32) / shard + qmaps)
    if name == "adafactor":  # a row and a column statistic per matrix, a full one per vector
        factored = sum(4 * (p.shape[-2] + p.shape[-1]) * (p.numel() // (p.shape[-2] * p.shape[-1]))
                       if p.dim() >= 2 else 4 * p.numel() for p in params)
        return "Adafactor state (factored second moment)", factored / shard
    blocks = {id(p) for p in transformer_blocks(getattr(model, "hf", model)).parameters()}
    matrices = sum(p.numel() for p in params if p.dim() == 2 and id(p) in blocks)
    return "Muon state (momentum of the block matrices, AdamW's 2 x fp32 for the rest)", \
        (4 * matrices + 8 * (total - matrices)) / shard

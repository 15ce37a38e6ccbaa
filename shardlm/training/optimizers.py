"""The optimizers of `train.optimizer`, each on FSDP2's sharded parameters (DTensors) and in the checkpoint:

    adamw                torch's fused AdamW on the local shards (ShardLocalAdamW): the default, unchanged
    muon                 Newton-Schulz orthogonalized momentum for the 2-D matrices of the transformer blocks,
                         AdamW for the rest (embeddings, head, norms, biases), each with its own learning rate
    adamw8bit            torchao's AdamW8bit: both moments in 8 bits, blockwise scaled (~2 bytes per parameter)
    adafactor            torch.optim.Adafactor: the second moment factored into row and column statistics
    schedule_free_adamw  the `schedulefree` package's AdamWScheduleFree: no decay horizon (train.schedule constant)
    sgd                  torch.optim.SGD with momentum 0.9

Muon under FSDP2. Each rank holds a slice of rows of every matrix, but Newton-Schulz needs the whole matrix.
The matrices are divided among the ranks of the shard group (balanced by their Newton-Schulz cost); one
all-to-all brings each matrix's slices to its owner, each rank orthogonalizes its own matrices, and a second
all-to-all brings every rank its slice of each result. So a step computes each matrix once (not once per rank)
and moves 2 x (ranks - 1) / ranks of the matrices' bytes in all: two thirds of what FSDP2's own all-gathers
and reduce-scatter move for them per step in fp32, a third when they travel in bf16 (on CUDA, where
Newton-Schulz runs in bf16 as torch.optim.Muon's does; on CPU it runs in fp32). The result equals one
process's to rounding (tests/test_optimizers.py: 2 ranks = 1 process to 1e-4 over 20 steps).

Schedule-free AdamW keeps its evaluation weights x apart from the point y where gradients are taken. Here the
parameters hold x between steps (so evaluation, checkpoints, exports and the final model are x) and y only from
the first forward of a training step to the end of its update (`ScheduleFreeAdamW`): no call in the loop has to
know, and a resume restores x and z, from which y follows exactly as in the run that saved them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.config import Config, nearest
from shardlm.config.checks import canonical_choice
from shardlm.distributed.parallelize import ShardLocalAdamW
from shardlm.models.causal_lm import transformer_blocks

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
    return groups, described


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The optimizer of `train.optimizer` over the model's trainable parameters; `optimizer.groups_described`
    lists its groups for the run header (`describe`)."""
    t = cfg.train
    name = check_optimizer(cfg)
    args = optimizer_args(cfg)
    groups, described = _groups(model, cfg, name)
    device = next(model.parameters()).device.type
    betas = (t.beta1, t.beta2)
    optimizer: torch.optim.Optimizer
    if name == "adamw":
        fused = device in ("cpu", "cuda")  # XLA: foreach, traced into the step's graph
        if args == OPTIMIZER_ARGS["adamw"]:  # exactly the call of before train.optimizer (eps is AdamW's default)
            optimizer = ShardLocalAdamW(groups, lr=t.lr, betas=betas, fused=fused, foreach=not fused)
        else:
            optimizer = ShardLocalAdamW(groups, lr=t.lr, betas=betas, fused=fused, foreach=not fused, **args)
    elif name == "muon":
        optimizer = Muon(groups, lr=t.lr, betas=betas, weight_decay=t.weight_decay, momentum=t.muon_momentum,
                         adjust_lr=t.muon_adjust_lr, fused=device in ("cpu", "cuda"), **args)
    elif name == "adamw8bit":
        optimizer = adamw8bit(groups, lr=t.lr, betas=betas, **args)
    elif name == "adafactor":
        optimizer = Adafactor(groups, lr=t.lr, **args)
    elif name == "schedule_free_adamw":
        optimizer = schedule_free_adamw(model, groups, lr=t.lr, betas=betas, **args)
    else:
        optimizer = torch.optim.SGD(groups, lr=t.lr, **args)
    optimizer.groups_described = described  # type: ignore[attr-defined]
    optimizer.shardlm_name = name  # type: ignore[attr-defined]
    return optimizer


def describe(optimizer: torch.optim.Optimizer, schedule: object = None) -> str:
    """One line for the run header: the optimizer, its groups (tensors, parameters, peak lr) and the schedule."""
    name = getattr(optimizer, "shardlm_name", type(optimizer).__name__)
    groups = "; ".join(f"{g.label}: {g.tensors} tensors, {_count(g.params)} parameters, lr {g.lr:g}"
                       for g in getattr(optimizer, "groups_described", []) if g.tensors)
    line = f"optimizer: {name} ({groups})"
    if isinstance(optimizer, Muon) and (plan := optimizer.exchange_plan()):
        line += f"; {plan}"
    return line + (f"; schedule: {schedule}" if schedule is not None else "")


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


# ---- state bytes (estimate, tune, the benchmark) ----------------------------------------------------------------
def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state as held: shards' local tensors, 8-bit codes with their scales."""
    from torch.distributed.tensor import DTensor

    seen: set[tuple[int, int]] = set()  # storage shared by several states (a quantization map) counts once

    def nbytes(t: torch.Tensor) -> int:
        if isinstance(t, DTensor):
            return nbytes(t._local_tensor)
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


# ---- Muon ---------------------------------------------------------------------------------------------------
def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, dtype: torch.dtype,
                  eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration (Jordan's coefficients) in `dtype`: U S' V^T of g."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, how: str, shape: torch.Size) -> float:
    """torch.optim.Muon's: `original` scales by sqrt(max(1, rows / cols)) (Jordan), `match_rms_adamw` by
    0.2 sqrt(max(rows, cols)), which gives the update AdamW's RMS, so AdamW's lr and weight decay fit (Moonlight)."""
    rows, cols = shape[0], shape[1]
    return lr * (math.sqrt(max(1, rows / cols)) if how == "original" else 0.2 * math.sqrt(max(rows, cols)))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _rows(n: int, ranks: int) -> list[int]:
    """Rows of each rank's slice of an n-row tensor sharded on dim 0 (torch.chunk's split, as FSDP2's)."""
    size = -(-n // ranks)
    return [max(0, min(size, n - r * size)) for r in range(ranks)]


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `use_muon`, AdamW (torch's, on local shards) for the others, in one optimizer,
    so the loop, the schedule (every group follows it from its own peak) and the checkpoint see one.

    On one process the matrices' update is torch.optim.Muon's (tests compare them). Under FSDP2 each matrix is
    orthogonalized whole by one rank of its shard group (see the module's docstring)."""

    def __init__(self, params: Iterable[dict[str, Any]], *, lr: float, betas: tuple[float, float],
                 weight_decay: float, momentum: float, adjust_lr: str, nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315), eps: float = 1e-8,
                 fused: bool = False):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "momentum": momentum,
                    "nesterov": nesterov, "ns_steps": ns_steps, "ns_coefficients": ns_coefficients,
                    "adjust_lr": adjust_lr, "use_muon": False}
        super().__init__(params, defaults)
        self.fused = fused
        self.ns_dtype: torch.dtype | None = None  # None: bf16 on CUDA (as torch.optim.Muon), fp32 elsewhere
        self.configured = [{k: g[k] for k in defaults if k not in ("lr", "betas", "eps", "weight_decay")}
                           for g in self.param_groups]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The moments come back; Muon's settings stay this run's (the checkpoint's would override them)."""
        super().load_state_dict(state_dict)
        for group, configured in zip(self.param_groups, self.configured, strict=True):
            group.update(configured)

    @torch.no_grad()
    def step(self, closure=None):
        return step_groups(self, closure, lambda group, params: (self._muon if group["use_muon"] else self._adamw)(
            group, params))

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """torch's AdamW (fused on CPU and CUDA) on the local shards, its state kept as DTensors like the params."""
        from torch.optim.adamw import adamw

        states = [self.state[p] for p in params]
        for p, s in zip(params, states, strict=True):
            if not s:
                s["step"] = torch.tensor(0.0, dtype=torch.float32, device=_local(p).device) if self.fused \
                    else torch.tensor(0.0, dtype=torch.float32)
                s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        adamw([_local(p) for p in params], [_local(p.grad) for p in params],  # type: ignore[arg-type]
              [_local(s["exp_avg"]) for s in states], [_local(s["exp_avg_sq"]) for s in states], [],
              [s["step"] for s in states], foreach=None if self.fused else True, fused=self.fused or None,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False, has_complex=False)

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        momentum, nesterov = group["momentum"], group["nesterov"]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            assert p.grad is not None
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if nesterov else buf)
        ortho = self._orthogonalize(params, updates, group)
        lr, decay = group["lr"], group["weight_decay"]
        for p, o in zip(params, ortho, strict=True):
            local = _local(p)
            local.mul_(1 - lr * decay)
            local.add_(o, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape))

    def _dtype(self, device: torch.device) -> torch.dtype:
        return self.ns_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)

    def _orthogonalize(self, params: list[torch.Tensor], updates: list[torch.Tensor],
                       group: dict[str, Any]) -> list[torch.Tensor]:
        """Each matrix's orthogonalized update (this rank's rows of it): whole matrices computed here, sharded ones
        by their owners (see the module's docstring)."""
        ns = {"coefficients": group["ns_coefficients"], "steps": group["ns_steps"]}
        out: list[torch.Tensor | None] = [None] * len(params)
        sharded: dict[Any, list[int]] = {}
        for i, p in enumerate(params):
            pg = _shard_group(p)
            if pg is None:
                out[i] = newton_schulz(updates[i], dtype=self._dtype(updates[i].device), **ns)
            else:
                sharded.setdefault(pg, []).append(i)
        for pg, idx in sharded.items():
            results = self._exchange(pg, [params[i] for i in idx], [updates[i] for i in idx], ns)
            for i, r in zip(idx, results, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def _exchange(self, pg: Any, params: list[torch.Tensor], updates: list[torch.Tensor],
                  ns: dict[str, Any]) -> list[torch.Tensor]:
        """Slices to owners (all-to-all), Newton-Schulz on the owned matrices, results' slices back (all-to-all)."""
        dist = torch.distributed
        ranks, me = dist.get_world_size(pg), dist.get_rank(pg)
        shapes = [tuple(p.shape) for p in params]
        owner = owners(shapes, ranks)
        rows = [_rows(s[0], ranks) for s in shapes]
        home = updates[0].device
        device = _comm_device(params[0], home)  # with CPU offload the shards are on the CPU, NCCL's buffers not
        dtype = self._dtype(device)
        mine = [i for i in range(len(params)) if owner[i] == me]
        # gather: to rank j goes my slice of every matrix j owns; from rank s comes s's slice of each of mine
        send = [torch.cat([updates[i].reshape(-1).to(device=device, dtype=dtype) for i in range(len(params))
                           if owner[i] == j]
                          or [torch.empty(0, dtype=dtype, device=device)]) for j in range(ranks)]
        send_sizes = [t.numel() for t in send]
        recv_sizes = [sum(rows[i][s] * shapes[i][1] for i in mine) for s in range(ranks)]
        received = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(received, torch.cat(send), recv_sizes, send_sizes, group=pg)
        pieces = list(received.split(recv_sizes))
        results: dict[int, list[torch.Tensor]] = {}
        offsets = [0] * ranks
        for i in mine:  # reassemble in rank order, orthogonalize, cut back into the ranks' slices
            parts = []
            for s in range(ranks):
                n = rows[i][s] * shapes[i][1]
                parts.append(pieces[s][offsets[s]:offsets[s] + n].view(rows[i][s], shapes[i][1]))
                offsets[s] += n
            full = newton_schulz(torch.cat(parts), dtype=dtype, **ns)
            results[i] = list(full.split(rows[i]))
        # scatter: to rank s go its slices of my results; from rank j come my slices of j's
        back = [torch.cat([results[i][s].reshape(-1) for i in mine] or [torch.empty(0, dtype=dtype, device=device)])
                for s in range(ranks)]
        back_sizes = [t.numel() for t in back]
        mine_sizes = [sum(rows[i][me] * shapes[i][1] for i in range(len(params)) if owner[i] == j)
                      for j in range(ranks)]
        returned = torch.empty(sum(mine_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(returned, torch.cat(back), mine_sizes, back_sizes, group=pg)
        per_owner = [list(chunk.split([rows[i][me] * shapes[i][1] for i in range(len(params)) if owner[i] == j]))
                     for j, chunk in enumerate(returned.split(mine_sizes))]
        out = []
        for i in range(len(params)):
            out.append(per_owner[owner[i]].pop(0).view(rows[i][me], shapes[i][1]).to(home))
        return out

    def exchange_plan(self) -> str | None:
        """What the sharded orthogonalization moves per step, for the run header (None without sharding)."""
        sharded = [p for g in self.param_groups if g["use_muon"] for p in g["params"] if _shard_group(p) is not None]
        if not sharded:
            return None
        ranks, numel = _shard_ranks(sharded[0]), sum(p.numel() for p in sharded)
        dtype = self._dtype(_local(sharded[0]).device)
        moved = 2 * (ranks - 1) / ranks * numel * torch.finfo(dtype).bits / 8
        return (f"{len(sharded)} matrices orthogonalized whole, shared among {ranks} ranks: "
                f"{moved / 2**20:.2f} MiB of {dtype} exchanged per step ({moved / ranks / 2**20:.2f} MiB per rank)")


def owners(shapes: list[tuple[int, ...]], ranks: int) -> list[int]:
    """The rank that orthogonalizes each matrix: the costliest first, each to the least loaded rank (the same
    answer on every rank: it depends on the shapes alone)."""
    load = [0.0] * ranks
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-_ns_cost(shapes[i]), i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += _ns_cost(shapes[i])
    return owner


def _ns_cost(shape: tuple[int, ...]) -> float:
    small, big = sorted(shape[:2])
    return float(small * small * big)


def _comm_device(p: torch.Tensor, home: torch.device) -> torch.device:
    """Where `p`'s collectives run: its mesh's device (CUDA for NCCL even when CPU offload keeps `p` on the CPU)."""
    kind = getattr(getattr(p, "device_mesh", None), "device_type", home.type)
    if kind == home.type:
        return home
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def _shard_ranks(p: torch.Tensor) -> int:
    group = _shard_group(p)
    return 1 if group is None else torch.distributed.get_world_size(group)


def _shard_group(p: torch.Tensor) -> Any:
    """The process group over which `p`'s rows are sharded (FSDP2's Shard(0)); None if `p` is whole here."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard) and mesh.size(dim) > 1:
            if placement.dim != 0:
                raise ShardlmError(f"train.optimizer=muon expects FSDP2's row sharding (Shard(0)), found {placement}.")
            return mesh.get_group(dim)
    return None


# ---- Adafactor ------------------------------------------------------------------------------------------------
def _placed_like(p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...], sharded_rows: bool) -> torch.Tensor:
    """`local` as a DTensor on `p`'s mesh: rows sharded as `p`'s (a row statistic), or replicated (a column one)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(p, DTensor):
        return local
    placements = p.placements if sharded_rows else [Replicate()] * len(p.placements)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


def step_groups(optimizer: torch.optim.Optimizer, closure, update) -> Any:
    """torch.optim's step protocol: the closure's loss (gradients on), then `update(group, params)` for each
    group's parameters that have a gradient."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            update(group, params)
    return loss


class Adafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor's update (same formulas, same state names) on FSDP2's shards: the row statistic is
    sharded with the rows, the column statistic (a sum over all rows) and the norms the update reads are
    all-reduced over the shard group, two collectives per step for all the parameters together. (torch's own
    step fails on DTensors: an in-place op on a partial norm.)"""

    @torch.no_grad()
    def step(self, closure=None):
        return step_groups(self, closure, self._group_step)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            local = _local(p)
            if p.dim() > 1:
                state["row_var"] = _placed_like(p, local.new_zeros((*local.shape[:-1], 1)),
                                                (*p.shape[:-1], 1), sharded_rows=True)
                state["col_var"] = _placed_like(p, local.new_zeros((*local.shape[:-2], 1, local.shape[-1])),
                                                (*p.shape[:-2], 1, p.shape[-1]), sharded_rows=False)
            else:
                state["variance"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _group_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        lr, decay, d, beta2_decay = group["lr"], group["weight_decay"], group["d"], group["beta2_decay"]
        eps1, eps2 = group["eps"]
        first: list[list[torch.Tensor]] = []  # per parameter: what phase 1 sums over the shards
        for p in params:
            state = self._init_state(p)
            g, x = _local(p.grad), _local(p)  # type: ignore[arg-type]
            state["step"] += 1
            step = state["step"].item()
            om = step ** beta2_decay
            pieces = [x.norm(2).square().reshape(1)]
            if g.dim() > 1:
                row_var = _local(state["row_var"])
                row_var.lerp_(torch.norm(g, dim=-1, keepdim=True).square_().div_(p.shape[-1]), om)
                pieces += [row_var.sum(dim=-2).reshape(-1), torch.norm(g, dim=-2, keepdim=True).square_().reshape(-1)]
            else:
                _local(state["variance"]).lerp_(g * g, om)
            first.append(pieces)
        sums = self._all_reduce(params, first)
        second: list[list[torch.Tensor]] = []
        updates = []
        for p, (psq, *rest) in zip(params, sums, strict=True):
            state, g, x = self.state[p], _local(p.grad), _local(p)  # type: ignore[arg-type]
            step = state["step"].item()
            om, rho = step ** beta2_decay, min(lr, 1 / step ** 0.5)
            e1 = torch.finfo(x.dtype).eps if eps1 is None else eps1
            alpha = max(eps2, psq.sqrt().item() / p.numel() ** 0.5) * rho
            if decay != 0:
                x.mul_(1 - lr * decay)
            if g.dim() > 1:
                rows = p.shape[-2]
                row_sum, col_sq = rest[0], rest[1]
                col_var = _local(state["col_var"])
                col_var.lerp_(col_sq.view(col_var.shape).div(rows), om)
                estimate = _local(state["row_var"]) @ col_var
                estimate.div_((row_sum.view(*col_var.shape[:-2], 1, 1) / rows).clamp_(min=e1))
            else:
                estimate = _local(state["variance"]).clone()
            update = estimate.clamp_(min=e1 * e1).rsqrt_().mul_(g)
            updates.append((alpha, update))
            second.append([update.norm(2).square().reshape(1)])
        for p, (alpha, update), (usq,) in zip(params, updates, self._all_reduce(params, second), strict=True):
            denom = max(1.0, usq.sqrt().item() / (p.numel() ** 0.5 * d))
            _local(p).add_(update, alpha=-alpha / denom)

    @staticmethod
    def _all_reduce(params: list[torch.Tensor], pieces: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Each parameter's pieces summed over its shard group: one all-reduce per group for all of them."""
        out = [list(ps) for ps in pieces]
        by_group: dict[Any, list[int]] = {}
        for i, p in enumerate(params):
            pg = _shard_group(p)
            if pg is not None:
                by_group.setdefault(pg, []).append(i)
        for pg, idx in by_group.items():
            home = pieces[idx[0]][0].device
            flat = torch.cat([t for i in idx for t in pieces[i]]).to(_comm_device(params[idx[0]], home))
            torch.distributed.all_reduce(flat, group=pg)
            flat = flat.to(home)
            parts = iter(flat.split([t.numel() for i in idx for t in pieces[i]]))
            for i in idx:
                out[i] = [next(parts) for _ in pieces[i]]
        return [[t.reshape(()) if t.numel() == 1 else t for t in ps] for ps in out]


# ---- 8-bit AdamW (torchao) and schedule-free AdamW (schedulefree) ------------------------------------------------
def adamw8bit(groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
    """torchao's AdamW8bit, its compiled per-parameter update run on the local shards (torchao passes DTensors:
    slower, and on CPU inductor's cache handed one rank's kernel, compiled for its shard's size, to another),
    with the learning rate a plain number between steps (the schedule, the checkpoint's JSON and the loop read
    it as one; the compiled update gets it as a tensor, so a new value does not recompile)."""
    from torchao.optim import AdamW8bit
    from torchao.optim.adam import single_param_adam

    class ShardlmAdamW8bit(AdamW8bit):
        def __init__(self, *args: Any, **kw: Any):
            super().__init__(*args, **kw)
            for g in self.param_groups:
                g["lr"] = float(g["lr"])

        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            """Quantized where every rank's shard can be (torchao decides per rank, from its own shard: the ranks
            of one DTensor could hold 8-bit and fp32 pieces); small or odd-sized tensors stay fp32."""
            pieces = [n * math.prod(p.shape[1:]) for n in _rows(p.shape[0], _shard_ranks(p))] if p.dim() else [1]
            if all(n == 0 or (n >= 4096 and n % self.block_size == 0) for n in pieces):
                return super()._new_buffer(p, signed)
            return torch.zeros_like(p, memory_format=torch.preserve_format)

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            update = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
            with torch._dynamo.utils.disable_cache_limit():  # one compile per shape, as torchao's own step
                for group in self.param_groups:
                    lr = torch.tensor(float(group["lr"]))
                    plain: list[torch.Tensor] = []  # fp32 states (small tensors): torch's fused AdamW, no compile
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self.state[p]
                        if not state:
                            state["step"] = torch.tensor(0.0)
                            state["exp_avg"] = self._new_buffer(p, True)
                            state["exp_avg_sq"] = self._new_buffer(p, False)
                        if type(_local(state["exp_avg"])) is torch.Tensor:
                            plain.append(p)
                            continue
                        state["step"] += 1
                        update(_local(p).detach(), _local(p.grad), state["step"], _local(state["exp_avg"]),
                               _local(state["exp_avg_sq"]), None, lr, group["betas"][0], group["betas"][1],
                               group["weight_decay"], group["eps"], True,
                               self.bf16_stochastic_round and p.dtype is torch.bfloat16)
                    if plain:
                        self._plain_step(group, plain)
            return loss

        def _plain_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
            from torch.optim.adamw import adamw

            states = [self.state[p] for p in params]
            device = _local(params[0]).device
            fused = device.type in ("cpu", "cuda")
            for st in states:  # the fused kernel reads the step count on the parameters' device
                if fused and st["step"].device != device:
                    st["step"] = st["step"].to(device)
            adamw([_local(p) for p in params], [_local(p.grad) for p in params],  # type: ignore[arg-type]
                  [_local(st["exp_avg"]) for st in states], [_local(st["exp_avg_sq"]) for st in states], [],
                  [st["step"] for st in states], foreach=None if fused else True, fused=fused or None,
                  amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=float(group["lr"]),
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, has_complex=False)

    return ShardlmAdamW8bit(groups, **kwargs)


def schedule_free_adamw(model: nn.Module, groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
    from schedulefree import AdamWScheduleFree

    class ScheduleFreeAdamW(AdamWScheduleFree):
        """The parameters hold x (evaluation weights) between steps and y from a training step's first forward
        to the end of its update; the schedule (train.schedule, `constant` by default) sets its learning rate."""

        @torch.no_grad()
        def step(self, closure=None):
            self.train()  # a no-op after the forward did it
            loss = super().step(closure)
            self.eval()
            return loss

        def zero_grad(self, set_to_none: bool = True) -> None:
            super().zero_grad(set_to_none)
            self.eval()  # also after a skipped (non-finite) step, which left y

    optimizer = ScheduleFreeAdamW(groups, warmup_steps=0, **kwargs)

    @torch.compiler.disable
    def to_y(module: nn.Module, _args: Any) -> None:
        if module.training:
            optimizer.train()

    model.register_forward_pre_hook(to_y, prepend=True)  # before FSDP2's own (it gathers the weights)
    return optimizer

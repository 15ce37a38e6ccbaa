"""The optimizers of train.optimizer that wrap another library's: Adafactor (torch.optim's, on FSDP2's shards),
8-bit AdamW (torchao) and schedule-free AdamW (schedulefree).

Schedule-free AdamW keeps its evaluation weights x apart from the point y where gradients are taken. Here the
parameters hold x between steps (so evaluation, checkpoints, exports and the final model are x) and y only from
the first forward of a training step to the end of its update (`ScheduleFreeAdamW`): no call in the loop has to
know, and a resume restores x and z, from which y follows exactly as in the run that saved them.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
from torch import nn

from shardlm.distributed.shards import comm_device, local_shard, placed_like, row_split, shard_group, shard_ranks
from shardlm.models.causal_lm import before_every_forward
from shardlm.training.optim.adamw import adamw_on_shards
from shardlm.training.optim.base import KeepsImplementation, step_groups


class Adafactor(KeepsImplementation, torch.optim.Adafactor):
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
            local = local_shard(p)
            if p.dim() > 1:
                state["row_var"] = placed_like(p, local.new_zeros((*local.shape[:-1], 1)),
                                                (*p.shape[:-1], 1), sharded_rows=True)
                state["col_var"] = placed_like(p, local.new_zeros((*local.shape[:-2], 1, local.shape[-1])),
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
            g, x = local_shard(p.grad), local_shard(p)  # type: ignore[arg-type]
            state["step"] += 1
            step = state["step"].item()
            om = step ** beta2_decay
            pieces = [x.norm(2).square().reshape(1)]
            if g.dim() > 1:
                row_var = local_shard(state["row_var"])
                row_var.lerp_(torch.norm(g, dim=-1, keepdim=True).square_().div_(p.shape[-1]), om)
                pieces += [row_var.sum(dim=-2).reshape(-1), torch.norm(g, dim=-2, keepdim=True).square_().reshape(-1)]
            else:
                local_shard(state["variance"]).lerp_(g * g, om)
            first.append(pieces)
        sums = self._all_reduce(params, first)
        second: list[list[torch.Tensor]] = []
        updates = []
        for p, (psq, *rest) in zip(params, sums, strict=True):
            state, g, x = self.state[p], local_shard(p.grad), local_shard(p)  # type: ignore[arg-type]
            step = state["step"].item()
            om, rho = step ** beta2_decay, min(lr, 1 / step ** 0.5)
            e1 = torch.finfo(x.dtype).eps if eps1 is None else eps1
            alpha = max(eps2, psq.sqrt().item() / p.numel() ** 0.5) * rho
            if decay != 0:
                x.mul_(1 - lr * decay)
            if g.dim() > 1:
                rows = p.shape[-2]
                row_sum, col_sq = rest[0], rest[1]
                col_var = local_shard(state["col_var"])
                col_var.lerp_(col_sq.view(col_var.shape).div(rows), om)
                estimate = local_shard(state["row_var"]) @ col_var
                estimate.div_((row_sum.view(*col_var.shape[:-2], 1, 1) / rows).clamp_(min=e1))
            else:
                estimate = local_shard(state["variance"]).clone()
            update = estimate.clamp_(min=e1 * e1).rsqrt_().mul_(g)
            updates.append((alpha, update))
            second.append([update.norm(2).square().reshape(1)])
        for p, (alpha, update), (usq,) in zip(params, updates, self._all_reduce(params, second), strict=True):
            denom = max(1.0, usq.sqrt().item() / (p.numel() ** 0.5 * d))
            local_shard(p).add_(update, alpha=-alpha / denom)

    @staticmethod
    def _all_reduce(params: list[torch.Tensor], pieces: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Each parameter's pieces summed over its shard group: one all-reduce per group for all of them."""
        out = [list(ps) for ps in pieces]
        by_group: dict[Any, list[int]] = {}
        for i, p in enumerate(params):
            pg = shard_group(p)
            if pg is not None:
                by_group.setdefault(pg, []).append(i)
        for pg, idx in by_group.items():
            home = pieces[idx[0]][0].device
            flat = torch.cat([t for i in idx for t in pieces[i]]).to(comm_device(params[idx[0]], home))
            torch.distributed.all_reduce(flat, group=pg)
            flat = flat.to(home)
            parts = iter(flat.split([t.numel() for i in idx for t in pieces[i]]))
            for i in idx:
                out[i] = [next(parts) for _ in pieces[i]]
        return [[t.reshape(()) if t.numel() == 1 else t for t in ps] for ps in out]


# ---- 8-bit AdamW (torchao) and schedule-free AdamW (schedulefree) ------------------------------------------------
def import_problem(module: str) -> str | None:
    """Why `module` does not import here, None when it does: an installed library built for another torch fails
    at import (torchao 0.18 on torch 2.9: `cannot import name 'ScalingType'`), so the import itself is the check."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - whatever a library's import raises, the answer is the same
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None


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
            pieces = [n * math.prod(p.shape[1:]) for n in row_split(p.shape[0], shard_ranks(p))] if p.dim() else [1]
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
                        if type(local_shard(state["exp_avg"])) is torch.Tensor:
                            plain.append(p)
                            continue
                        state["step"] += 1
                        update(local_shard(p).detach(), local_shard(p.grad), state["step"],
                               local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"]), None, lr,
                               group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"], True,
                               self.bf16_stochastic_round and p.dtype is torch.bfloat16)
                    if plain:
                        adamw_on_shards(plain, [self.state[p] for p in plain], group)
            return loss

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

    before_every_forward(model, to_y)  # before FSDP2's gathers, also of a preference step's sequence_logps
    return optimizer

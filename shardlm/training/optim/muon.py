"""Muon: Newton-Schulz orthogonalized momentum for the 2-D matrices of the transformer blocks (train.optimizer=muon).

Muon under FSDP2. Each rank holds a slice of rows of every matrix, but Newton-Schulz needs the whole matrix.
The matrices are divided among the ranks of the shard group (balanced by their Newton-Schulz cost); one
all-to-all brings each matrix's slices to its owner, each rank orthogonalizes its own matrices, and a second
all-to-all brings every rank its slice of each result. So a step computes each matrix once (not once per rank)
and moves 2 x (ranks - 1) / ranks of the matrices' bytes in all: two thirds of what FSDP2's own all-gathers
and reduce-scatter move for them per step in fp32, a third when they travel in bf16 (on CUDA, where
Newton-Schulz runs in bf16 as torch.optim.Muon's does; on CPU it runs in fp32). The result equals one
process's to rounding (tests/test_optimizers.py: 2 ranks = 1 process to 1e-4 over 20 steps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from shardlm.distributed.shards import comm_device, local_shard, row_split, shard_group, shard_ranks
from shardlm.training.optim.adamw import adamw_on_shards
from shardlm.training.optim.base import step_groups


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


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `use_muon`, AdamW (torch's, on local shards) for the others, in one optimizer,
    so the loop, the schedule (every group follows it from its own peak) and the checkpoint see one.

    On one process the matrices' update is torch.optim.Muon's (tests compare them). Under FSDP2 each matrix is
    orthogonalized whole by one rank of its shard group (see the module's docstring)."""

    def __init__(self, params: Iterable[dict[str, Any]], *, lr: float, betas: tuple[float, float],
                 weight_decay: float, momentum: float, adjust_lr: str, nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315), eps: float = 1e-8):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "momentum": momentum,
                    "nesterov": nesterov, "ns_steps": ns_steps, "ns_coefficients": ns_coefficients,
                    "adjust_lr": adjust_lr, "use_muon": False}
        super().__init__(params, defaults)
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
        adamw_on_shards(params, [self.state[p] for p in params], group)

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        momentum, nesterov = group["momentum"], group["nesterov"]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            assert p.grad is not None
            grad, buf = local_shard(p.grad), local_shard(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if nesterov else buf)
        ortho = self._orthogonalize(params, updates, group)
        lr, decay = group["lr"], group["weight_decay"]
        for p, o in zip(params, ortho, strict=True):
            local = local_shard(p)
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
            pg = shard_group(p)
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
        rows = [row_split(s[0], ranks) for s in shapes]
        home = updates[0].device
        device = comm_device(params[0], home)  # with CPU offload the shards are on the CPU, NCCL's buffers not
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
        sharded = [p for g in self.param_groups if g["use_muon"] for p in g["params"] if shard_group(p) is not None]
        if not sharded:
            return None
        ranks, numel = shard_ranks(sharded[0]), sum(p.numel() for p in sharded)
        dtype = self._dtype(local_shard(sharded[0]).device)
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

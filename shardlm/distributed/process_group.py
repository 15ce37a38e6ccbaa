"""Launch environment detection, process-group lifecycle, device choice and rank-0 printing.

torchrun, SLURM (srun) and MPI launchers (OpenMPI, MPICH/PMI, PALS) each describe the job with their
own environment variables; `detect_launch` turns any of them into one `LaunchInfo`, and `init` hands
that to PyTorch's own c10d (NCCL on GPUs, gloo on CPUs) through the standard env:// variables.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardlm import ShardlmError


@dataclass
class LaunchInfo:
    launcher: str  # single | torchrun | slurm | mpi
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM nodelist such as `node[01-03,07],gpu5` into host names."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return hosts


def _slurm_hosts(nodelist: str) -> list[str]:
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    return expand_nodelist(nodelist)


def _first_line(path: str | None) -> str | None:
    if path and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    return line.split()[0]
    return None


RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PALS_RANKID")


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher set it, 0 without one: lets rank 0 alone print before the process
    group exists, without `detect_launch`'s full work (a SLURM job's master address can need scontrol)."""
    env = os.environ if env is None else env
    return int(next((env[k] for k in RANK_VARIABLES if k in env), 0))


def detect_launch(env: Mapping[str, str] | None = None, launcher: str = "auto") -> LaunchInfo:
    env = os.environ if env is None else env
    port = int(env.get("MASTER_PORT", 29500))
    if launcher == "auto":
        if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env):
            launcher = "torchrun"
        elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
            launcher = "slurm"
        elif any(k in env for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PALS_RANKID")):
            launcher = "mpi"
        else:
            launcher = "single"
    if launcher == "single":
        return LaunchInfo("single")
    if launcher == "torchrun":
        return LaunchInfo("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                          int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                          env.get("MASTER_ADDR", "127.0.0.1"), port)
    if launcher == "slurm":
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", str(world // max(1, nodes))).split("(")[0])
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))
        master = env.get("MASTER_ADDR") or (_slurm_hosts(nodelist)[0] if nodelist else "127.0.0.1")
        if "MASTER_PORT" not in env and "SLURM_JOB_ID" in env:
            port = 20000 + int(env["SLURM_JOB_ID"]) % 20000  # two jobs sharing a node must not collide
        return LaunchInfo("slurm", int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)),
                          local_world, master, port)
    if launcher == "mpi":
        for rank_k, size_k, lrank_k, lsize_k in (
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"),
            ("PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ):
            if rank_k in env:
                world = int(env.get(size_k, env.get("PMI_SIZE", "1")))
                local_world = int(env.get(lsize_k, world))
                master = env.get("MASTER_ADDR") or _first_line(env.get("PBS_NODEFILE")) or "127.0.0.1"
                return LaunchInfo("mpi", int(env[rank_k]), world, int(env.get(lrank_k, 0)), local_world,
                                  master, port)
        raise ShardlmError("parallel.launcher=mpi but no MPI rank variable (OMPI_COMM_WORLD_RANK, PMI_RANK, "
                           "PALS_RANKID) is set: start shardlm with mpiexec/mpirun.")
    raise ShardlmError(f"unknown launcher {launcher!r}")


class Dist:
    """The process group and device of this process; a single process has no group at all. `devices` is how
    many devices this process drives: 1, or every device of the host on XLA (SPMD, shardlm.distributed.xla)."""

    def __init__(self, info: LaunchInfo, device: torch.device, devices: int = 1):
        self.info, self.device, self.devices = info, device, devices
        self.context: Any = None  # shardlm.distributed.context.Context: rows split over `context.size` ranks
        self.tensor = 1  # parallel.tensor: consecutive ranks splitting each block, all reading the same rows
        self.rows_group: Any = None  # with tensor > 1: the ranks of one tensor index, each with distinct rows

    rank = property(lambda self: self.info.rank)
    world_size = property(lambda self: self.info.world_size)
    context_size = property(lambda self: self.context.size if self.context is not None else 1)
    # micro-batches per micro-step: the context and tensor ranks of a data index share theirs
    data_parallel = property(lambda self: self.info.world_size * self.devices // (self.context_size * self.tensor))
    data_rank = property(lambda self: self.info.rank // (self.context_size * self.tensor))
    data_world = property(lambda self: self.info.world_size // (self.context_size * self.tensor))  # distinct rows
    # validation: each rank scores rows of its own, except tensor ranks, which run one forward together
    eval_rank = property(lambda self: self.info.rank // self.tensor)
    eval_world = property(lambda self: self.info.world_size // self.tensor)
    is_main = property(lambda self: self.info.rank == 0)
    # HF's generate grows its input a token at a time: XLA would compile a graph per length, so it runs on the host
    generation_device = property(lambda self: "cpu" if self.device.type == "xla" else str(self.device))
    distributed = property(lambda self: self.info.world_size > 1)

    def print(self, *args, **kwargs) -> None:
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums over the ranks holding distinct rows (or distinct parts of them): tensor ranks hold the same
        statistics, so with parallel.tensor > 1 the sum runs over one rank of each tensor group."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.rows_group)
        return tensor

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank (used to share results and errors of work done once)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def run_on_main(self, fn, *args):
        """Run `fn` on rank 0 only; every rank gets its result, or raises the same error if it failed."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn(*args)
            except ShardlmError as e:
                error = str(e)
        error = self.broadcast_object(error)
        if error is not None:
            raise ShardlmError(error)
        return self.broadcast_object(result)


def pick_device(kind: str, local_rank: int) -> torch.device:
    from shardlm.distributed import xla

    if xla.wanted(kind):
        return xla.start()
    if kind == "cuda" and not torch.cuda.is_available():
        raise ShardlmError("parallel.device=cuda but no CUDA device is visible. Use parallel.device=auto or cpu.")
    if kind in ("auto", "cuda") and torch.cuda.is_available():
        count = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % count)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init(info: LaunchInfo, device: torch.device, timeout_s: int = 600, force_group: bool = False) -> Dist:
    """Start the process group (NCCL on GPUs, gloo on CPUs). A single process gets a 1-rank group only
    when `force_group` (FSDP on one device, e.g. for CPU offload); otherwise it trains without one.
    An XLA process has no group: it drives every device of its host itself (SPMD)."""
    if device.type == "xla":
        from shardlm.distributed import xla

        return Dist(info, device, xla.device_count())
    if dist.is_initialized() or (info.world_size == 1 and not force_group):
        return Dist(info, device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None  # None: init_process_group's default
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device_id)
        return Dist(info, device)
    for key, value in (("MASTER_ADDR", info.master_addr), ("MASTER_PORT", info.master_port),
                       ("RANK", info.rank), ("WORLD_SIZE", info.world_size), ("LOCAL_RANK", info.local_rank)):
        os.environ.setdefault(key, str(value))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return Dist(info, device)
    # Under torchrun restarts the agent's store outlives a failed attempt, and gloo can read the dead
    # attempt's peer addresses from it (seen: "Connection refused" in connectFullMesh after a restart).
    # A per-attempt key prefix keeps every attempt's rendezvous apart.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                        is_master=not agent_store and info.rank == 0, timeout=timeout,
                        multi_tenant=not agent_store)
    store = dist.PrefixStore(f"shardlm/attempt_{restart}", tcp)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout,
                            device_id=device_id)
    return Dist(info, device)


def record_failure(code: int) -> None:
    """Under torchrun, why this rank fails, in the error file torchrun reads back (TORCHELASTIC_ERROR_FILE, as
    torch's `@record` writes it): its failure report then names the cause. A shardlm error is its one line
    `error: ...` (the same on every rank that refuses); anything else, the exception and its traceback. Called
    while the failure is being handled (the CLI's `except`); nothing without torchrun or an exception."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    error = sys.exc_info()[1]
    if not path or code == 0 or not isinstance(error, Exception):
        return
    if isinstance(error, ShardlmError):
        info: dict[str, str] = {}
        message = f"error: {error}"
    else:
        message = f"{type(error).__name__}: {error}"
        info = {"py_callstack": traceback.format_exc()}
    data = {"message": {"message": message, "extraInfo": {**info, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError), open(path, "w") as f:  # best effort: the rank's own output said it already
        json.dump(data, f)


def shutdown(code: int = 0, before_exit: Callable[[], None] | None = None) -> None:
    """Tear the group down and leave at once; `before_exit` runs first (the CLI's: mark a crashed run's
    trackers finished, since os._exit skips atexit). A failure being handled is recorded for torchrun first
    (`record_failure`).

    A finished FSDP2 process can abort in interpreter teardown after destroy_process_group(); flushing
    and `os._exit` avoids that (measured: ~4% of exits abort otherwise), so multi-process runs are not flaky.
    """
    record_failure(code)
    if dist.is_initialized():
        if before_exit is not None:
            before_exit()
        with contextlib.suppress(Exception):  # best effort on the way out
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

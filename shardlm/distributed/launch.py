"""`shardlm train --nproc N`: torchrun on this node, with the user's terminal in mind.

Two processes stand between the user and the ranks. This one (the `shardlm` command) starts torchrun in a
session of its own, out of the terminal's reach, and forwards SIGINT/SIGTERM straight to the ranks: they
finish the step, save and exit 0, and so does everything above them. torchrun left to itself answers
Ctrl-C with a traceback, exit code 1 and SIGKILL for the ranks 30 s later, which would cut a large
model's save in half. A second signal stops torchrun itself.

The torchrun agent is `torch.distributed.run` itself, run by `main` below so a failed rank ends in one line
(the rank's own `error: ...` is already above it) instead of torchrun's 40-line failure report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path


def launch(nproc: int, max_restarts: int, train_args: list[str], debug: bool) -> int:
    warning = oversubscription_warning(nproc, cpu_cores(), lambda: on_cpu(train_args))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "shardlm.distributed.launch", "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts:
        cmd += [f"--max-restarts={max_restarts}"]
    cmd += ["-m", "shardlm", "train", *train_args] + (["--debug"] if debug else [])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if not debug and not max_restarts:  # with restarts, torchrun's notes on each attempt are worth reading
        env.setdefault("LOGLEVEL", "CRITICAL")  # torchrun's agent logs: its failure report, SIGTERM notices
    proc = subprocess.Popen(cmd, start_new_session=True, env=env,
                            preexec_fn=_term_with_parent if sys.platform.startswith("linux") else None)
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        ranks = child_pids(proc.pid)
        if len(received) > 1 or not ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            return
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0:  # torchrun itself was killed: its ranks must not outlive it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        print(f"error: torchrun was killed by {signal.Signals(-code).name}; checkpoints saved so far are intact, "
              "rerun the same command to resume.", file=sys.stderr, flush=True)
        return 1
    return code


def cpu_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def on_cpu(train_args: list[str]) -> bool:
    """Whether the ranks will train on the CPU: parallel.device as the run resolves it (auto: no CUDA GPU)."""
    from shardlm.config import load_config, split_args

    config, overrides = split_args([a for a in train_args if not a.startswith("--")])
    device = load_config(config, overrides).parallel.device
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def oversubscription_warning(nproc: int, cores: int, cpu_ranks) -> str | None:
    """More CPU ranks than cores: they take turns on the cores and every collective waits for the one
    descheduled, so the run is usually slower than with fewer ranks, and nothing said so. `cpu_ranks()` is
    only asked when it matters (it imports torch)."""
    if nproc <= cores or not cpu_ranks():
        return None
    return (f"warning: --nproc {nproc} starts {nproc} CPU ranks on {cores} CPU core{'s' * (cores != 1)}: the ranks "
            "take turns on the cores and each step waits for the slowest, which usually makes the run slower than "
            f"with fewer ranks; use --nproc {cores} or fewer.")


def _term_with_parent() -> None:
    """torchrun runs in its own session (Ctrl-C reaches the ranks through `forward`, once); should this process
    be killed outright (kill -9), the kernel sends torchrun SIGTERM, so the ranks save and stop instead of
    training on, orphaned, into the same out_dir as the user's next run."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _parents() -> dict[int, int]:
    """Each process id -> its parent's (Linux /proc; empty elsewhere, where signals go to the group)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    return parents


def child_pids(pid: int) -> list[int]:
    """Process ids whose parent is `pid`."""
    return [child for child, parent in _parents().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (its children, theirs, ...), parents before their children; empty where there
    is no /proc. A snapshot to signal afterwards: a process whose parent dies is re-parented, out of the tree.
    torchrun's ranks start sessions of their own, so killing a tree takes this, not a process group."""
    parents = _parents()  # one read of /proc for the whole tree
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        kids = [k for k, p in parents.items() if p == parent and k != pid and k not in found]
        found += kids
        todo += kids
    return found


def main(argv: list[str]) -> int:
    """torchrun's own `run`; a failed rank becomes one line and that rank's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if os.environ.get("LOGLEVEL") == "CRITICAL":  # not every elastic logger reads LOGLEVEL
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except SignalException as e:  # torchrun itself signalled (its parent died, a scheduler): it stopped the ranks
        print(f"error: torchrun got {signal.Signals(e.sigval).name} and stopped the ranks (on SIGTERM they save "
              "first); rerun the same command to resume.", file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as e:
        if any(f.exitcode == 2 for f in e.failures.values()):  # a shardlm error, printed by its rank; the other
            return 2                                            # ranks were torn down after it, not the cause
        killed = {r: f for r, f in e.failures.items() if f.exitcode < 0}  # the others died of broken collectives
        rank, failure = min(killed.items(), key=lambda kv: kv[1].timestamp) if killed else e.get_first_failure()
        if failure.exitcode < 0:
            print(f"error: rank {rank} was killed by {failure.signal_name()} (out of memory, or killed by the "
                  "job scheduler?). Checkpoints saved so far are intact; rerun the same command to resume.",
                  file=sys.stderr, flush=True)
            return 1
        if failure.exitcode != 2:  # 2: a shardlm error, already printed by rank 0
            print(f"error: rank {rank} failed with exit code {failure.exitcode} (its output is above).",
                  file=sys.stderr, flush=True)
        return failure.exitcode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

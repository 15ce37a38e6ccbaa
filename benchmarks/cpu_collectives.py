"""gloo's collectives on CPU ranks, timed side by side: its reduce_scatter_tensor against shardlm's CPU reduce-scatter
(shardlm/distributed/cpu_comms.py) and the two ways it picks from (all_to_all_single and a sum; all_reduce of the
whole input), and all_gather_into_tensor, for FSDP2-like sizes. Prints one JSON object.

    python benchmarks/cpu_collectives.py [--ranks 2] [--sizes N,N,...] [--iters 20] [--out FILE]

A size is the values each rank keeps (a reduce-scatter's output; its input is ranks x that), fp32, one thread a rank.
Each figure is the median of --iters calls after 3 warm-up calls, every rank starting together (a barrier).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def timed(fn, iters: int) -> float:
    import torch.distributed as dist

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 3)


def one_size(n: int, iters: int) -> dict:
    """The collectives on `n` values a rank (ranks x n in), and whether shardlm's result is gloo's."""
    import torch
    import torch.distributed as dist

    from shardlm.distributed.cpu_comms import CpuReduceScatter

    ranks, comm, world, total = dist.get_world_size(), CpuReduceScatter(), dist.group.WORLD, dist.ReduceOp.SUM
    x, out, full = torch.randn(ranks * n), torch.empty(n), torch.empty(ranks * n)
    comm(out, x.clone(), world, total)  # the comm may reduce its input in place
    ours = out.clone()
    dist.reduce_scatter_tensor(out, x.clone())
    same = bool(torch.allclose(ours, out, rtol=1e-6, atol=1e-6))

    def all_to_all_and_sum() -> None:  # its buffer made per call, as a comm must unless it keeps one
        received = torch.empty_like(x)
        dist.all_to_all_single(received, x)
        torch.sum(received.view(ranks, n), dim=0, out=out)

    return {"reduce_scatter_tensor_ms": timed(lambda: dist.reduce_scatter_tensor(out, x), iters),
            "shardlm_ms": timed(lambda: comm(out, x, world, total), iters),
            "all_to_all_and_sum_ms": timed(all_to_all_and_sum, iters),
            "all_reduce_whole_ms": timed(lambda: dist.all_reduce(x), iters),
            "all_gather_into_tensor_ms": timed(lambda: dist.all_gather_into_tensor(full, out), iters),
            "same_result": same}


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = {n: one_size(n, args.iters) for n in map(int, args.sizes.split(","))}
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="150000,600000,2000000,5000000,20000000")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--result", help=argparse.SUPPRESS)  # set for the ranks: where rank 0 writes its rows
    args = ap.parse_args()
    if args.result:
        return rank_main(args)
    import tempfile

    import torch
    from common import ROOT, cpu_name, emit

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
               __file__, "--sizes", args.sizes, "--iters", str(args.iters), "--result", str(result)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        rows = json.loads(result.read_text())
    for row in rows.values():
        row["speedup"] = round(row["reduce_scatter_tensor_ms"] / row["shardlm_ms"], 2)
    emit({"benchmark": "cpu_collectives", "command": " ".join(["python", "benchmarks/cpu_collectives.py",
                                                                 *sys.argv[1:]]),
          "ranks": args.ranks, "values_per_rank": rows, "dtype": "float32",
          "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "omp_num_threads": 1}},
         args.out)


if __name__ == "__main__":
    main()

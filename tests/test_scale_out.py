"""Scale-out: an MPI-style launch posing as 2 nodes x 2 ranks (hybrid sharding), a rank killed under
torchrun --max-restarts, and non-finite steps skipped and counted."""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from faults import fault

from helpers import losses, records, shardlm_cli, tiny


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single(corpus, cache_dir, tmp_path_factory) -> list[float]:
    """Losses of the one-process run both launch tests must reproduce."""
    out = tmp_path_factory.mktemp("single")
    shardlm_cli(["train", *tiny(corpus, cache_dir, out)])
    return losses(out)


def test_dead_rank_restarts_resumes_and_matches(corpus, cache_dir, tmp_path):
    args = tiny(corpus, cache_dir, tmp_path / "x", **{"train.batch_size": 4, "train.max_steps": 12,
                                                       "checkpoint.every": 4, "parallel.timeout_s": 30})
    ref = tmp_path / "ref"
    shardlm_cli(["train", *[a if not a.startswith("out_dir=") else f"out_dir={ref}" for a in args]], nproc=2)
    began = time.time()
    proc = shardlm_cli(["train", "--nproc", "2", "--max-restarts", "1", *args, fault("DieAt(6, 1)")])
    wall = time.time() - began
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout
    assert losses(tmp_path / "x")[-1] == losses(ref)[-1]
    print(f"fault-tolerance run wall time: {wall:.1f}s")


@pytest.mark.cuda
def test_non_finite_steps_are_skipped_and_counted(corpus, cache_dir, tmp_path):
    shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path), fault("NanSteps(3, 4)")])
    rec = records(tmp_path)
    assert [r["skipped_steps"] for r in rec] == [0, 0, 1, 2, 2, 2, 2, 2, 2, 2]
    assert all(r["loss"] is not None for r in rec)


def test_too_many_bad_steps_stop_with_a_clear_error(corpus, cache_dir, tmp_path):
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_bad_steps": 2,
                                                                        "checkpoint.every": 2}),
                        fault("NanSteps(5, 6)")], check=False)
    assert proc.returncode == 2
    assert "2 consecutive steps had a non-finite loss" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "checkpoints" / "step_000000004" / "manifest.json").is_file()  # last good one kept


def test_mpi_style_launch_two_nodes_hybrid(single, corpus, cache_dir, tmp_path):
    out = tmp_path / "hybrid"
    port = str(free_port())
    procs = []
    for rank in range(4):  # what mpiexec -n 4 --npernode 2 sets (OpenMPI names)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_COMM_WORLD_RANK": str(rank),
               "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 2),
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmd = [sys.executable, "-m", "shardlm", "train",
               *tiny(corpus, cache_dir, out, **{"train.batch_size": 2, "parallel.sharding": "hybrid_full"})]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert "mpi launch: 4 rank(s) on 2 node(s)" in outputs[0][0] and "mesh (2, 2)" in outputs[0][0]
    assert losses(out) == pytest.approx(single, rel=1e-4)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec (CI installs Debian's mpich)")
def test_real_mpiexec_launch_matches_one_process(single, corpus, cache_dir, tmp_path):
    """A real `mpiexec -n 2` (MPICH/hydra sets PMI_RANK, PMI_SIZE, MPI_LOCALRANKID): detected, trained, same losses."""
    out = tmp_path / "mpi"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [shutil.which("mpiexec"), "-n", "2", sys.executable, "-m", "shardlm", "train",
           *tiny(corpus, cache_dir, out, **{"train.batch_size": 4})]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpi launch: 2 rank(s) on 1 node(s)" in proc.stdout
    assert losses(out) == pytest.approx(single, rel=1e-4)

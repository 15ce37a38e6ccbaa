"""Launcher detection from the environments torchrun, SLURM and MPI launchers set; `shardlm train --nproc N`:
more CPU ranks than cores warn, and Ctrl-C saves and exits 0."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import kill_tree, records, tiny
from shardlm import ShardlmError
from shardlm.checkpoint.layout import newest_complete
from shardlm.distributed.process_group import detect_launch, expand_nodelist


def test_nothing_set_is_single():
    assert detect_launch({}).launcher == "single"


def test_torchrun_multi_node():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.num_nodes) == ("torchrun", 5, 8, 1, 2)
    assert (info.master_addr, info.master_port) == ("n0", 29400)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu5", ["gpu5"]),
    ("a[1-2],b[09-10]", ["a1", "a2", "b09", "b10"]),
    ("rack1-n[8-9]-ib", ["rack1-n8-ib", "rack1-n9-ib"]),
])
def test_slurm_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_slurm_srun_task():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "node[01-03,07]", "SLURM_JOB_ID": "12345"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == \
        ("slurm", 6, 8, 2, 4)
    assert info.master_addr == "node01" and info.master_port == 20000 + 12345 % 20000


def test_openmpi(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x3005c0s13b0n0.hsn\nx3005c0s13b0n0.hsn\nx3005c0s19b1n0.hsn\n")
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PBS_NODEFILE": str(nodefile)}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.num_nodes) == ("mpi", 3, 4, 1, 2)
    assert info.master_addr == "x3005c0s13b0n0.hsn"


def test_mpich_pmi_and_pals():
    assert detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}).rank == 1
    pals = detect_launch({"PALS_RANKID": "7", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "3", "PALS_LOCAL_SIZE": "4"})
    assert (pals.rank, pals.world_size, pals.local_rank, pals.num_nodes) == (7, 8, 3, 2)


def test_forced_launcher_overrides_detection():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    assert detect_launch(env, "single").launcher == "single"
    with pytest.raises(ShardlmError, match="mpiexec"):
        detect_launch({}, "mpi")


def test_launch_rank_reads_the_launchers_variable_without_resolving_the_launch():
    from shardlm.distributed.process_group import launch_rank

    assert launch_rank({}) == 0 and launch_rank({"RANK": "3"}) == 3 and launch_rank({"SLURM_PROCID": "1"}) == 1
    assert launch_rank({"OMPI_COMM_WORLD_RANK": "2"}) == 2 and launch_rank({"PMI_RANK": "5"}) == 5


def test_more_cpu_ranks_than_cores_is_a_warning():
    from shardlm.distributed.launch import oversubscription_warning

    def never():
        raise AssertionError("the device is only asked about when the ranks outnumber the cores")

    assert oversubscription_warning(4, 2, lambda: True) == (
        "warning: --nproc 4 starts 4 CPU ranks on 2 CPU cores: the ranks take turns on the cores and each step "
        "waits for the slowest, which usually makes the run slower than with fewer ranks; use --nproc 2 or fewer.")
    assert oversubscription_warning(2, 2, never) is None
    assert oversubscription_warning(8, 2, lambda: False) is None  # GPU ranks: one core each is not the limit


def test_nproc_above_the_cores_warns_before_launching(monkeypatch, capfd, tmp_path):
    from shardlm.cli import main
    from shardlm.distributed import launch

    monkeypatch.setattr(launch, "cpu_cores", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as done:  # a missing file: the ranks fail at once, after the warning
        main(["train", "--nproc", "2", "data.train=/missing.txt", f"out_dir={tmp_path / 'run'}"])
    err = capfd.readouterr().err
    assert done.value.code == 2 and err.startswith("warning: --nproc 2 starts 2 CPU ranks on 1 CPU core:"), err


def test_ctrl_c_under_nproc_saves_and_exits_zero_with_one_line(corpus, cache_dir, tmp_path):
    """The user's path: `shardlm train --nproc 2`, Ctrl-C (SIGINT to the terminal's process group)."""
    cmd = [sys.executable, "-m", "shardlm", "train", "--nproc", "2",
           *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 100000})]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "metrics.jsonl").exists() or len(records(tmp_path)) < 2:
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "SignalException" not in out
    step = json.loads((newest_complete(tmp_path / "checkpoints") / "trainer_state.json").read_text())["step"]
    assert f"saved step {step} to" in out and "rerun the same command to resume" in out

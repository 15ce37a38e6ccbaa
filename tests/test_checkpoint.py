"""Checkpoints: exact resume after kill -9 (after a save and during one), SIGTERM under 2 ranks, retention, torn
checkpoints, `shardlm resume`; a full disk while saving keeps the earlier checkpoints. Other world sizes, a real
SIGTERM, async saves and extended runs are in tests/test_checkpoint_resume.py (a file each, so that
`pytest --dist loadfile` runs them side by side)."""

import json
import os
import shutil
import subprocess
import time

import pytest
from faults import fault

from helpers import by_step, kill_tree, python_cmd, records, shardlm_cli, tiny
from shardlm import ShardlmError
from shardlm.checkpoint.layout import is_complete, list_checkpoints, newest_complete
from shardlm.config import load_config

STEPS = 12


def ckpt_args(corpus, cache_dir, out, batch=4, **extra):
    return ["train", *tiny(corpus, cache_dir, out, **{"train.batch_size": batch, "train.max_steps": STEPS,
                                                      "checkpoint.every": 4, "model.dropout": 0.1, **extra})]


@pytest.fixture(scope="module")
def reference(corpus, cache_dir, tmp_path_factory):
    """The uninterrupted 2-rank run, saving asynchronously (its collectives once hung against the step's)."""
    out = tmp_path_factory.mktemp("reference")
    shardlm_cli(ckpt_args(corpus, cache_dir, out, **{"checkpoint.async": True, "parallel.timeout_s": 60}), nproc=2)
    assert [p.name for p in list_checkpoints(out)][:2] == ["step_000000012", "step_000000008"]
    return by_step(out)


def test_kill_after_save_resumes_bit_exact(reference, corpus, cache_dir, tmp_path):
    proc = shardlm_cli([*ckpt_args(corpus, cache_dir, tmp_path), fault("KillAfterSave(8)")], nproc=2, check=False)
    assert proc.returncode != 0
    assert max(by_step(tmp_path)) == 8
    resumed = shardlm_cli(ckpt_args(corpus, cache_dir, tmp_path), nproc=2)
    assert "resumed from" in resumed.stdout and "step 8" in resumed.stdout
    assert by_step(tmp_path) == reference  # bit for bit, every step


def test_kill_during_save_falls_back_and_resumes_exact(reference, corpus, cache_dir, tmp_path):
    cmd = python_cmd("-m", "shardlm", *ckpt_args(corpus, cache_dir, tmp_path), fault("PauseInSave(8)"), nproc=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    while not (tmp_path / "paused_in_save").exists():
        assert time.time() < deadline and proc.poll() is None, "run never reached the save"
        time.sleep(0.2)
    kill_tree(proc.pid)
    proc.wait()
    torn = tmp_path / "checkpoints" / "step_000000008.tmp"
    assert torn.is_dir() and not (torn / "manifest.json").exists()
    assert newest_complete(tmp_path, log=lambda _: None).name == "step_000000004"
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 9, "spl')  # a record the kill cut short
    resumed = shardlm_cli(ckpt_args(corpus, cache_dir, tmp_path), nproc=2)
    assert by_step(tmp_path) == reference
    assert not torn.exists()  # the stale temporary folder is cleaned up
    # the killed attempt's records of steps 5-8 (trained again) are moved aside: one record per step
    assert [r["step"] for r in records(tmp_path)] == list(range(1, STEPS + 1))
    aside = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in aside[:-1]] == [5, 6, 7, 8] and aside[-1] == '{"step": 9, "spl'
    assert "metrics.jsonl: 4 records of steps 5-8 and a line cut short by a kill, written after step 4" \
        in resumed.stdout, resumed.stdout


def test_retention_and_torn_newest(corpus, cache_dir, tmp_path):
    """... and a resume trains with this invocation's train.lr (the saved optimizer and schedule held the old)."""
    flat = {"train.min_lr_ratio": 1.0}  # constant after warmup: the logged lr is train.lr
    shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"checkpoint.every": 2, "checkpoint.keep": 2, **flat})])
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_000000010", "step_000000008"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000000010"
    (tmp_path / "checkpoints" / "step_000000010" / ".metadata").write_bytes(b"garbage")
    assert "unreadable metadata" in is_complete(tmp_path / "checkpoints" / "step_000000010")
    logs = []
    assert newest_complete(tmp_path, log=logs.append).name == "step_000000008"
    assert "skipping checkpoint step_000000010" in logs[0]
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 12, "train.lr": 1e-3,
                                                                      **flat})])
    assert "resumed from" in proc.stdout and "step_000000008" in proc.stdout
    assert "train.lr 0.003 -> 0.001" in proc.stdout
    # the lr each step ran with: warmup's half at step 1, the saved 3e-3 up to the resume, then the new 1e-3
    assert {r["step"]: r["lr"] for r in records(tmp_path)} == {1: 1.5e-3, **{s: 3e-3 if s <= 8 else 1e-3
                                                                            for s in range(2, 13)}}


def test_sigterm_saves_exits_zero_and_resumes_exact(reference, corpus, cache_dir, tmp_path):
    """The reference saves every 4 steps, this run only on SIGTERM: saving never changes what is trained."""
    args = ckpt_args(corpus, cache_dir, tmp_path, **{"checkpoint.every": 0})
    # SIGTERM reaches rank 0 only: both ranks must still stop after the same step
    proc = shardlm_cli([*args, fault("SigtermAt(5)")], nproc=2)
    assert proc.returncode == 0 and "received SIGTERM" in proc.stdout
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000000005"]
    shardlm_cli(args, nproc=2)
    assert by_step(tmp_path) == reference


def test_resume_continues_a_run_from_its_saved_config(corpus, cache_dir, tmp_path):
    """`shardlm resume RUN_DIR` (and `shardlm train RUN_DIR`) needs none of the run's overrides repeated (here a
    model shape that differs from the defaults): only what is given on top is a change."""
    run, empty = tmp_path / "run", tmp_path / "empty"
    shardlm_cli(["train", *tiny(corpus, cache_dir, run, **{"train.max_steps": 4})])
    out = shardlm_cli(["resume", str(run), "train.max_steps=6"]).stdout
    assert "resumed from" in out and "step 4" in out
    assert "config changed since the last invocation (previous kept as config.1.yaml): train.max_steps 4 -> 6." in out
    assert "shardlm resume" not in out  # no hint to do what was just done
    out = shardlm_cli(["train", str(run / "checkpoints" / "step_000000004"), "train.max_steps=6"]).stdout
    assert "resumed from" in out and "step_000000004" in out and sorted(by_step(run)) == list(range(1, 7))
    shutil.copytree(run, empty, ignore=shutil.ignore_patterns("checkpoints"))
    proc = shardlm_cli(["resume", str(empty)], check=False)
    assert proc.returncode == 2 and f"error: no complete checkpoint in '{empty}' (it has none)" in proc.stderr
    assert "checkpoint.resume=none" in proc.stderr
    proc = shardlm_cli(["resume", str(tmp_path / "rum")], check=False)
    assert proc.returncode == 2 and f"'{tmp_path / 'rum'}' does not exist. Did you mean '{run}'?" in proc.stderr
    proc = shardlm_cli(["resume", str(tmp_path)], check=False)
    assert proc.returncode == 2 and "is not a run folder (no config.yaml in it)." in proc.stderr
    proc = shardlm_cli(["eval", str(run / "checkpoints" / "step_4")], check=False)
    assert "does not exist. That folder holds step_000000006, step_000000004. Give" in proc.stderr, proc.stderr
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, empty, **{"checkpoint.resume": tmp_path / "gone"})],
                       check=False)
    assert proc.returncode == 2 and f"checkpoint path '{tmp_path / 'gone'}' does not exist. Give a run dir" in \
        proc.stderr and "checkpoint.resume=none starts fresh" in proc.stderr


def test_disk_full_while_saving_keeps_earlier_checkpoints(corpus, cache_dir, tmp_path, monkeypatch):
    from shardlm.checkpoint import checkpointer as ckpt_mod
    from shardlm.runner import train

    cfg = load_config(None, tiny(corpus, cache_dir, tmp_path, **{"checkpoint.every": 2, "train.max_steps": 6}))
    real_save, calls = ckpt_mod.dcp.save, []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod.dcp, "save", full_disk)
    with pytest.raises(ShardlmError, match="No space left on device.*intact"):
        train(cfg)
    assert (tmp_path / "checkpoints" / "step_000000002" / "manifest.json").is_file()

"""Checkpoints, part two (tests/test_checkpoint.py has the kills, SIGTERM under 2 ranks, retention, torn and full-disk
saves, `shardlm resume`; a file each so that `pytest --dist loadfile` runs them side by side): a resume on another
world size, a real SIGTERM, async saves, changed data, and a run extended without a learning-rate jump."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed.checkpoint as dcp
from faults import fault
from test_checkpoint import ckpt_args

from helpers import by_step, records, shardlm_cli, tiny
from shardlm.checkpoint.layout import is_complete, list_checkpoints

NO_DROPOUT = {"model.dropout": 0.0}


@pytest.fixture(scope="module")
def killed_without_dropout(corpus, cache_dir, tmp_path_factory):
    """Without dropout (its masks depend on the rank layout): the uninterrupted 2-rank run's losses, and the run
    folder of one killed right after its step-8 save (each world size resumes a copy of it)."""
    ref, killed = tmp_path_factory.mktemp("reference-no-dropout"), tmp_path_factory.mktemp("killed-no-dropout")
    shardlm_cli(ckpt_args(corpus, cache_dir, ref, **NO_DROPOUT), nproc=2)
    shardlm_cli([*ckpt_args(corpus, cache_dir, killed, **NO_DROPOUT), fault("KillAfterSave(8)")], nproc=2,
                check=False)
    return by_step(ref), killed


@pytest.mark.parametrize("nproc", [1, 4])
def test_resume_on_another_world_size(killed_without_dropout, corpus, cache_dir, tmp_path, nproc):
    reference, killed = killed_without_dropout
    saved = dcp.FileSystemReader(str(killed / "checkpoints" / "step_000000008")).read_metadata().state_dict_metadata
    assert "model.hf.transformer.wte.weight" in saved and "model.hf.lm_head.weight" not in saved  # tied: stored once
    shutil.copytree(killed, tmp_path, dirs_exist_ok=True)
    shardlm_cli(ckpt_args(corpus, cache_dir, tmp_path, batch=8 // nproc, **NO_DROPOUT), nproc=nproc if nproc > 1 else 0)
    got = by_step(tmp_path)
    assert sorted(got) == sorted(reference)
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), step


@pytest.mark.cuda
def test_real_sigterm_single_process(corpus, cache_dir, tmp_path):
    cmd = [sys.executable, "-m", "shardlm", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 100000})]
    cmd.insert(3, "train")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "metrics.jsonl").exists() or len(records(tmp_path)) < 3:
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    saved = list_checkpoints(tmp_path)
    assert len(saved) == 1 and is_complete(saved[0]) is None
    assert json.loads((saved[0] / "trainer_state.json").read_text())["step"] == max(by_step(tmp_path))


def test_resume_onto_changed_data_says_so(corpus, cache_dir, tmp_path, capsys):
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    trainer = Trainer.from_config(load_config(None, tiny(corpus, cache_dir, tmp_path)))
    state = trainer.state_dict()
    trainer.load_state_dict(state)
    assert "data changed" not in capsys.readouterr().out
    trainer.load_state_dict({**state, "data_blocks": [state["data_blocks"][0] - 5, state["data_blocks"][1]]})
    assert "note: the data changed since this checkpoint" in capsys.readouterr().out


def test_raising_max_steps_on_resume_keeps_the_learning_rate_continuous(corpus, cache_dir, tmp_path):
    """Extending a run (train.max_steps 10 -> 20 after a stop at step 5) continues the decay from the rate it had
    reached instead of stretching the cosine (the rate jumped back up); a later resume keeps the same curve."""
    from shardlm.training.schedule import WarmupCosine

    def args(steps, *extra):
        return ["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": steps, "train.min_lr_ratio": 0.1}),
                *extra]

    shardlm_cli(args(10, fault("SigtermAt(5)")))
    extended = shardlm_cli(args(20, fault("SigtermAt(12)"))).stdout
    assert "the run's end moved from step 10 to 20: the learning rate continues from its value at step 5" in extended
    shardlm_cli(args(20))
    lr = {r["step"]: r["lr"] for r in records(tmp_path)}
    schedule = WarmupCosine(2, 10, 0.1)
    expected = {s: 3e-3 * schedule(s - 1) for s in range(1, 6)}
    schedule.configure(WarmupCosine(2, 20, 0.1), 5)
    assert schedule.describe() == f"cosine to 0.1 x lr at step 20, the end moved: continued from {schedule(5):.3g} x " \
                                  "lr at step 5"  # the header says what the note says
    assert "schedule: cosine to 0.1 x lr at step 20, the end moved: continued from" in extended
    expected.update({s: 3e-3 * schedule(s - 1) for s in range(6, 21)})
    assert lr == pytest.approx(expected, rel=1e-6)
    assert all(lr[s + 1] <= lr[s] for s in range(2, 20)) and lr[20] < lr[6] < lr[5]
    assert lr[6] < 3e-3 * WarmupCosine(2, 20, 0.1)(5)  # below the stretched cosine, which rose again
    ended = WarmupCosine(2, 10, 0.1)
    ended.configure(WarmupCosine(2, 20, 0.1), 10)  # a finished run extended: it stays at its floor
    assert ended.describe() == "cosine, the end moved: at its floor 0.1 x lr from step 10 to step 20"


@pytest.mark.cuda
def test_async_checkpoints_are_complete_and_resume(corpus, cache_dir, tmp_path):
    args = tiny(corpus, cache_dir, tmp_path, **{"checkpoint.async": True, "checkpoint.every": 2,
                                                "train.max_steps": 6})
    shardlm_cli(["train", *args])
    saved = list_checkpoints(tmp_path)
    assert [p.name for p in saved] == ["step_000000006", "step_000000004"]
    assert all(is_complete(p) is None for p in saved)
    assert json.loads((saved[0] / "trainer_state.json").read_text())["step"] == 6
    more = tiny(corpus, cache_dir, tmp_path, **{"checkpoint.async": True, "checkpoint.every": 2, "train.max_steps": 8})
    proc = shardlm_cli(["train", *more])
    assert "resumed from" in proc.stdout and max(r["step"] for r in records(tmp_path)) == 8

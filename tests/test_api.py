"""The Python API (docs/api.md): the page's example runs as written, and its calls mean what the commands mean."""

import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT, SHAKESPEARE


def test_the_api_page_example_runs_as_written(tmp_path):
    code = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)[0]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "SHARDLM_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert any(line.startswith("10 ") for line in out), out  # 10 steps trained, and the final val loss
    assert any(line.startswith("ROMEO:") for line in out), out  # the greedy continuation
    metrics = next(line for line in out if line.startswith("{") and "'ppl'" in line)  # shardlm.evaluate's dict
    assert "'loss'" in metrics and "'accuracy'" in metrics


def test_api_overrides_keep_python_types_and_reach_what_the_command_reaches(tmp_path):
    import shardlm

    cfg = shardlm.configure("shakespeare_tiny", {"train.lr": 1e-3, "data.train": str(SHAKESPEARE)},
                         train__batch_size=4, out_dir=tmp_path / "x")
    assert (cfg.train.lr, cfg.train.batch_size, cfg.out_dir) == (1e-3, 4, str(tmp_path / "x"))
    assert shardlm.configure(cfg, train__batch_size=2).train.lr == 1e-3  # a Config as the source
    with pytest.raises(shardlm.ShardlmError, match="unknown config key 'train.batchsize'"):
        shardlm.configure(None, train__batchsize=4)
    assert shardlm.Trainer.__name__ == "Trainer"

"""Shared helpers: a tiny corpus and config, and runners for in-process and torchrun training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT / "shardlm" / "assets" / "tinyshakespeare" / "input.txt"
_device = "cpu"  # parallel.device of tiny(): "auto" (CUDA when present) while a @pytest.mark.cuda test runs


@pytest.fixture(autouse=True)
def _device_of_the_test(request):
    """Tests run on CPU (gloo) even on a GPU machine: tiny() pins parallel.device=cpu and the processes that
    shardlm_cli starts see no GPU. Single-process tests marked `@pytest.mark.cuda` run on CUDA where there
    is one (`pytest -m cuda`, the `tests` stage of benchmarks/gpu_check.py)."""
    global _device
    _device = "auto" if request.node.get_closest_marker("cuda") else "cpu"
    import torch

    precision = torch.get_float32_matmul_precision()  # building a run on CUDA turns TF32 on for the process
    yield
    torch.set_float32_matmul_precision(precision)
    _device = "cpu"


def on_cuda() -> bool:
    """Inside a @pytest.mark.cuda test on a machine with a GPU."""
    import torch

    return _device == "auto" and torch.cuda.is_available()


def fp32_tol(cpu: float) -> float:
    """Tolerance of an fp32 comparison: `cpu` on CPU; 2e-3 on CUDA, where shardlm runs fp32 matmuls in TF32."""
    return 2e-3 if on_cuda() else cpu


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "shakespeare_small.txt"
    path.write_text(SHAKESPEARE.read_text()[:60_000])
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")


def tiny(corpus: Path, cache_dir: Path, out_dir: Path, **extra) -> list[str]:
    """Overrides for a ~40K-parameter byte-level GPT that trains in seconds (eager; on CPU unless the test is
    marked cuda)."""
    values = {
        "data.train": corpus, "data.cache_dir": cache_dir, "out_dir": out_dir,
        "model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2, "model.n_positions": 64,
        "data.seq_len": 32, "train.batch_size": 8, "train.max_steps": 10, "train.log_every": 1,
        "train.eval_every": 0, "train.eval_batches": 4, "train.warmup_steps": 2, "train.lr": 3e-3,
        "train.sample_tokens": 0, "log.tensorboard": False, "log.progress": "lines",
        "parallel.device": _device, "parallel.compile": "false",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def byte_gpt2_config(**overrides):
    """A tiny GPT-2 config over the byte vocabulary (256 bytes + EOS id 256)."""
    from transformers import GPT2Config

    return GPT2Config(**{"vocab_size": 257, "n_positions": 64, "n_layer": 1, "n_embd": 8, "n_head": 1,
                         "bos_token_id": 256, "eos_token_id": 256, **overrides})


def shardlm_cli(args: list[str], nproc: int = 0, env: dict | None = None, timeout: int = 300,
                check: bool = True, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "shardlm", *args]
    else:
        cmd = [sys.executable, "-m", "shardlm", *args]
    hide_gpus = {} if _device == "auto" else {"CUDA_VISIBLE_DEVICES": ""}
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **hide_gpus, **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def records(out_dir: Path, split: str = "train") -> list[dict]:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in records(out_dir)]

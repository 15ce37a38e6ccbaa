"""Shared helpers of the tests: a tiny config, the torchrun command line, and runners of the CLI.
Fixtures and pytest hooks are in conftest.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from shardlm.distributed.launch import descendants

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT / "shardlm" / "assets" / "tinyshakespeare" / "input.txt"
_device = "cpu"  # parallel.device of tiny(): "auto" (CUDA when present) while a @pytest.mark.cuda test runs (conftest)


def on_cuda() -> bool:
    """Inside a @pytest.mark.cuda test on a machine with a GPU."""
    import torch

    return _device == "auto" and torch.cuda.is_available()


def fp32_tol(cpu: float) -> float:
    """Tolerance of an fp32 comparison: `cpu` on CPU; 2e-3 on CUDA, where shardlm runs fp32 matmuls in TF32."""
    return 2e-3 if on_cuda() else cpu


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


def python_cmd(*args: str, nproc: int = 0) -> list[str]:
    """The command line of `python ARGS`; with nproc > 1, under torchrun with that many ranks on this machine:
    `python -m torch.distributed.run --standalone --nproc-per-node=NPROC ARGS` (ARGS: a script or `-m MODULE`)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [sys.executable, *launcher, *args]


def shardlm_cli(args: list[str], nproc: int = 0, env: dict | None = None, timeout: int = 300,
                check: bool = True, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m shardlm ARGS` (under torchrun with nproc > 1), seeing no GPU unless the test is marked cuda."""
    cmd = python_cmd("-m", "shardlm", *args, nproc=nproc)
    hide_gpus = {} if _device == "auto" else {"CUDA_VISIBLE_DEVICES": ""}
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **hide_gpus, **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process below it (torchrun's ranks start sessions of their own)."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def records(out_dir: Path, split: str = "train") -> list[dict]:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in records(out_dir)]


def save_hf_folder(model, folder: Path) -> Path:
    """A local Hugging Face folder (the model and shardlm's byte tokenizer), as a hub download would give."""
    from shardlm.tokenizer import byte_tokenizer

    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder

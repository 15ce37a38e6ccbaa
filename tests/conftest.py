"""Fixtures and hooks: a tiny corpus, its token cache, a tiny Hugging Face folder, LoRA bases and runs, and the
device of each test. Helpers are in helpers.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import helpers
from helpers import (
    SHAKESPEARE,
    byte_gpt2_config,
    folder_digest,
    lora_args,
    save_hf_folder,
    save_lora_base,
    train_in_process,
)


@pytest.fixture(autouse=True)
def _device_of_the_test(request):
    """Tests run on CPU (gloo) even on a GPU machine: tiny() pins parallel.device=cpu and the processes that
    shardlm_cli starts see no GPU. Single-process tests marked `@pytest.mark.cuda` run on CUDA where there
    is one (`pytest -m cuda`, the `tests` stage of benchmarks/gpu_check.py)."""
    helpers._device = "auto" if request.node.get_closest_marker("cuda") else "cpu"
    import torch

    precision = torch.get_float32_matmul_precision()  # building a run on CUDA turns TF32 on for the process
    yield
    torch.set_float32_matmul_precision(precision)
    helpers._device = "cpu"


@pytest.fixture(scope="session", autouse=True)
def _own_session_folder(tmp_path_factory):
    """The session's and modules' fixtures (reference runs, bases) run outside the checkout too: before any
    test's own folder exists, in one of the session's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("session-cwd"))
        yield


@pytest.fixture(autouse=True)
def _own_folder(tmp_path_factory, monkeypatch):
    """Each test runs in an empty folder of its own, so what the checkout holds (a `runs/` made by `make demo`, a
    local file named like a config or a model) never changes what a relative path means, and nothing a test
    writes by a relative path lands in the checkout. A test that needs the checkout names it (helpers.ROOT)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "shakespeare_small.txt"
    path.write_text(SHAKESPEARE.read_text()[:60_000])
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")


RL_REWARDS = '''
def low_ids(completion_ids, **_):
    """The share of a completion's tokens below 64: a rule a tiny random model can learn (chance is ~1/4)."""
    return [sum(t < 64 for t in c) / max(len(c), 1) for c in completion_ids]
'''


@pytest.fixture(scope="session")
def rl_data(tmp_path_factory) -> tuple[Path, str]:
    """Online RL's tiny task (test_grpo_training, test_vllm): 64 text prompts with an `answer` each, and a reward
    module; (prompts file, grpo.rewards). Read only."""
    import json
    import random

    folder = tmp_path_factory.mktemp("rl")
    rng = random.Random(0)
    lines = [json.dumps({"prompt": "".join(rng.choice("bcdefg") for _ in range(rng.randint(2, 5))) + ":",
                         "answer": "aaa"}) for _ in range(64)]
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "rewards.py").write_text(RL_REWARDS)
    return folder / "prompts.jsonl", f"[{folder / 'rewards.py'}:low_ids]"


@pytest.fixture
def hf_folder(tmp_path) -> Path:
    """A local Hugging Face folder, as `shardlm export` or a hub download gives: a 1-layer byte-level GPT-2 with
    32 positions (seeded) and the byte tokenizer."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return save_hf_folder(GPT2LMHeadModel(byte_gpt2_config(n_positions=32)), tmp_path / "hf")


@pytest.fixture
def keep_signal_handlers():
    """In-process runs install shardlm's SIGTERM/SIGINT handlers: give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture(scope="session")
def lora_bases(tmp_path_factory) -> tuple[dict[str, Path], dict[str, str]]:
    """Pretrained folders to put adapters on (llama, llama_other: another seed, gpt2) and their digests."""
    root = tmp_path_factory.mktemp("lora-bases")
    folders = {name: save_lora_base(root / name, family, seed)
               for name, family, seed in (("llama", "llama", 1), ("llama_other", "llama", 2), ("gpt2", "gpt2", 3))}
    return folders, {name: folder_digest(f) for name, f in folders.items()}


@pytest.fixture(scope="session")
def lora_runs(lora_bases, corpus, cache_dir, tmp_path_factory) -> dict[str, Path]:
    """One uninterrupted 1-process LoRA run per family (the references of test_lora.py and test_qlora.py)."""
    folders, _ = lora_bases
    out = {}
    for family in ("llama", "gpt2"):
        run = tmp_path_factory.mktemp(f"lora-run-{family}")
        train_in_process(lora_args(corpus, cache_dir, run, folders[family]))
        out[family] = run
    return out

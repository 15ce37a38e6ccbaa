"""Fixtures and hooks: a tiny corpus, its token cache, and the device of each test. Helpers are in helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import helpers
from helpers import SHAKESPEARE


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


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "shakespeare_small.txt"
    path.write_text(SHAKESPEARE.read_text()[:60_000])
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")

"""The parallel plan: a precision, sharding or attention the device and the world size cannot run is refused in one
line before any work; a config written for a GPU warns once on a CPU, with what to change. On CPU ranks FSDP2's
gradient reduce-scatter runs as an all-to-all (or an all-reduce), with gloo's own results."""

import json

import pytest
import torch

from helpers import run_script, shardlm_cli, tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.distributed.parallelize import plan

CPU = torch.device("cpu")


@pytest.mark.parametrize("overrides, world, local, message", [
    (["parallel.precision=fp16"], 1, 1, "fp16 needs a GPU"),
    (["parallel.sharding=hybrid_full", "parallel.shard_size=2"], 3, 3, "2 does not divide 3 ranks"),
    (["parallel.sharding=hybrid_grad"], 6, 4, "4 does not divide 6 ranks"),
    (["model.attention=flex_attention"], 1, 1, "flex_attention trains on CUDA GPUs only"),
])
def test_infeasible_parallel_plans(overrides, world, local, message):
    with pytest.raises(ShardlmError, match=message):
        plan(load_config(None, overrides), world, local, CPU)


def test_full_sharding_with_one_rank_per_node_advises_grad_op():
    from shardlm.distributed.parallelize import one_rank_per_node_note

    cuda, full = torch.device("cuda"), load_config(None, [])
    assert "parallel.sharding=grad_op" in one_rank_per_node_note(full, cuda, True, 1, 1)
    assert "one rank per node" in one_rank_per_node_note(full, cuda, True, 4, 1)
    assert one_rank_per_node_note(full, cuda, True, 8, 8) is None  # ranks of a node share NVLink: full is right
    assert one_rank_per_node_note(load_config(None, ["parallel.sharding=grad_op"]), cuda, True, 1, 1) is None
    assert one_rank_per_node_note(full, cuda, False, 1, 1) is None


def test_a_gpu_config_on_a_cpu_warns_once_with_what_to_change(corpus, cache_dir, tmp_path):
    from shardlm.distributed.parallelize import gpu_config_warning

    warning = gpu_config_warning(load_config("gpt2_wikitext2"), CPU)
    assert warning.startswith("warning: this config was written for a GPU (parallel.precision=bf16) and runs on a "
                              "CPU") and "set parallel.precision=fp32" in warning and "shakespeare_tiny" in warning
    assert "parallel.compile=false" in gpu_config_warning(load_config(None, ["parallel.compile=model"]), CPU)
    assert gpu_config_warning(load_config(None, []), CPU) is None
    assert gpu_config_warning(load_config("gpt2_wikitext2"), torch.device("cuda")) is None
    args = tiny(corpus, cache_dir, tmp_path / "run", **{"parallel.precision": "bf16", "train.max_steps": 1})
    proc = shardlm_cli(["train", "--nproc", "2", *args])  # bf16 trains on a CPU: a warning, not an error
    assert proc.stderr.count("warning: this config was written for a GPU") == 1, proc.stderr


def test_cpu_reduce_scatter_equals_gloos(tmp_path):
    """2 gloo ranks: SUM and AVG of an even, an odd and a large size (all-to-all; all-reduce) equal gloo's
    reduce_scatter_tensor bit for bit; shardlm's `shard` gives both units of a tiny GPT-2 this comm, and its
    gradients are those of a copy left on gloo's."""
    out = tmp_path / "result.json"
    run_script("reduce_scatter_check.py", str(out), timeout=120)
    assert json.loads(out.read_text()) == {
        "sum_6": 0.0, "sum_1001": 0.0, "sum_9999": 0.0, "avg_6": 0.0, "avg_1001": 0.0, "avg_9999": 0.0,
        "installed": ["CpuReduceScatter"] * 2, "grads": 0.0}

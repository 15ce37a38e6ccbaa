"""Background batch loading: the next micro-batches are read, pinned and on their way to the GPU while
the current step runs.

A training step on a GPU is a few milliseconds of kernel launches; reading a batch from the memmap,
converting it, pinning it and copying it to the device on the training thread puts all of that on the
critical path. Here a daemon thread does it ahead of time, `depth` micro-batches deep, and on CUDA
issues the host-to-device copy on its own stream; the training stream waits on an event, not the host.
The order of batches is exactly the one `batches` yields, so results do not depend on prefetching.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch

from shardlm.data.blocks import Batch

Key = tuple[int, int]  # (optimizer-step position in blocks, micro-step)


class Prefetcher:
    def __init__(self, read: Callable[[np.ndarray], Batch], batches: Iterator[tuple[Key, np.ndarray]],
                 device: torch.device, depth: int = 2):
        self.read, self.batches, self.device = read, batches, device
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._work, name="shardlm-prefetch", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            for key, indices in self.batches:
                item = (key, *self._load(indices))
                while not self.stopped.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stopped.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
            self.queue.put((None, e, None))

    def _load(self, indices: np.ndarray) -> tuple[Batch, torch.cuda.Event | None]:
        batch = self.read(indices)
        if self.stream is None:
            return batch, None
        with torch.cuda.stream(self.stream):
            on_device = batch.pin_memory().to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return on_device, ready

    def next(self, expected: Key) -> Batch | None:
        """The batch for `expected`, or None when the queue holds another position (then restart)."""
        key, batch, ready = self.queue.get()
        if key is None:
            raise batch
        if key != expected:
            return None
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            batch.record_stream(current)  # the allocator must not reuse it before the step is done
        return batch

    def close(self) -> None:
        self.stopped.set()
        while not self.queue.empty():
            self.queue.get_nowait()
        self.thread.join(timeout=5)

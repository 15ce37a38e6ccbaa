"""Asynchronous generation (`grpo.max_staleness` with a vLLM server, TRL's AsyncGRPOTrainer): while a step
trains, the next rounds are generated on the server, each rank's requests on a background thread of its own. A
round is taken when its step comes (its generation over, so the engine may take new weights), and the pipeline is
topped up to `max_staleness` rounds. Each round remembers the step count of the weights that sampled it: the
policy lag the step records. The rounds in flight are not checkpointed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class Pending:
    position: int  # where in the data order the round starts
    future: Future
    synced_at: int  # the step count of the weights that sample it


class Sampled:
    """A `Sampler` that hands back a rollout generated ahead."""

    def __init__(self, rollout: Any):
        self.rollout = rollout

    def sample(self, prompts: Any, keys: Any, params: Any) -> Any:
        return self.rollout


class Pipeline:
    """Up to `depth` rounds in flight (0: none, every round sampled when its step comes)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.pending: deque[Pending] = deque()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardlm-rollout") if depth else None

    def take(self, position: int) -> tuple[Any, int] | None:
        """The round generated for `position` and the step count of the weights that sampled it, or None (none
        pending: the first round, or the first after a resume)."""
        while self.pending:
            p = self.pending.popleft()
            rollout = p.future.result()
            if p.position == position:
                return rollout, p.synced_at
        return None

    def wanted(self, position: int, count: int) -> list[int]:
        """The positions of the rounds to launch after the one at `position` (each `count` prompts long)."""
        have = len(self.pending)
        return [position + count * (have + i + 1) for i in range(self.depth - have)]

    def launch(self, position: int, sampler: Any, ids: Sequence[Sequence[int]], keys: Sequence[int], params: Any,
               synced_at: int) -> None:
        assert self.pool is not None
        self.pending.append(Pending(position, self.pool.submit(sampler.sample, ids, keys, params), synced_at))

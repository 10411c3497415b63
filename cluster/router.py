"""Placing requests on workers: pluggable policies over the workers' reported load.

Prefix-aware routing keeps, per prefill worker, the block hashes of the prompts
it was sent (the same chained hashes its prefix cache uses) in a bounded LRU:
an approximation of that worker's cache, as SGLang's cache-aware router keeps.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.outputs import EngineLoad


@dataclass(slots=True)
class WorkerState:
    """What the router knows of one worker."""

    worker_id: str
    load: EngineLoad | None = None
    healthy: bool = True
    inflight: int = 0  # requests placed here and not yet finished, counted by the frontend
    cached_hashes: OrderedDict[int, None] = field(default_factory=OrderedDict)

    @property
    def score(self) -> float:
        """Lower is less loaded: queued work plus KV pressure."""
        load = self.load
        used = 0.0 if load is None else 1.0 - load.num_free_blocks / max(1, load.num_blocks)
        queued = 0 if load is None else load.queued_prefill_tokens
        return self.inflight + used * 4 + queued / 4096


class RoutingPolicy(Protocol):
    def choose(self, workers: Sequence[WorkerState], block_hashes: Sequence[int]) -> WorkerState:
        """Pick one of `workers` (all healthy, non-empty) for a prompt with these block hashes."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: Sequence[WorkerState], block_hashes: Sequence[int]) -> WorkerState:
        return workers[next(self._counter) % len(workers)]


class LeastLoad:
    def choose(self, workers: Sequence[WorkerState], block_hashes: Sequence[int]) -> WorkerState:
        return min(workers, key=lambda w: w.score)


class PrefixAware:
    """Longest cached prefix wins unless that worker is much busier than the least busy one."""

    def __init__(self, max_hashes_per_worker: int = 65536, imbalance: float = 8.0) -> None:
        self.max_hashes = max_hashes_per_worker
        self.imbalance = imbalance

    def choose(self, workers: Sequence[WorkerState], block_hashes: Sequence[int]) -> WorkerState:
        least = min(workers, key=lambda w: w.score)
        best, best_len = least, 0
        for w in workers:
            n = matched_blocks(w, block_hashes)
            if n > best_len and w.score - least.score <= self.imbalance:
                best, best_len = w, n
        remember(best, block_hashes, self.max_hashes)
        return best


def matched_blocks(worker: WorkerState, block_hashes: Sequence[int]) -> int:
    n = 0
    for h in block_hashes:
        if h not in worker.cached_hashes:
            break
        n += 1
    return n


def remember(worker: WorkerState, block_hashes: Sequence[int], limit: int) -> None:
    cache = worker.cached_hashes
    for h in block_hashes:
        cache[h] = None
        cache.move_to_end(h)
    while len(cache) > limit:
        cache.popitem(last=False)


def make_policy(name: str) -> RoutingPolicy:
    policies: dict[str, type] = {"round_robin": RoundRobin, "least_load": LeastLoad, "prefix_aware": PrefixAware}
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(policies)}")
    return policies[name]()

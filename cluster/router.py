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

from pdserve.cluster.config import RouterConfig
from pdserve.engine.outputs import EngineLoad


@dataclass(slots=True)
class KVClaim:
    """The KV blocks a request seated on a decode worker reserves there (its prompt's)."""

    num_blocks: int
    reserved_at: float | None = None  # when the worker confirmed the reservation (event-loop time)


@dataclass(slots=True)
class WorkerState:
    """What the router knows of one worker."""

    worker_id: str
    load: EngineLoad | None = None
    healthy: bool = True
    inflight: int = 0  # requests placed here and not yet finished (written by cluster.seats.SeatLine only)
    load_asked_at: float = 0.0  # when `load` was asked for (event-loop time)
    # Decode seats taken here, by request id: the KV blocks each reserves (cluster.seats.SeatLine).
    claims: dict[str, KVClaim] = field(default_factory=dict)
    cached_hashes: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def kv_headroom(self) -> int | None:
        """Blocks a new decode reservation may take here (None: no load reported yet): what
        the load says one may take (the engine's rule), less the claims that the load may not
        show yet (confirmed after it was asked for) and their headroom."""
        load = self.load
        if load is None:
            return None
        unseen = sum(c.num_blocks + 1 for c in self.claims.values()
                     if c.reserved_at is None or c.reserved_at >= self.load_asked_at)
        return load.num_reservable_blocks - unseen

    def score(self, weights: RouterConfig) -> float:
        """Lower is less loaded: requests in flight, queued work and KV pressure (see RouterConfig)."""
        load = self.load
        used = 0.0 if load is None else 1.0 - load.num_free_blocks / max(1, load.num_blocks)
        queued = 0 if load is None else load.queued_prefill_tokens
        return self.inflight + used * weights.kv_usage_weight + queued / weights.queued_tokens_per_request


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
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()

    def choose(self, workers: Sequence[WorkerState], block_hashes: Sequence[int]) -> WorkerState:
        return min(workers, key=lambda w: w.score(self.config))


class PrefixAware:
    """Longest cached prefix wins unless that worker is much busier than the least busy one."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()

    def choose(self, workers: Sequence[WorkerState], block_hashes: Sequence[int]) -> WorkerState:
        scores = {id(w): w.score(self.config) for w in workers}
        least = min(workers, key=lambda w: scores[id(w)])
        best, best_len = least, 0
        for w in workers:
            n = matched_blocks(w, block_hashes)
            if n > best_len and scores[id(w)] - scores[id(least)] <= self.config.max_imbalance:
                best, best_len = w, n
        remember(best, block_hashes, self.config.max_hashes_per_worker)
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


def make_policy(name: str, config: RouterConfig | None = None) -> RoutingPolicy:
    config = config or RouterConfig()
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad(config)
    if name == "prefix_aware":
        return PrefixAware(config)
    raise ValueError(f"unknown routing policy {name!r}; known: least_load, prefix_aware, round_robin")

"""Placing requests on workers: pluggable policies over the workers' reported load.

Prefix-aware routing reads the global KV index (`cluster/serving/kv_index.py`: what every worker's
cache holds, as its KV events say) and places a request where it costs least: the prompt
tokens the worker would still compute (the prompt less the leading blocks it holds) plus
the worker's load, as Dynamo's KV router weighs overlap against load. Prefill and decode
workers are chosen alike; a decode worker that holds the prefix wins a close call.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.cluster.serving.kv_index import KVIndex
from pdserve.cluster.settings.config import RouterConfig
from pdserve.engine.block_hash import prefix_block_hashes
from pdserve.engine.outputs import EngineLoad


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """What routing knows of a prompt: its length and the chained hashes of its full blocks
    (the hashes the workers' prefix caches find blocks by)."""

    num_tokens: int
    block_hashes: tuple[int, ...]
    block_size: int

    @classmethod
    def of(cls, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> PromptBlocks:
        """The prompt's blocks as a worker hashes them (salted by the request's `cache_salt`)."""
        return cls(len(token_ids), tuple(prefix_block_hashes(token_ids, block_size, cache_salt)), block_size)

    def num_new_tokens(self, num_cached_blocks: float) -> float:
        """Prompt tokens a worker holding its first `num_cached_blocks` blocks still computes
        (at least one: an engine computes the last token to sample the next); blocks below a
        worker's pool count in part (`RouterConfig.tier_credits`)."""
        return max(1, self.num_tokens - num_cached_blocks * self.block_size)


@dataclass(slots=True)
class KVClaim:
    """The KV blocks a request seated on a decode worker reserves there (its prompt's)."""

    num_blocks: int
    reserved_at: float | None = None  # when the worker confirmed the reservation (event-loop time)
    priority: int = 0  # the request's (`SamplingParams.priority`, lower first)
    tenant: str = ""  # the request's tenant's name (`cluster/settings/tenants.py`)
    tenant_weight: float = 1.0  # and its weight


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
    def choose(self, workers: Sequence[WorkerState], prompt: PromptBlocks) -> WorkerState:
        """Pick one of `workers` (all healthy, non-empty) for `prompt`."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: Sequence[WorkerState], prompt: PromptBlocks) -> WorkerState:
        return workers[next(self._counter) % len(workers)]


class LeastLoad:
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()

    def choose(self, workers: Sequence[WorkerState], prompt: PromptBlocks) -> WorkerState:
        return min(workers, key=lambda w: (w.score(self.config), w.worker_id))


class PrefixAware:
    """The cheapest worker on the KV index: its load score plus `prompt_weight` x the prompt
    tokens it would still compute / `queued_tokens_per_request` (`RouterConfig`). Ties go to
    the less loaded worker, then to the first by name: the same inputs, the same choice."""

    def __init__(self, index: KVIndex, config: RouterConfig | None = None) -> None:
        self.index = index
        self.config = config or RouterConfig()

    def choose(self, workers: Sequence[WorkerState], prompt: PromptBlocks) -> WorkerState:
        cached = self.index.prefix_credit(prompt.block_hashes, self.config.tier_credits)

        def rank(w: WorkerState) -> tuple[float, float, str]:
            score = w.score(self.config)
            return self.cost(score, prompt.num_new_tokens(cached.get(w.worker_id, 0))), score, w.worker_id

        return min(workers, key=rank)

    def cost(self, score: float, num_new_tokens: float) -> float:
        """A placement's cost, in requests: the worker's load score plus its new prompt work."""
        return score + self.config.prompt_weight * num_new_tokens / self.config.queued_tokens_per_request


def make_policy(name: str, index: KVIndex, config: RouterConfig | None = None) -> RoutingPolicy:
    config = config or RouterConfig()
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad(config)
    if name == "prefix_aware":
        return PrefixAware(index, config)
    raise ValueError(f"unknown routing policy {name!r}; known: least_load, prefix_aware, round_robin")

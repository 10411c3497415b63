"""The worker pools' configs: their sizes, roles and placement (`PoolConfig`), how a worker
leaves a running server (`DrainConfig`), the planner that sizes the pools at run time
(`PlannerConfig`), and the pools fitted to the cluster's GPUs (`fit_pools_to_gpus`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig

MODES = ("disaggregated", "colocated")
POLICIES = ("prefix_aware", "least_load", "round_robin")


@dataclass(frozen=True, slots=True)
class DrainConfig:
    """How a worker leaves a running server (the admin API's Drain and RemoveWorker): it takes
    no new request, the requests it holds finish there (KV on its way to it lands first) or,
    past the drain's deadline, continue on another worker as a lost worker's do (a re-prefill
    of prompt plus streamed tokens), then its actor is stopped.

    deadline_s: how long its requests may run on before they move, when the call names no deadline.
    check_s: how often a drain looks whether its worker is idle yet.
    stop_timeout_s: bound on the moved requests letting go of the worker (their aborts there)
        before its actor is stopped regardless.
    """

    deadline_s: float = 300.0
    check_s: float = 0.1
    stop_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.deadline_s < 0:
            raise ValueError(f"DrainConfig.deadline_s must be >= 0, got {self.deadline_s}")
        for name in ("check_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DrainConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The planner (`cluster/scaling/planner.py`): sizes the prefill and decode pools to latency targets.

    enabled: off by default; a disaggregated server only (colocated workers have no split).
    dry_run: decide and log, change nothing (what it would do is on /metrics too).
    ttft_target_ms/itl_target_ms: the targets, met at `percentile` by the simulator's
        prediction (ITL: each request's mean gap between tokens).
    percentile: the percentile of the requests the targets hold for (90: nine in ten).
    profile: the step-cost profile the simulator predicts with (`pdserve profile` writes it).
    max_workers: the GPU budget in workers of both roles (0: the pools' starting size).
    min_prefill/min_decode: the fewest workers of each role it leaves.
    interval_s: how often it looks at the load.
    window_s: how far back the traffic it estimates from goes.
    min_change_interval_s: the least time between two changes.
    hysteresis: intervals in a row that must want the same split before it is applied.
    min_gain: how much better (in the worse of the two latencies against its target) a split
        must be predicted than the present one to move to it while both meet or both miss the
        targets: what keeps noise and unmeetable targets from flapping the pools.
    kv_usage_limit: a split whose decode pool would use more than this share of its KV
        blocks (the present use scaled by the change in decode workers) is not chosen.
    min_requests: the fewest requests in the window it plans from.
    sim_requests: requests each prediction simulates.
    correction_intervals: the intervals the correction factor is learnt over: each interval's
        ratio of observed to predicted (TTFT and ITL at `percentile`, the present split at the
        window's traffic) is kept, and the predictions of every split are multiplied by the
        median of the last this many, as Dynamo's SLA planner corrects its profile: what the
        profile misses (the serving path, a shared host, prefix hits) shows there. A wild
        interval moves a median not at all; a lasting error takes over once it fills most of them.
        0: no correction.
    correction_min/correction_max: the bounds of each ratio, and so of the factor.
    drain_deadline_s: how long a worker the planner moves or removes may finish its requests
        before they move to another worker (a re-prefill: the client sees a pause). Shorter
        than the admin API's `DrainConfig.deadline_s`: a change the planner makes is wanted
        now, and streams of minutes would hold the old split meanwhile.
    """

    enabled: bool = False
    dry_run: bool = False
    ttft_target_ms: float = 2000.0
    itl_target_ms: float = 100.0
    percentile: int = 90
    profile: str = ""
    max_workers: int = 0
    min_prefill: int = 1
    min_decode: int = 1
    interval_s: float = 30.0
    window_s: float = 120.0
    min_change_interval_s: float = 120.0
    hysteresis: int = 2
    min_gain: float = 0.2
    kv_usage_limit: float = 0.9
    min_requests: int = 20
    sim_requests: int = 400
    correction_intervals: int = 5
    correction_min: float = 0.5
    correction_max: float = 3.0
    drain_deadline_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("ttft_target_ms", "itl_target_ms", "interval_s", "window_s", "correction_min"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PlannerConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.percentile < 100:
            raise ValueError(f"PlannerConfig.percentile must be in (0, 100), got {self.percentile}")
        for name in ("max_workers", "min_change_interval_s", "min_gain", "drain_deadline_s", "correction_intervals"):
            if getattr(self, name) < 0:
                raise ValueError(f"PlannerConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("min_prefill", "min_decode", "hysteresis", "min_requests", "sim_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlannerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.kv_usage_limit <= 1:
            raise ValueError(f"PlannerConfig.kv_usage_limit must be in (0, 1], got {self.kv_usage_limit}")
        if not self.correction_min <= 1 <= self.correction_max:
            raise ValueError(f"PlannerConfig needs correction_min <= 1 <= correction_max, got "
                             f"{self.correction_min}, {self.correction_max}")
        if self.enabled and not self.profile:
            raise ValueError("PlannerConfig.profile: the planner needs a step-cost profile (pdserve profile)")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Ray worker pools.

    mode: "disaggregated" (prefill and decode pools) or "colocated" (decode
        workers prefill locally: one engine does both phases).
    num_prefill/num_decode: actors per pool (colocated uses num_decode).
    gpus_per_worker: GPUs each rank of a worker takes (a worker of tensor-parallel size N
        takes N x this, on one node); 0 on the CPU, None = 1 if GPUs are present.
    prefill_tp/decode_tp: tensor-parallel size of each pool's workers (None: the engine's
        `parallel.tensor_parallel_size`); colocated uses decode_tp.
    prefill_resource/decode_resource: custom Ray node resources that pin each pool
        to labelled nodes ("" places anywhere).
    routing: "prefix_aware" (default: both pools placed on the KV index, where a request
        costs least, `RouterConfig`), "least_load" or "round_robin" (the prefill pool by
        that rule; decode workers then by least load).
    actor_max_concurrency: calls one worker actor runs at once (Ray's max_concurrency):
        each request in flight holds one or two (reserve, admit; the poll and pings are
        the worker's own), so it bounds what one decode worker can hold.
    planner: sizes the pools to latency targets at run time (`PlannerConfig`; off by default).
    """

    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    gpus_per_worker: float | None = None
    prefill_tp: int | None = None
    decode_tp: int | None = None
    prefill_resource: str = ""
    decode_resource: str = ""
    routing: str = "prefix_aware"
    actor_max_concurrency: int = 1000
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        if self.planner.enabled and self.mode != "disaggregated":
            raise ValueError("PoolConfig.planner: the planner sizes a disaggregated server's pools; this one is "
                             f"{self.mode}")
        if self.mode not in MODES:
            raise ValueError(f"PoolConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.num_decode < 1 or (self.mode == "disaggregated" and self.num_prefill < 1):
            raise ValueError(f"PoolConfig needs >= 1 decode worker (and >= 1 prefill worker when disaggregated), "
                             f"got num_prefill={self.num_prefill}, num_decode={self.num_decode}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"PoolConfig.gpus_per_worker must be >= 0, got {self.gpus_per_worker}")
        if self.routing not in POLICIES:
            raise ValueError(f"PoolConfig.routing must be one of {POLICIES}, got {self.routing!r}")
        if self.actor_max_concurrency < 1:
            raise ValueError(f"PoolConfig.actor_max_concurrency must be >= 1, got {self.actor_max_concurrency}")
        for name in ("prefill_tp", "decode_tp"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"PoolConfig.{name} must be >= 1, got {getattr(self, name)}")

    def tp(self, role: str, engine: EngineConfig) -> int:
        """Tensor-parallel size of the workers of `role` ("prefill", or "decode" for both
        decode and mixed workers)."""
        size = self.prefill_tp if role == "prefill" else self.decode_tp
        return size if size is not None else engine.parallel.tensor_parallel_size


def fit_pools_to_gpus(pools: PoolConfig, num_gpus: float, engine: EngineConfig | None = None) -> PoolConfig:
    """Resolve `gpus_per_worker` for a cluster with `num_gpus` GPUs (`engine`: whose
    tensor-parallel size the pools default to).

    Unset, each rank takes one GPU when there are GPUs, else none (CPU). A
    disaggregated layout that needs more GPUs than the cluster has would wait
    forever for them, so it becomes colocated with one mixed worker per GPU.
    """
    if pools.gpus_per_worker is not None:
        return pools
    if num_gpus < 1:
        return dataclasses.replace(pools, gpus_per_worker=0.0)
    engine = engine or EngineConfig()
    prefill_tp, decode_tp = pools.tp("prefill", engine), pools.tp("decode", engine)
    if pools.mode == "disaggregated" and pools.num_prefill * prefill_tp + pools.num_decode * decode_tp > num_gpus:
        return dataclasses.replace(pools, mode="colocated", num_decode=max(1, int(num_gpus) // decode_tp),
                                   gpus_per_worker=1.0)
    return dataclasses.replace(pools, gpus_per_worker=1.0)

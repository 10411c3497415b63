"""Prometheus metrics of the frontend, served on /metrics (127.0.0.1 unless configured)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdserve.cluster.serving.kv_index import KVIndex
from pdserve.engine.kv.events import DISK_TIER, HOST_TIER
from pdserve.engine.messages import KVTransferInfo
from pdserve.engine.outputs import EngineLoad

if TYPE_CHECKING:  # types only: the planner (scaling/) writes its decisions here, above serving/
    from pdserve.cluster.scaling.planner import Decision
    from pdserve.engine.kv.tiers import KVTierStats

_TIERS = (HOST_TIER, DISK_TIER)

# The hops of a first token's path that are waiting, not work (cluster/serving/coordinator.py's hops).
_QUEUE_HOPS = ("seat", "prefill_queue")


def priority_class(priority: int) -> str:
    """A priority as the metrics label it: "high" (< 0), "default" (0) or "low" (> 0)."""
    return "high" if priority < 0 else "low" if priority > 0 else "default"


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Gap between streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_request_latency_seconds", "Request arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # hop: RequestReport.hops' keys (cluster/serving/coordinator.py) and "other": what the frontend
        # spent besides (parsing is before arrival; admission, the first delta's way out).
        self.hops = Histogram("pdserve_first_token_hop_seconds", "A first token's time in one hop of its path",
                              ["hop"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pdserve_requests", "Finished requests by gRPC status", ["status"], registry=r)
        self.tokens = Counter("pdserve_generated_tokens", "Generated tokens", registry=r)
        # The frontend's admission (cluster/api/admission.py), by tenant and priority class ("high":
        # priority < 0, "default": 0, "low": > 0; classes, not values: a client picks the value).
        self.admitted = Counter("pdserve_admitted_requests", "Requests admitted", ["tenant", "priority_class"],
                                registry=r)
        self.displaced = Counter("pdserve_displaced_requests", "Queued requests refused to make room for one that "
                                 "outranks them", ["tenant", "priority_class"], registry=r)
        # where: "admission" (the frontend's capacity) or "seat_line" (the queue for a decode seat,
        # or a worker that refused the reservation).
        self.refused = Counter("pdserve_refused_requests", "Requests refused for capacity (RESOURCE_EXHAUSTED)",
                               ["tenant", "priority_class", "where"], registry=r)
        self.queue_time = Histogram("pdserve_queue_seconds", "A request's wait before its prompt ran: for a decode "
                                    "seat and in the prefill engine's queue", ["tenant", "priority_class"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        # Sequences a worker's engine preempted (blocks freed, recomputed later), since it started.
        self.preempted = Gauge("pdserve_preempted_sequences", "Sequences the worker's engine preempted",
                               ["role", "worker", "tenant", "priority_class"], registry=r)
        self._preempted_keys: dict[str, set[tuple[str, str]]] = {}  # worker -> its (tenant, class) series
        self.running = Gauge("pdserve_running_sequences", "Running sequences", ["role", "worker"], registry=r)
        self.waiting = Gauge("pdserve_waiting_sequences", "Waiting sequences", ["role", "worker"], registry=r)
        self.kv_usage = Gauge("pdserve_kv_block_usage_ratio", "Used fraction of KV blocks", ["role", "worker"],
                              registry=r)
        self.prefix_queried = Gauge("pdserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix "
                                    "cache", ["role", "worker"], registry=r)
        self.prefix_hits = Gauge("pdserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                 ["role", "worker"], registry=r)
        # path: "direct" (written into the decode pool over CUDA IPC) or "messages" (UCX).
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved between workers", ["transport", "path"],
                                registry=r)
        self.kv_seconds = Histogram("pdserve_kv_transfer_seconds", "KV transfer latency", ["transport", "path"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.spec_proposed = Gauge("pdserve_spec_proposed_tokens", "Draft tokens proposed for verification",
                                   ["worker"], registry=r)
        self.spec_accepted = Gauge("pdserve_spec_accepted_tokens", "Draft tokens the target accepted", ["worker"],
                                   registry=r)
        self.spec_alpha = Gauge("pdserve_spec_acceptance_alpha", "Per-token acceptance rate (the formula's alpha)",
                                ["worker"], registry=r)
        self.spec_mean_accepted = Gauge("pdserve_spec_mean_accepted_length", "Accepted draft tokens per pass",
                                        ["worker"], registry=r)
        self.spec_steps = Gauge("pdserve_spec_steps", "Decode steps by the K speculation proposed (adaptive K's "
                                "choice; 0: off)", ["worker", "k"], registry=r)
        self.migrations = Counter("pdserve_request_migrations", "Requests continued on another worker after "
                                  "losing theirs", registry=r)
        # The router's KV index (cluster/serving/kv_index.py): its size, and how far it trails the events
        # the workers sent (received but not applied: skipped while out of sync or already in
        # a snapshot) and how often it resynced from a snapshot.
        self.kv_index_blocks = Gauge("pdserve_kv_index_blocks", "Entries of the router's KV index (a block held "
                                     "by a worker in a tier)", registry=r)
        self.kv_cached_blocks = Gauge("pdserve_kv_cached_blocks", "Blocks a worker's cache holds, by tier, as the "
                                      "router's KV index knows them", ["role", "worker", "tier"], registry=r)
        self.kv_events_received = Gauge("pdserve_kv_events_received", "KV events the router has received",
                                        registry=r)
        self.kv_events_applied = Gauge("pdserve_kv_events_applied", "KV events the router has applied to its index",
                                       registry=r)
        self.kv_index_snapshots = Gauge("pdserve_kv_index_snapshots", "Workers resynced from a snapshot (after a gap "
                                        "in their events or a restart)", registry=r)
        self._tiers: dict[str, set[str]] = {}  # each worker's tier labels of kv_cached_blocks
        self.prompt_computed = Gauge("pdserve_prompt_tokens_computed", "Prompt tokens a worker's steps computed "
                                     "(not served from a cache tier or another worker)", ["role", "worker"], registry=r)
        # The host and disk tiers below each worker's pool (engine/kv/tiers.py), since its start.
        self.tier_hits = Gauge("pdserve_kv_tier_hit_tokens", "Prompt tokens onboarded from a tier below the pool",
                               ["role", "worker", "tier"], registry=r)
        self.tier_offloaded = Gauge("pdserve_kv_tier_offloaded_bytes", "KV bytes written into a tier",
                                    ["role", "worker", "tier"], registry=r)
        self.tier_onboarded = Gauge("pdserve_kv_tier_onboarded_bytes", "KV bytes copied back from a tier into the "
                                    "pool", ["role", "worker", "tier"], registry=r)
        self.tier_bytes = Gauge("pdserve_kv_tier_bytes", "KV bytes a tier holds", ["role", "worker", "tier"],
                                registry=r)
        self.tier_onboard_seconds = Gauge("pdserve_kv_tier_onboard_seconds", "Engine time spent onboarding blocks",
                                          ["role", "worker"], registry=r)
        self.tier_rejected = Gauge("pdserve_kv_disk_rejected_blocks", "Disk-tier blocks refused (and recomputed), "
                                   "by reason", ["role", "worker", "reason"], registry=r)
        self.disk_full = Gauge("pdserve_kv_disk_full", "1: a disk-tier write failed (disk full): offloading to disk "
                               "stopped", ["role", "worker"], registry=r)
        self._rejected: dict[str, set[str]] = {}  # each worker's reason labels of tier_rejected
        # What the planner estimates the traffic from (cluster/scaling/planner_loop.py): arrivals and their prompts.
        self.arrived = Counter("pdserve_requests_arrived", "Requests admitted to run", registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of the admitted requests", registry=r)
        self.planner_decisions = Counter("pdserve_planner_decisions", "The planner's decisions by outcome (hold, "
                                         "pending, change, dry_run)", ["outcome"], registry=r)
        self.planner_target = Gauge("pdserve_planner_target_workers", "Workers of each role the planner wants",
                                    ["role"], registry=r)
        self.planner_unmeetable = Gauge("pdserve_planner_targets_unmeetable", "1 while no split of the budget is "
                                        "predicted to meet the TTFT and ITL targets", registry=r)
        self.planner_predicted = Gauge("pdserve_planner_predicted_ms", "The wanted split's predicted latency at the "
                                       "planner's percentile (the simulator's, before the correction factor)",
                                       ["latency"], registry=r)
        self.planner_correction = Gauge("pdserve_planner_correction_factor", "What the planner multiplies the "
                                        "simulator's predictions by: the median of the last intervals' "
                                        "observed/predicted ratios, clamped", ["latency"], registry=r)
        self.workers_lost = Counter("pdserve_workers_lost", "Workers found dead and replaced", ["role"], registry=r)
        self._spec_ks: dict[str, set[str]] = {}  # each worker's k labels of spec_steps

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def kv_transfer(self, info: KVTransferInfo) -> None:
        path = "direct" if info.direct else "messages"
        self.kv_bytes.labels(info.transport, path).inc(info.num_bytes)
        self.kv_seconds.labels(info.transport, path).observe(info.elapsed_s)

    def worker_load(self, role: str, worker_id: str, load: EngineLoad) -> None:
        self.running.labels(role, worker_id).set(load.num_running)
        self.waiting.labels(role, worker_id).set(load.num_waiting)
        self.kv_usage.labels(role, worker_id).set(1 - load.num_free_blocks / max(1, load.num_blocks))
        self.prefix_queried.labels(role, worker_id).set(load.prefix_queried_tokens)
        self.prefix_hits.labels(role, worker_id).set(load.prefix_hit_tokens)
        self.prompt_computed.labels(role, worker_id).set(load.prompt_tokens_computed)
        self._preempted_load(role, worker_id, load)
        if load.kv_tiers is not None:
            self._tier_load(role, worker_id, load.kv_tiers)
        if load.spec is not None:
            self.spec_proposed.labels(worker_id).set(load.spec.num_proposed)
            self.spec_accepted.labels(worker_id).set(load.spec.num_accepted)
            self.spec_alpha.labels(worker_id).set(load.spec.alpha)
            self.spec_mean_accepted.labels(worker_id).set(load.spec.mean_accepted_length)
            for k, n in load.spec.num_steps_by_k.items():
                self.spec_steps.labels(worker_id, str(k)).set(n)
                self._spec_ks.setdefault(worker_id, set()).add(str(k))

    def _preempted_load(self, role: str, worker_id: str, load: EngineLoad) -> None:
        by_class: dict[tuple[str, str], int] = {}
        for tenant, priority, n in load.preemptions_by:
            key = (tenant or "default", priority_class(priority))
            by_class[key] = by_class.get(key, 0) + n
        self._preempted_keys.setdefault(worker_id, set()).update(by_class)
        for tenant, klass in by_class:
            self.preempted.labels(role, worker_id, tenant, klass).set(by_class[tenant, klass])

    def _tier_load(self, role: str, worker_id: str, stats: KVTierStats) -> None:
        for tier in _TIERS:
            self.tier_hits.labels(role, worker_id, tier).set(stats.hit_tokens.get(tier, 0))
            self.tier_offloaded.labels(role, worker_id, tier).set(stats.bytes_offloaded.get(tier, 0))
            self.tier_onboarded.labels(role, worker_id, tier).set(stats.bytes_onboarded.get(tier, 0))
            self.tier_bytes.labels(role, worker_id, tier).set(stats.num_bytes.get(tier, 0))
        self.tier_onboard_seconds.labels(role, worker_id).set(stats.onboard_seconds)
        self.disk_full.labels(role, worker_id).set(int(stats.disk_full))
        for reason, n in stats.num_rejected.items():
            self.tier_rejected.labels(role, worker_id, reason).set(n)
            self._rejected.setdefault(worker_id, set()).add(reason)

    def kv_index(self, index: KVIndex, workers: list[tuple[str, str]]) -> None:
        """The index's size and event counts, and each (role, worker id)'s cached blocks by tier."""
        self.kv_index_blocks.set(len(index))
        self.kv_events_received.set(index.num_events_received)
        self.kv_events_applied.set(index.num_events_applied)
        self.kv_index_snapshots.set(index.num_snapshots)
        for role, worker_id in workers:
            blocks = index.blocks_of(worker_id)
            tiers = self._tiers.setdefault(worker_id, set())
            tiers.update(blocks)
            for tier in tiers:  # a tier cleared since: 0
                self.kv_cached_blocks.labels(role, worker_id, tier).set(blocks.get(tier, 0))

    def first_token_hops(self, hops: dict[str, float], ttft_s: float, tenant: str = "default",
                         priority: int = 0) -> None:
        """Observe each hop of a first token's path, and the rest of its `ttft_s` as "other"
        ("reserve" runs beside the prefill: it is not part of the sum); and its queue time, the
        waiting hops, by `tenant` and `priority`'s class."""
        for hop, seconds in hops.items():
            self.hops.labels(hop).observe(seconds)
        self.hops.labels("other").observe(max(0.0, ttft_s - sum(s for h, s in hops.items() if h != "reserve")))
        self.queue_time.labels(tenant, priority_class(priority)).observe(sum(hops.get(h, 0.0) for h in _QUEUE_HOPS))

    def planner_decision(self, decision: Decision, percentile: int) -> None:
        self.planner_decisions.labels(decision.outcome).inc()
        self.planner_target.labels("prefill").set(decision.target.num_prefill)
        self.planner_target.labels("decode").set(decision.target.num_decode)
        self.planner_unmeetable.set(int(decision.unmeetable))
        self.planner_correction.labels("ttft").set(decision.correction.ttft)
        self.planner_correction.labels("itl").set(decision.correction.itl)
        if decision.predicted is not None:
            p = decision.predicted
            self.planner_predicted.labels("ttft").set(p.ttft_ms.get(percentile, p.ttft_ms[max(p.ttft_ms)]))
            self.planner_predicted.labels("itl").set(p.tpot_ms.get(percentile, p.tpot_ms[max(p.tpot_ms)]))

    def worker_lost(self, role: str, worker_id: str) -> None:
        """Count a lost worker and drop its series: its replacement reports under an id of its
        own, and a dead worker's last load must not stay on /metrics as if it were live."""
        self.workers_lost.labels(role).inc()
        self.worker_left(role, worker_id)

    def worker_left(self, role: str, worker_id: str) -> None:
        """Drop the series of a worker that is no longer live (lost, or drained and stopped)."""
        for gauge in (self.running, self.waiting, self.kv_usage, self.prefix_queried, self.prefix_hits,
                      self.prompt_computed, self.tier_onboard_seconds, self.disk_full):
            with contextlib.suppress(KeyError):
                gauge.remove(role, worker_id)
        for gauge in (self.tier_hits, self.tier_offloaded, self.tier_onboarded, self.tier_bytes):
            for tier in _TIERS:
                with contextlib.suppress(KeyError):
                    gauge.remove(role, worker_id, tier)
        for reason in self._rejected.pop(worker_id, ()):
            self.tier_rejected.remove(role, worker_id, reason)
        for gauge in (self.spec_proposed, self.spec_accepted, self.spec_alpha, self.spec_mean_accepted):
            with contextlib.suppress(KeyError):
                gauge.remove(worker_id)
        for tier in self._tiers.pop(worker_id, ()):
            self.kv_cached_blocks.remove(role, worker_id, tier)
        for k in self._spec_ks.pop(worker_id, ()):
            self.spec_steps.remove(worker_id, k)
        for tenant, klass in self._preempted_keys.pop(worker_id, ()):
            self.preempted.remove(role, worker_id, tenant, klass)

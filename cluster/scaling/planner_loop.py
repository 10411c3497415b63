"""The planner on a running server: every `interval_s` it reads the pools' load reports and the
counters and histograms /metrics keeps (a scaled-out server's control plane: the frontends'
summed, `pdserve_cluster_*`: `serving/cluster_metrics.py`), hands the planner one `Observation`, exports the
decision, and carries out its actions through `Elastic` (unless dry-run)."""

from __future__ import annotations

import asyncio
import logging
import math

from pdserve.cluster.scaling.elastic import Elastic
from pdserve.cluster.scaling.planner import Action, Observation, Planner
from pdserve.cluster.serving.errors import cause
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.cluster.settings.pool_config import PlannerConfig

logger = logging.getLogger(__name__)

_COUNTERS = ("requests_arrived_total", "prompt_tokens_total", "generated_tokens_total", "request_latency_seconds_count")
_HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds"}


class PlannerLoop:
    def __init__(self, planner: Planner, config: PlannerConfig, worker_set: WorkerSet, elastic: Elastic,
                 metrics: Metrics, prefix: str = "pdserve_") -> None:
        """`prefix`: of the request metrics' names in `metrics`' registry ("pdserve_cluster_": a
        control plane's sums of its frontends')."""
        self.planner = planner
        self._counters = tuple(prefix + name for name in _COUNTERS)
        self._histograms = {k: prefix + name for k, name in _HISTOGRAMS.items()}
        self._arrived, self._prompt, self._generated, self._finished = self._counters
        self.config = config
        self.worker_set = worker_set
        self.elastic = elastic
        self.metrics = metrics
        self._last = self._read()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.interval_s)
            decision = self.planner.observe(self.observe(loop.time()))
            self.metrics.planner_decision(decision, self.config.percentile)
            for action in decision.actions:
                if not await self._act(action):
                    break  # the pools are not what the planner saw: look again next interval

    def observe(self, now: float) -> Observation:
        """The interval since the last call: counter deltas, histogram percentiles, the pools' loads."""
        values = self._read()
        delta = {k: values[k] - self._last.get(k, 0.0) for k in values}
        self._last = values
        prefill, decode = self.worker_set.serving_loads("prefill"), self.worker_set.serving_loads("decode")
        queued = sum(load.queued_prefill_tokens for load in prefill if load is not None)
        loads = [load for load in decode if load is not None]
        kv_usage = sum(1 - ld.num_free_blocks / max(1, ld.num_blocks) for ld in loads) / len(loads) if loads else 0.0
        return Observation(now, len(prefill), len(decode), round(delta[self._arrived]), round(delta[self._prompt]),
                           round(delta[self._finished]), round(delta[self._generated]), queued, kv_usage,
                           self._quantile_ms(delta, "ttft"), self._quantile_ms(delta, "itl"))

    def _read(self) -> dict[str, float]:
        """The counters' totals and the histograms' cumulative buckets, keyed by sample name (and le)."""
        out: dict[str, float] = {}
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                if sample.name in self._counters:
                    out[sample.name] = sample.value
                elif sample.name.endswith("_bucket") and sample.name[:-7] in self._histograms.values():
                    out[f"{sample.name}|{sample.labels['le']}"] = sample.value
        return {name: out.get(name, 0.0) for name in self._counters} | out

    def _quantile_ms(self, delta: dict[str, float], which: str) -> float | None:
        """The interval's percentile from its bucket counts, None if empty: linear within the
        bucket it falls in, as Prometheus' histogram_quantile (the bucket's upper bound alone
        reads up to 2.5x high with these buckets: 1.1 s as 2.5 s, against a 1.2 s target a miss
        that is not one); past the last finite bound, that bound."""
        prefix = f"{self._histograms[which]}_bucket|"
        buckets = sorted((float(k[len(prefix):]), v) for k, v in delta.items() if k.startswith(prefix))
        total = buckets[-1][1] if buckets else 0.0
        if total <= 0:
            return None
        rank = self.config.percentile / 100 * total
        lower, below = 0.0, 0.0  # the bucket's lower bound, and the samples under it
        for bound, count in buckets:
            if count >= rank:
                if not math.isfinite(bound):
                    return 1e3 * lower
                return 1e3 * (lower + (bound - lower) * (rank - below) / max(count - below, 1e-9))
            lower, below = bound, count
        return None

    async def _act(self, action: Action) -> bool:
        """Carry out one action; a worker it takes away drains within the planner's own bound
        (`drain_deadline_s`), not the admin API's default."""
        deadline_s = self.config.drain_deadline_s
        try:
            if action.kind == "move":
                await self.elastic.change_role("", action.role, deadline_s)
            elif action.kind == "add":
                await self.elastic.add(action.role)
            else:
                await self.elastic.remove(action.role, "", deadline_s, wait=True)
        except Exception as e:  # noqa: BLE001 - the server serves on; the next interval looks again
            logger.warning("planner: %s %s failed: %s", action.kind, action.role, cause(e))
            return False
        logger.info("planner: %s %s done", action.kind, action.role)
        return True

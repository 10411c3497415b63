"""The cluster view of the frontends' request metrics (`serving/cluster_metrics.py`): the sum
of each frontend's reported samples equals one registry that saw every request, on the control
plane's /metrics as `pdserve_cluster_*`, and the planner reads the same observation from it as
from that one registry; a frontend that stops reporting keeps its last report in the sums."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.scaling.planner_loop import PlannerLoop
from pdserve.cluster.serving.cluster_metrics import (
    CLUSTER_PREFIX,
    REQUEST_FAMILIES,
    ClusterRequestMetrics,
    request_samples,
)
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.settings.pool_config import PlannerConfig


@dataclasses.dataclass
class NoLoads:
    """The planner's view of the pools, empty: only the metrics are under test here."""

    def serving_loads(self, role: str) -> list:
        return []


def _traffic(metrics: Metrics, ttfts: list[float], prompt: int, status: str = "OK") -> None:
    for ttft in ttfts:
        metrics.arrived.inc()
        metrics.prompt_tokens.inc(prompt)
        metrics.ttft.observe(ttft)
        metrics.itl.observe(ttft / 10)
        metrics.e2e.observe(ttft * 3)
        metrics.tokens.inc(7)
        metrics.requests.labels(status).inc()
        metrics.first_token_hops({"prefill": ttft / 2}, ttft)


def _samples(text: str, prefix: str) -> dict[tuple[str, tuple], float]:
    return {(s.name.removeprefix(prefix), tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(prefix) and not s.name.endswith("_created")}


def test_the_cluster_view_sums_the_frontends_and_the_planner_reads_it_as_one_server():
    f0, f1, everyone = Metrics(), Metrics(), Metrics()
    control_plane = Metrics()
    view = ClusterRequestMetrics(control_plane)
    control_plane.registry.register(view)
    batches = [(f0, [0.02, 0.3, 1.7], 40), (f1, [0.004, 0.6], 90)]
    for frontend, ttfts, prompt in batches:
        _traffic(frontend, ttfts, prompt)
        _traffic(everyone, ttfts, prompt)
    _traffic(f1, [2.2], 10, status="UNAVAILABLE")
    _traffic(everyone, [2.2], 10, status="UNAVAILABLE")
    config = PlannerConfig()
    cluster_planner = PlannerLoop(None, config, NoLoads(), None, control_plane, CLUSTER_PREFIX)
    one_planner = PlannerLoop(None, config, NoLoads(), None, Metrics())
    view.report("f0", request_samples(f0))
    view.report("f1", request_samples(f1))

    text = generate_latest(control_plane.registry).decode()
    cluster = _samples(text, CLUSTER_PREFIX)
    families = tuple(f.name.removeprefix("pdserve_") for attr in REQUEST_FAMILIES
                     for f in getattr(everyone, attr).collect())
    one = {k: v for k, v in _samples(generate_latest(everyone.registry).decode(), "pdserve_").items()
           if k[0].startswith(families)}
    assert len(one) > 90 and {k: cluster.get(k) for k in one} == pytest.approx(one)
    assert set(cluster) == set(one)
    assert cluster[("requests_arrived_total", ())] == 6
    assert cluster[("requests_total", (("status", "UNAVAILABLE"),))] == 1
    # The control plane's own (zero) request families stay apart from the sums.
    assert "pdserve_requests_arrived_total 0.0" in text

    one_planner.metrics, one_planner._last = everyone, {}  # noqa: SLF001 - read everything from the start
    cluster_planner._last = {}  # noqa: SLF001
    got, want = cluster_planner.observe(5.0), one_planner.observe(5.0)
    assert got.num_arrived == 6 and got.ttft_ms is not None and got.itl_ms is not None
    assert got == want
    assert cluster_planner.observe(6.0).num_arrived == 0

    # f1 goes silent (dead); f0 serves on: the sums keep f1's last report and grow by f0's.
    _traffic(f0, [0.05], 12)
    view.report("f0", request_samples(f0))
    observed = cluster_planner.observe(7.0)
    assert (observed.num_arrived, observed.num_prompt_tokens, observed.num_finished) == (1, 12, 1)
    assert view.frontends == ("f0", "f1")

"""The frontends' request metrics summed into one cluster view (`pdserve serve --frontends N`).

Each frontend keeps its own request metrics (latencies, requests, tokens, admissions) on its
own /metrics. It sends their samples to the control plane with every heartbeat
(`ControlPlaneLink`, every `wait_s` at most: small, a few hundred numbers, and no call the
control plane waits for); the control plane sums the last report of every frontend it has
heard from into families named `pdserve_cluster_*` on its /metrics (the same names under
the frontends' would be counted twice by a scrape of both), which its planner reads as a
single server's planner reads its own. A frontend that died keeps its last report in the
sums: a cluster counter never goes back.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from pdserve.cluster.serving.metrics import Metrics

# The families a frontend reports (its requests'); the workers' and the planner's are the control plane's own.
REQUEST_FAMILIES = ("ttft", "itl", "e2e", "hops", "requests", "tokens", "admitted", "displaced", "refused",
                    "queue_time", "migrations", "arrived", "prompt_tokens", "kv_bytes", "kv_seconds")
PREFIX = "pdserve_"
CLUSTER_PREFIX = "pdserve_cluster_"

# (family name, sample name, sorted labels, value)
Sample = tuple[str, str, tuple[tuple[str, str], ...], float]


def request_samples(metrics: Metrics) -> tuple[Sample, ...]:
    """A frontend's request metrics as it reports them: every counter and histogram sample
    (cumulative) of the request families, without their creation times."""
    out: list[Sample] = []
    for attr in REQUEST_FAMILIES:
        for family in getattr(metrics, attr).collect():
            out += [(family.name, s.name, tuple(sorted(s.labels.items())), s.value)
                    for s in family.samples if not s.name.endswith("_created")]
    return tuple(out)


class ClusterRequestMetrics:
    """A Prometheus collector: the sum of the frontends' last reports, renamed `pdserve_cluster_*`.
    `kinds`: each request family's type and help, from the control plane's own `Metrics`."""

    def __init__(self, kinds: Metrics) -> None:
        self._kinds = {f.name: (f.type, f.documentation) for attr in REQUEST_FAMILIES
                       for f in getattr(kinds, attr).collect()}
        self._reports: dict[str, tuple[Sample, ...]] = {}

    def report(self, frontend_id: str, samples: tuple[Sample, ...]) -> None:
        """`frontend_id`'s samples now (cumulative: they replace its last report). Samples of a
        family this control plane does not know are refused (a frontend of another version)."""
        self._reports[frontend_id] = tuple(s for s in samples if s[0] in self._kinds)

    @property
    def frontends(self) -> tuple[str, ...]:
        return tuple(self._reports)

    def totals(self) -> dict[tuple[str, str, tuple[tuple[str, str], ...]], float]:
        """Every sample summed over the frontends, keyed by (family, sample name, labels)."""
        out: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
        for samples in self._reports.values():
            for family, name, labels, value in samples:
                key = (family, name, labels)
                out[key] = out.get(key, 0.0) + value
        return out

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for (family, name, labels), value in sorted(self.totals().items()):
            metric = families.get(family)
            if metric is None:
                kind, doc = self._kinds[family]
                metric = families[family] = Metric(_cluster(family), f"{doc}, summed over the frontends", kind)
            metric.add_sample(_cluster(name), dict(labels), value)
        yield from families.values()


def _cluster(name: str) -> str:
    return CLUSTER_PREFIX + name.removeprefix(PREFIX)

"""The Grafana dashboard (deploy/helm/pdserve/dashboards/pdserve.json), checked offline:
every query parses as PromQL and names only metrics and labels the server exports; the
chart ships it in a ConfigMap for Grafana's sidecar when asked, and not otherwise."""

from __future__ import annotations

import json
import re

import promql_parser
import pytest
from prometheus_client import Counter, Gauge, Histogram

from pdserve.cluster.serving.metrics import Metrics
from tests.deploy.conftest import CHART, Render

DASHBOARD = CHART / "dashboards" / "pdserve.json"
SUFFIXES = {Counter: ("_total",), Gauge: ("",), Histogram: ("_bucket", "_sum", "_count")}


def exported() -> dict[str, set[str]]:
    """Every series name the server's registry exports -> its label names."""
    names: dict[str, set[str]] = {}
    for metric in vars(Metrics()).values():
        kind = next((k for k in SUFFIXES if isinstance(metric, k)), None)
        if kind is None:
            continue
        labels = set(metric._labelnames)
        for suffix in SUFFIXES[kind]:
            names[metric._name.removesuffix("_total") + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def targets() -> list[tuple[str, dict]]:
    doc = json.loads(DASHBOARD.read_text())
    return [(panel["title"], t) for panel in doc["panels"] for t in panel.get("targets", ())]


def test_dashboard_is_a_grafana_dashboard_over_a_chosen_prometheus():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "pdserve" and doc["schemaVersion"] >= 36
    (var,) = doc["templating"]["list"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


@pytest.mark.parametrize("title,target", targets(), ids=lambda v: v if isinstance(v, str) else v["refId"])
def test_every_query_parses_and_names_exported_metrics_and_labels(title, target):
    expr = target["expr"]
    promql_parser.parse(expr.replace("$__rate_interval", "1m"))  # raises on a syntax error
    series = exported()
    used = set(re.findall(r"\bpdserve_[a-z_]+\b", expr))
    assert used and used <= set(series), f"{title}: not exported: {used - set(series)}"
    labels = set().union(*(series[name] for name in used))
    grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
    shown = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
    assert grouped <= labels and shown <= grouped | labels, f"{title}: labels {grouped | shown} vs {labels}"


def test_the_chart_ships_the_dashboard_only_when_enabled(render: Render):
    def dashboards(docs):
        return [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]

    assert dashboards(render()) == []
    (cm,) = dashboards(render(sets=("metrics.grafanaDashboard.enabled=true",)))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pdserve.json"]) == json.loads(DASHBOARD.read_text())

"""KubeRay autoscaling in the chart: off by default (fixed groups); on, the RayCluster asks for
the in-tree autoscaler, each worker group spans its minReplicas..maxReplicas, the planner's
budget follows the groups' maximum, and the manifests validate against KubeRay's CRD schema."""

from __future__ import annotations

import yaml

from pdserve.cluster.settings.config import config_from_dict
from tests.deploy.conftest import Render, one
from tests.deploy.test_helm_schemas import validate

POD_IP = "10.0.0.7"


def _groups(cluster: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}


def test_autoscaling_is_off_by_default(render: Render) -> None:
    cluster = one(render(), "RayCluster")
    assert "enableInTreeAutoscaling" not in cluster["spec"]
    assert all(g["minReplicas"] == g["maxReplicas"] == g["replicas"] for g in _groups(cluster).values())


def test_autoscaling_renders_bounds_the_planner_budget_and_validates(render: Render) -> None:
    docs = render(sets=("autoscaling.enabled=true", "autoscaling.idleTimeoutSeconds=120",
                        "prefill.minReplicas=1", "prefill.maxReplicas=3", "decode.maxReplicas=4",
                        "decode.workersPerPod=2", "config.pools.planner.enabled=true",
                        "config.pools.planner.profile=/profiles/h100.json"))
    for doc in docs:
        validate(doc)
    cluster = one(docs, "RayCluster")
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 120
    groups = _groups(cluster)
    assert (groups["prefill"]["minReplicas"], groups["prefill"]["maxReplicas"]) == (1, 3)
    assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (1, 4)  # min: its replicas
    text = one(docs, "ConfigMap")["data"]["config.yaml"].replace("__POD_IP__", POD_IP)
    config = config_from_dict(yaml.safe_load(text))
    assert config.pools.planner.enabled and config.pools.planner.max_workers == 3 + 4 * 2
    assert (config.pools.num_prefill, config.pools.num_decode) == (1, 2)  # the pools start at replicas

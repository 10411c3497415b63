"""deploy/ray/: the `ray up` configs pass Ray's own launcher validation (the
steps `ray up` runs before touching a cloud), and the pdserve config they
start fits the node types' custom resources."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pdserve.cluster.settings.config import load_config
from tests.deploy.conftest import ROOT

RAY_DIR = ROOT / "deploy" / "ray"
LAUNCHER_CONFIGS = ["cluster.yaml", "cluster-local.yaml"]


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((RAY_DIR / name).read_text())


def ray_up_checks(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` does to a config before it needs the provider: defaults
    merged and node types filled in, then the schema and consistency checks."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_passes_ray_validation(name: str) -> None:
    prepared = ray_up_checks(load(name))
    assert prepared["cluster_name"].startswith("pdserve")


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_validation_catches_mistakes(name: str) -> None:
    broken = load(name)
    broken["setup_comands"] = []
    with pytest.raises(jsonschema.ValidationError, match="setup_comands"):
        ray_up_checks(broken)


def serve_config(tmp_path: Path) -> Any:
    text = (RAY_DIR / "pdserve.yaml").read_text().replace("__NODE_IP__", "10.0.0.10")
    (tmp_path / "pdserve.yaml").write_text(text)
    return load_config(tmp_path / "pdserve.yaml")


def test_node_types_offer_what_the_pools_need(tmp_path: Path) -> None:
    pools = serve_config(tmp_path).pools
    node_types = ray_up_checks(load("cluster.yaml"))["available_node_types"]
    for role, num_workers in (("prefill", pools.num_prefill), ("decode", pools.num_decode)):
        resource = getattr(pools, f"{role}_resource")
        node = node_types[role]
        assert resource == role and node["resources"][resource] * node["min_workers"] == num_workers
        assert node["resources"]["GPU"] >= node["resources"][resource] * pools.gpus_per_worker
    assert not {"prefill", "decode"} & set(node_types["head"]["resources"])


def test_serve_config_joins_the_cluster(tmp_path: Path) -> None:
    config = serve_config(tmp_path)
    assert config.ray.address == "auto" and config.ray.node_ip_address == "10.0.0.10"
    assert config.server.host == "127.0.0.1"  # reached through `ray attach -p`, not a public port
    script = (RAY_DIR / "start-pdserve.sh").read_text()
    assert 's/__NODE_IP__/${NODE_IP}/' in script and "pdserve serve --config ~/pdserve.yaml" in script


def test_setup_installs_pdserve_and_local_workers_get_pool_resources() -> None:
    for name in LAUNCHER_CONFIGS:
        config = load(name)
        assert config["file_mounts"] == {"~/pdserve-src": "."}
        assert any("pip install" in c and "~/pdserve-src" in c for c in config["setup_commands"])
        assert any("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"])
    local = load("cluster-local.yaml")
    assert any("--resources=" in c and "ray-resources.json" in c for c in local["worker_start_ray_commands"])


def test_local_nodes_take_their_node_ip_from_the_file() -> None:
    """On machines you have, a node's Ray node IP is its address in the file (`ray up` passes the
    local provider's node id, which is that IP, as $RAY_CLOUD_INSTANCE_ID), not the default route's
    interface Ray would probe. tests/deploy/test_ray_up.py runs the head command for real."""
    local = load("cluster-local.yaml")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in local[key] if "ray start" in c]
        assert len(starts) == 1 and '--node-ip-address="${RAY_CLOUD_INSTANCE_ID:?' in starts[0], starts


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
@pytest.mark.parametrize("key", ["head_start_ray_commands", "worker_start_ray_commands"])
@pytest.mark.parametrize("failures, started", [(0, True), (2, True), (3, False)])
def test_a_node_whose_ray_start_fails_is_stopped_and_started_again_up_to_three_times(
        tmp_path: Path, name: str, key: str, failures: int, started: bool) -> None:
    """A raylet exits when its dashboard agent is slow to start (ray-project/ray#65983), so each
    `ray start` command tries three times, `ray stop` between tries, and fails after the third.
    Run with bash against a `ray` that fails its first `failures` starts."""
    [command] = [c for c in load(name)[key] if "ray start" in c]
    log = tmp_path / "calls"
    fake = tmp_path / "bin" / "ray"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$1" >> {log}\n'
                    f'[ "$1" != start ] || [ "$(grep -c start {log})" -gt {failures} ]\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "HOME": str(tmp_path),
           "RAY_CLOUD_INSTANCE_ID": "10.0.0.1", "RAY_HEAD_IP": "10.0.0.2"}
    done = subprocess.run(["bash", "-c", command.replace("~/pdserve-venv/bin/ray", "ray")], env=env,
                          capture_output=True, text=True, timeout=30)
    attempts = min(failures + 1, 3)
    assert (done.returncode == 0) == started, done.stderr
    assert log.read_text().split() == ["start", "stop"] * (attempts - started) + ["start"] * started

"""Run as a process: a Ray cluster on this machine whose autoscaler is Ray's `fake_multinode`
provider (worker nodes are raylets it starts and stops here), and a pdserve pool that asks for
a `decode` worker no node holds. The autoscaler adds a `decode` node for the pending actor, the
pool's add returns once the worker answers, and after the worker is removed the idle node goes.
Prints a JSON report for tests/cluster/test_autoscaling.py.

It is what `ray.cluster_utils.AutoscalingCluster` does, without its two problems here: that
reads the provider's `example.yaml`, which Ray 2.60's wheel does not ship (the config is
written below), and it starts and stops with `ray stop --force`, which ends every Ray process on
the machine (this starts the head as `ray.cluster_utils.Cluster` does and stops only its own).
The worker nodes advertise the address the autoscaler's monitor process probes (this machine's
eth0), not 127.0.0.1: the monitor is Ray's process and the probe cannot be patched there."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray import cloudpickle
from ray.cluster_utils import Cluster

from pdserve.cluster.serving.pools import ActorSpec, Pool
from pdserve.cluster.settings.config import HealthConfig
from tests.cluster.streams import free_port

# Ray's workers do not have the tests on their path, so this module's actor travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

IDLE_TIMEOUT_MINUTES = 0.1
OBJECT_STORE_BYTES = 150 * 1024 * 1024


class IdleWorker:
    """A worker actor that loads nothing: the pool's start, ping and stop calls."""

    def __init__(self, worker_id: str, slot: str | None = None) -> None:
        self.worker_id, self.slot = worker_id, slot

    async def start(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


def autoscaling_config(gcs_address: str, node_type: str, resources: dict[str, float]) -> dict[str, Any]:
    """The cluster config `ray up` would read, for the `fake_multinode` provider: a head of one
    CPU that takes no worker, and up to two nodes of `node_type` (none at the start)."""
    return {
        "cluster_name": "pdserve-fake-multinode",
        "max_workers": 2,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            node_type: {"resources": {**resources, "object_store_memory": OBJECT_STORE_BYTES},
                        "node_config": {}, "min_workers": 0, "max_workers": 2},
        },
        "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES,
        "docker": {}, "auth": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def nodes_with(resource: str) -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)]


async def scale_up_and_down(timeout_s: float) -> dict[str, Any]:
    pool = Pool("decode", 0, ActorSpec(IdleWorker, (), 0.5, 0, "decode"), HealthConfig(start_timeout_s=timeout_s))
    report: dict[str, Any] = {"decode_nodes_before": nodes_with("decode")}
    started = time.monotonic()
    worker = await pool.add()  # pending until the autoscaler adds a decode node
    report["add_s"] = round(time.monotonic() - started, 1)
    report["decode_nodes_with_worker"] = nodes_with("decode")
    report["worker_node"] = await worker.actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
    await pool.remove(worker)
    report["pool_after_remove"] = [w.worker_id for w in pool.workers]
    end = time.monotonic() + timeout_s
    while nodes_with("decode") and time.monotonic() < end:
        await asyncio.sleep(1)
    report["decode_nodes_after_idle"] = nodes_with("decode")
    report["idle_removal_s"] = round(time.monotonic() - started - report["add_s"], 1)
    return report


def main(timeout_s: float = 120.0) -> dict[str, Any]:
    # ray.init rewrites a 127.0.0.1 address to the IP it finds by probing a public address,
    # which is unreachable on these sandboxed machines: keep loopback (as three_nodes.py does).
    ray._private.services.node_ip_address_from_perspective = lambda *args, **kwargs: "127.0.0.1"
    # Read by the autoscaler's monitor, which the head starts as a child of this process.
    os.environ.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pdserve-fake-multinode-") as folder:
        config_path = Path(folder) / "cluster.json"
        config_path.write_text(json.dumps(autoscaling_config(f"127.0.0.1:{port}", "decode_node",
                                                             {"CPU": 1, "decode": 1})))
        cluster = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": "127.0.0.1", "include_dashboard": False, "num_cpus": 1,
            "gcs_server_port": port, "autoscaling_config": str(config_path)})
        try:
            ray.init(address=cluster.address)
            return asyncio.run(scale_up_and_down(timeout_s))
        finally:
            ray.shutdown()
            cluster.shutdown()


if __name__ == "__main__":
    print("REPORT " + json.dumps(main()))

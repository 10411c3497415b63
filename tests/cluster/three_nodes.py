"""Run as a process: a three-node Ray cluster on this machine (head, a node labelled
`prefill`, a node labelled `decode`), pdserve placed on it by those labels, one
request served. Prints a JSON report for tests/cluster/test_placement.py."""

from __future__ import annotations

import asyncio
import json

import ray
from ray.cluster_utils import Cluster

from pdserve.cluster.clients.grpc_client import Client
from pdserve.cluster.server import start_server
from pdserve.cluster.settings.config import config_from_dict
from pdserve.engine.sampling import SamplingParams

LOCAL = {"node_ip_address": "127.0.0.1", "include_dashboard": False}


async def main() -> dict:
    # ray.init rewrites a 127.0.0.1 address to the IP it finds by probing a public
    # address, which is unreachable on these sandboxed machines: keep loopback.
    ray._private.services.node_ip_address_from_perspective = lambda *args, **kwargs: "127.0.0.1"
    cluster = Cluster(initialize_head=True, head_node_args={**LOCAL, "num_cpus": 1})
    prefill_node = cluster.add_node(**LOCAL, num_cpus=2, resources={"prefill": 4})
    decode_node = cluster.add_node(**LOCAL, num_cpus=2, resources={"decode": 4})
    config = config_from_dict({  # joins the cluster as `pdserve serve --address` does
        "engine": {"model": {"device": "cpu", "dtype": "float32"}, "cache": {"cpu_kv_cache_gib": 0.25}},
        "server": {"port": 0, "metrics_port": 0},
        "ray": {"address": cluster.address},
        "pools": {"gpus_per_worker": 0, "prefill_resource": "prefill", "decode_resource": "decode"},
    })
    server = await start_server(config)
    try:
        worker_set = server.worker_set
        placed = {w.worker_id: await w.actor.node_id.remote() for p in worker_set.pools() for w in p.workers}

        def call() -> list[int]:
            with Client(f"127.0.0.1:{server.port}") as client:
                return [t for r in client.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=8),
                                                   timeout_s=120) for t in r.token_ids]

        tokens = await asyncio.to_thread(call)
        return {"placed": placed, "prefill_node": prefill_node.node_id, "decode_node": decode_node.node_id,
                "head_node": cluster.head_node.node_id, "tokens": tokens}
    finally:
        await server.stop()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print("REPORT " + json.dumps(asyncio.run(main())))

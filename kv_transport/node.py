"""The transport settings of a worker on its Ray node."""

from __future__ import annotations

import dataclasses

from pdserve.kv_transport.config import TransportConfig


def on_this_node(config: TransportConfig) -> TransportConfig:
    """`config` with the address this worker's Ray node registered (a pod IP, or 127.0.0.1
    for a local cluster) instead of the one the driver's config names: peers on other nodes
    must reach this one, and a loopback node keeps UCX on the loopback device."""
    import ray

    if not ray.is_initialized():
        return config
    node_id = ray.get_runtime_context().get_node_id()
    host = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    return dataclasses.replace(config, listen_host=host)

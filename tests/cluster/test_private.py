"""`pdserve serve` with a local cluster is private: nothing of its process tree listens
beyond loopback (gRPC, /metrics, Ray's GCS, raylets, agents, workers)."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import collect, free_port, serve_process

pytestmark = pytest.mark.slow

CONFIG = """\
engine:
  model: {device: cpu, dtype: float32}
  cache: {cpu_kv_cache_gib: 0.25}
pools: {gpus_per_worker: 0}
"""


@dataclass(frozen=True)
class Listener:
    ip: str
    port: int
    process: str

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.ip.removeprefix("::ffff:")).is_loopback


@pytest.fixture(scope="module")
def served(tmp_path_factory, ray_cluster) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """`pdserve serve` while another Ray runs on this host (this test worker's): the server
    starts a cluster of its own rather than joining that one (its GCS and raylet are in its
    process tree, and that Ray's end does not take its workers)."""
    config = tmp_path_factory.mktemp("private") / "serve.yaml"
    config.write_text(CONFIG)
    port = free_port()
    with serve_process([sys.executable, "-m", "pdserve.cluster.cli", "serve", "--config", str(config), "--port",
                        str(port), "--metrics-port", str(free_port()), "--http-port", str(free_port())]) as proc:
        yield proc, port


def _listeners(pid: int) -> list[Listener]:
    """Listening TCP sockets of `pid` and every process below it."""
    import psutil

    root = psutil.Process(pid)
    names = {p.pid: p.name() for p in [root, *root.children(recursive=True)]}
    return [Listener(c.laddr.ip, c.laddr.port, names[c.pid]) for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in names]


def test_a_local_cluster_listens_on_loopback_only(served):
    proc, port = served
    assert collect(f"127.0.0.1:{port}", "Hi", SamplingParams(temperature=0.0, max_tokens=2)).token_ids
    listeners = _listeners(proc.pid)
    names = {x.process for x in listeners}
    assert "gcs_server" in names and "raylet" in names, names  # the tree was read
    assert any(x.port == port for x in listeners)
    exposed = [x for x in listeners if not x.is_loopback]
    assert exposed == [], exposed


def test_the_kv_listener_is_on_loopback_too(served):
    """The KV transport has no listener (senders connect to the receiver's UCX worker
    address); UCX's TCP transport listens on the loopback device only."""
    proc, _ = served
    decode = [x for x in _listeners(proc.pid) if x.process.startswith("ray::DecodeWork")]
    assert decode and all(x.is_loopback for x in decode), decode

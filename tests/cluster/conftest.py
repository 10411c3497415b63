"""A real local Ray cluster and in-process pdserve servers (real actors, UCX, gRPC) for cluster
tests. The servers run the small model (tests/conftest.py) unless a test names another, and
`engine` here is one in-process engine of it, the reference their streams are held to."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.server import Server, start_server
from pdserve.cluster.settings.config import ServeConfig, config_from_dict
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import Engine
from tests.cluster.streams import free_port
from tests.conftest import SmallModel

# A tool-capable chat template that renders chats without tools as the model's own does
# (tests/engine/text/test_tools.py), so that the shared servers can serve tools with it.
TOOL_TEMPLATE = Path(__file__).parents[1] / "engine" / "text" / "chatml_tools.jinja"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    from pdserve.cluster.ray_driver import init_ray

    init_ray(None, "127.0.0.1", num_cpus=16)  # as `pdserve serve` starts its local cluster
    yield
    ray.shutdown()


@dataclass
class RunningServer:
    server: Server
    loop: asyncio.AbstractEventLoop
    config: ServeConfig

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.config.server.metrics_port}/metrics"

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        """Run a coroutine on the server's event loop (to reach the coordinator and actors)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


@pytest.fixture(scope="session")
def engine(small_model: SmallModel) -> Engine:
    """The small model in this process, as the servers' workers run it."""
    return Engine(EngineConfig(model=small_model.engine_config(), cache=CacheConfig(cpu_kv_cache_gib=0.25)))


def _server_config(model: SmallModel, **sections: dict[str, Any]) -> ServeConfig:
    base: dict[str, Any] = {
        "engine": {"model": {"source": str(model.folder), "device": "cpu", "dtype": "float32"},
                   "cache": {"cpu_kv_cache_gib": 0.25}},
        "server": {"port": 0, "http_port": 0, "metrics_port": 0},
        "pools": {"gpus_per_worker": 0},
        "health": {"interval_s": 0.5},
        "kv_transport": {"transfer_timeout_s": 30.0},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


StartServer = Callable[..., RunningServer]


def _start_server(model: SmallModel, **sections: dict[str, Any]) -> RunningServer:
    config = _server_config(model, **sections)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started: Future = asyncio.run_coroutine_threadsafe(start_server(config), loop)
    # Bounded generously: on 2 cores shared with another test worker, a tensor-parallel
    # worker's ranks load the model slowly, and a start is work, not a hang.
    return RunningServer(started.result(600), loop, config)


def _stop_server(srv: RunningServer) -> None:
    srv.run(srv.server.stop())
    srv.loop.call_soon_threadsafe(srv.loop.stop)


@pytest.fixture(scope="module")
def start(ray_cluster, small_model: SmallModel) -> Iterator[StartServer]:
    """start(pools={...}, server={...}) -> a running server on its own event-loop thread."""
    running: list[RunningServer] = []

    def start_one(**sections: dict[str, Any]) -> RunningServer:
        running.append(_start_server(small_model, **sections))
        return running[-1]

    yield start_one
    for srv in running:
        _stop_server(srv)


@pytest.fixture(scope="session")
def disaggregated_server(ray_cluster, small_model: SmallModel) -> Iterator[RunningServer]:
    """The default disaggregated server (one prefill, one decode worker), /metrics on a free
    port: started once per xdist worker and shared by every module that runs this config
    unchanged (serving, HTTP, structured outputs, fuzz, bench), since a start is minutes on
    CI's loaded CPU. Its tests leave every block free (they wait for it), and read counters
    as differences, so they do not depend on what ran before on it. It serves tools
    (test_tool_calls) with a tool-capable template and Llama 3's JSON tool-call format, which
    change nothing for chats without tools."""
    srv = _start_server(small_model, pools={"mode": "disaggregated"},
                        server={"metrics_port": free_port(), "chat_template": str(TOOL_TEMPLATE),
                                "tool_call_parser": "llama3_json"})
    yield srv
    _stop_server(srv)


@pytest.fixture(scope="session")
def colocated_server(ray_cluster, small_model: SmallModel) -> Iterator[RunningServer]:
    """The default colocated server (one worker doing both phases): started once per xdist
    worker and shared by the modules that run this config unchanged (serving, API tools),
    as disaggregated_server is."""
    srv = _start_server(small_model, pools={"mode": "colocated"})
    yield srv
    _stop_server(srv)


# The OpenAI API's official client against the module's own `srv` fixture (a running server).
@pytest.fixture(scope="module")
def client(srv):
    import openai

    with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id

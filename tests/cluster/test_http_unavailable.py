"""The HTTP API with no healthy worker: 503 in OpenAI's shape, from /health and from a
completion (a fake stands in for the coordinator and the worker set; token ids in, so no model)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.testclient import TestClient

from pdserve.cluster.api.frontend import Frontend
from pdserve.cluster.api.http_api import OpenAIApi
from pdserve.cluster.serving.errors import WorkerUnavailable
from pdserve.cluster.serving.metrics import Metrics
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import TokenDelta
from pdserve.engine.text.request_processor import RequestProcessor


class _NoWorkers:
    def unserved_roles(self) -> list[str]:
        return ["decode"]

    def capacity(self) -> int:
        return 0  # no healthy decode worker: no seats

    async def generate(self, req: WorkerRequest, report: object = None,
                       tenant: object = None) -> AsyncIterator[TokenDelta]:
        raise WorkerUnavailable("no healthy decode worker")
        yield  # an async generator, as the coordinator's is


def test_no_healthy_worker_is_503():
    frontend = Frontend(_NoWorkers(), _NoWorkers(), RequestProcessor(None, "tiny", 100, 64), Metrics(),  # type: ignore[arg-type]
                        default_timeout_s=30.0, retry_after_s=1.0)
    with TestClient(OpenAIApi(frontend).app()) as client:
        health = client.get("/health")
        assert health.status_code == 503 and "no healthy decode worker" in health.json()["error"]["message"]
        for stream in (False, True):
            resp = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "stream": stream})
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"] == {"message": "no healthy decode worker", "type": "server_error",
                                            "param": None, "code": "service_unavailable"}
    assert frontend.inflight == 0

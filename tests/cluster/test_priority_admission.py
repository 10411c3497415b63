"""The frontend's admission by priority and fair share (cluster/api/admission.py), without
Ray: on a full server a higher-priority arrival takes the place of the lowest-priority queued
request (the latest among equals), which is refused with RESOURCE_EXHAUSTED and its retry hint
and aborted in the pools; an arrival that outranks nobody queued is refused itself; a request
that has its first token is never displaced; at one priority, a tenant under its weighted
share takes the place of a queued request of a tenant over its own. The tenants file's rules."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.cluster.api.admission import fair_shares
from pdserve.cluster.api.frontend import Frontend, RequestFailed, Status
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.settings.tenants import DEFAULT_TENANT, Tenant, Tenants
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import TokenDelta
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.engine.text.request_processor import RequestProcessor


class FakeCoordinator:
    """Capacity `capacity`; each request waits until the test starts it (its first token),
    then until the test finishes it; one closed early is counted as aborted. Requests are
    known by a key of the test's (their first prompt token, less 500)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self.go: dict[int, asyncio.Event] = {}  # by the request's priority: tests give each its own
        self.done: dict[int, asyncio.Event] = {}
        self.aborted: list[int] = []

    def capacity(self) -> int:
        return self._capacity

    async def generate(self, req: WorkerRequest, report: object = None,
                       tenant: object = None) -> AsyncIterator[TokenDelta]:
        p = req.prompt_token_ids[0] - 500
        self.go[p], self.done[p] = asyncio.Event(), asyncio.Event()
        finished = False
        try:
            await self.go[p].wait()
            yield TokenDelta(req.request_id, (1,))
            await self.done[p].wait()
            finished = True
            yield TokenDelta(req.request_id, (2,), FinishReason.LENGTH)
        finally:
            if not finished:
                self.aborted.append(p)


def frontend(capacity: int) -> Frontend:
    processor = RequestProcessor(None, "fake", 1000, 64)
    return Frontend(FakeCoordinator(capacity), None, processor, Metrics(), 60.0, 2.0)  # type: ignore[arg-type]


async def run(front: Frontend, priority: int, tenant: Tenant = DEFAULT_TENANT,
              key: int | None = None) -> list[int] | RequestFailed:
    key = priority if key is None else key
    request = front.processor.process([500 + key, 2, 3], params=SamplingParams(max_tokens=2, priority=priority))
    try:
        return [t for d in [d async for d in front.generate(request, tenant=tenant)] for t in d.token_ids]
    except RequestFailed as e:
        return e


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_higher_priority_arrival_takes_the_lowest_priority_queued_ones_place():
    async def scenario() -> None:
        front = frontend(capacity=3)
        coord = front.coordinator
        tasks = {p: asyncio.create_task(run(front, p)) for p in (5, 7, 6)}  # all queued
        await settle()
        arrival = asyncio.create_task(run(front, 1))
        await settle()
        lowest = await tasks[7]
        assert isinstance(lowest, RequestFailed) and lowest.status is Status.RESOURCE_EXHAUSTED
        assert lowest.retry_after_s == 2.0 and "higher priority" in str(lowest)
        assert coord.aborted == [7] and front.inflight == 3
        # Full again: an arrival that outranks nobody queued is refused itself, as without priorities.
        refused = await run(front, 6)
        assert isinstance(refused, RequestFailed) and refused.status is Status.RESOURCE_EXHAUSTED
        assert coord.aborted == [7]
        # A request with its first token is running: not displaced.
        for p in (1, 5, 6):
            coord.go[p].set()
        await settle()
        assert isinstance(await run(front, 0), RequestFailed)
        for p in (1, 5, 6):
            coord.done[p].set()
        assert [await t for t in (arrival, tasks[5], tasks[6])] == [[1, 2]] * 3
        assert front.inflight == 0
        assert front.metrics.requests.labels("RESOURCE_EXHAUSTED")._value.get() == 3
        assert front.metrics.displaced.labels("default", "low")._value.get() == 1
        assert front.metrics.admitted.labels("default", "low")._value.get() == 4  # 5, 7, 6, 1
        # Refused at the frontend's capacity, by class: 6 (low) and 0 (default); 7 was displaced.
        assert front.metrics.refused.labels("default", "low", "admission")._value.get() == 1
        assert front.metrics.refused.labels("default", "default", "admission")._value.get() == 1
        # A queue time observed per first token, by class: 1, 5 and 6 got theirs.
        queued = front.metrics.queue_time.labels("default", "low")
        assert sum(b.get() for b in queued._buckets) == 3

    asyncio.run(scenario())


@pytest.mark.parametrize("queued, displaced", [((3, 3, 3), 2), ((5, 3, 4), 0), ((4, 3, 4), 2)])
def test_the_latest_of_the_lowest_priority_goes_first(queued, displaced):
    async def scenario() -> None:
        front = frontend(capacity=3)
        order = []
        for i, p in enumerate(queued):  # distinct keys for the fake: priority * 10 + arrival
            order.append(asyncio.create_task(run(front, p, key=p * 10 + i)))
            await settle()
        arrival = asyncio.create_task(run(front, 0, key=99))
        await settle()
        assert front.coordinator.aborted == [queued[displaced] * 10 + displaced]
        for key in list(front.coordinator.go):
            front.coordinator.go[key].set()
            front.coordinator.done[key].set()
        await asyncio.gather(arrival, *order)

    asyncio.run(scenario())


def test_a_tenant_under_its_share_takes_the_place_of_one_over_its_share():
    async def scenario() -> None:
        front = frontend(capacity=4)
        flood, chat = Tenant("flood", 1.0), Tenant("chat", 1.0)
        floods = [asyncio.create_task(run(front, 0, flood, key=i)) for i in range(4)]  # every place taken
        await settle()
        first = asyncio.create_task(run(front, 0, chat, key=10))  # chat: 0 of a share of 2
        await settle()
        assert front.coordinator.aborted == [3]  # the flood's latest queued request
        second = asyncio.create_task(run(front, 0, chat, key=11))  # 1 of 2: still within
        await settle()
        assert front.coordinator.aborted == [3, 2]
        third = await run(front, 0, chat, key=12)  # 3 of 2 would be over: no one is displaced
        assert isinstance(third, RequestFailed) and front.coordinator.aborted == [3, 2]
        assert isinstance(await run(front, 0, flood, key=20), RequestFailed)  # over its share: refused
        for key in (0, 1, 10, 11):
            front.coordinator.go[key].set()
            front.coordinator.done[key].set()
        results = await asyncio.gather(*floods, first, second)
        assert [isinstance(r, RequestFailed) for r in results] == [False, False, True, True, False, False]
        assert front.inflight == 0

    asyncio.run(scenario())


def test_weights_set_the_shares():
    async def scenario() -> None:
        front = frontend(capacity=4)
        light, heavy = Tenant("light", 1.0), Tenant("heavy", 3.0)
        lights = [asyncio.create_task(run(front, 0, light, key=i)) for i in range(4)]
        await settle()
        heavies = [asyncio.create_task(run(front, 0, heavy, key=10 + i)) for i in range(4)]
        await settle()
        assert front.coordinator.aborted == [3, 2, 1]  # heavy's share is 3 of 4, light's 1
        for key in (0, 10, 11, 12):
            front.coordinator.go[key].set()
            front.coordinator.done[key].set()
        results = await asyncio.gather(*lights, *heavies)
        assert [isinstance(r, RequestFailed) for r in results] == [False, True, True, True, False, False, False, True]

    asyncio.run(scenario())


def test_what_a_tenant_asking_little_leaves_goes_to_the_others():
    """Three tenants of equal weight on 8 places: chat holds 1, so a and b share the other 7
    (3.5 each), not a third of 8 (2.67) each: b's third arrival still displaces one of a's."""
    async def scenario() -> None:
        front = frontend(capacity=8)
        chat, a, b = Tenant("chat"), Tenant("a"), Tenant("b")
        tasks = [asyncio.create_task(run(front, 0, chat, key=0))]
        tasks += [asyncio.create_task(run(front, 0, a, key=10 + i)) for i in range(7)]  # every place taken
        await settle()
        tasks += [asyncio.create_task(run(front, 0, b, key=20 + i)) for i in range(3)]
        await settle()
        assert front.coordinator.aborted == [16, 15, 14]  # a's latest, down to its 4 (> 3.5 until then)
        assert isinstance(await run(front, 0, b, key=23), RequestFailed)  # b's 4th: over 3.5
        for key in (0, 10, 11, 12, 13, 20, 21, 22):
            front.coordinator.go[key].set()
            front.coordinator.done[key].set()
        results = await asyncio.gather(*tasks)
        assert sum(isinstance(r, RequestFailed) for r in results) == 3 and front.inflight == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("demand, weights, want", [
    ({"a": 9, "b": 9}, {"a": 1, "b": 1}, {"a": 4.0, "b": 4.0}),
    ({"a": 9, "b": 1, "c": 9}, {"a": 1, "b": 1, "c": 1}, {"a": 3.5, "b": 1.0, "c": 3.5}),
    ({"a": 9, "b": 9}, {"a": 3, "b": 1}, {"a": 6.0, "b": 2.0}),
    ({"a": 1, "b": 2}, {"a": 1, "b": 1}, {"a": 1.0, "b": 2.0}),
])
def test_fair_shares_are_weighted_max_min(demand, weights, want):
    assert fair_shares(8, demand, weights) == want


def test_the_tenants_file_names_a_requests_tenant_by_its_key(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: chat, weight: 3, api_keys: [k-chat]}\n"
                    "  - {name: batch, api_keys: [k-a, k-b]}\n")
    tenants = Tenants.load(str(path))
    assert tenants.of("Bearer k-chat") == Tenant("chat", 3.0) and tenants.of(b"Bearer k-b") == Tenant("batch", 1.0)
    assert tenants.of("Bearer nope") is DEFAULT_TENANT and tenants.of(None) is DEFAULT_TENANT
    assert sorted(tenants.keys) == ["k-a", "k-b", "k-chat"] and "k-chat" not in repr(tenants)
    assert Tenants.load("").of("Bearer k-chat") is DEFAULT_TENANT


@pytest.mark.parametrize("data, message", [
    ({}, "needs a non-empty list `tenants`"),
    ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}]}, "tenants[1].name"),
    ({"tenants": [{"name": "a", "weight": 0, "api_keys": ["k"]}]}, "tenants[0].weight must be a number > 0"),
    ({"tenants": [{"name": "a", "api_keys": []}]}, "tenants[0].api_keys must be a non-empty list"),
    ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]}, "a key is given twice"),
])
def test_a_bad_tenants_file_is_refused_by_field(data, message):
    with pytest.raises(ValueError) as e:
        Tenants.parse(data)
    assert message in str(e.value)


def test_every_tenants_key_is_a_client_token():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from pdserve.cluster.api.auth import BearerTokenMiddleware, bearer_matches

    tokens = ("api-key", "k-chat", "k-batch")  # what the server asks of clients with a tenants file
    assert bearer_matches("Bearer k-batch", tokens) and not bearer_matches("Bearer k-", tokens)
    app = Starlette(routes=[Route("/v1/models", lambda request: PlainTextResponse("ok"))])
    with TestClient(BearerTokenMiddleware(app, tokens)) as client:
        for token, status in (("api-key", 200), ("k-chat", 200), ("k-batch", 200), ("k-other", 401)):
            assert client.get("/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code == status

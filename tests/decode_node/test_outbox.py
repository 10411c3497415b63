"""A decode worker's outboxes: each frontend takes its own requests' deltas only, and a named
frontend that stops polling for its lease is expired (the worker then aborts its requests)."""

from __future__ import annotations

import asyncio

from pdserve.decode_node.outbox import Outboxes
from pdserve.engine.messages import owned_request_id, request_owner
from pdserve.engine.outputs import TokenDelta


def test_request_ids_carry_their_frontend():
    rid = owned_request_id("f1", "abc")
    assert rid == "f1/abc" and request_owner(rid) == "f1" and request_owner(f"{rid}~2") == "f1"
    assert owned_request_id("", "abc") == "abc" and request_owner("abc") == ""


def test_each_frontend_takes_its_own_deltas_and_a_silent_one_expires():
    async def run() -> None:
        boxes = Outboxes(lease_s=0.2)
        boxes.put([TokenDelta("f0/a", (1,)), TokenDelta("f1/b", (2,)), TokenDelta("c", (3,)),
                   TokenDelta("f0/a", (4,))])
        assert [d.token_ids for d in await boxes.take("f0", 1.0)] == [(1,), (4,)]
        assert [d.request_id for d in await boxes.take("f1", 1.0)] == ["f1/b"]
        assert [d.request_id for d in await boxes.take("", 1.0)] == ["c"]
        assert await boxes.take("f0", 0.01) == []  # nothing new: the wait is bounded
        waiting = asyncio.ensure_future(boxes.take("f1", 5.0))
        await asyncio.sleep(0.01)
        boxes.put([TokenDelta("f1/b", (5,))])
        assert [d.token_ids for d in await asyncio.wait_for(waiting, 1.0)] == [(5,)]  # woken at once
        await asyncio.sleep(0.15)
        await boxes.take("f1", 0.01)  # f1 renews; f0 and the unnamed one do not
        await asyncio.sleep(0.1)
        assert boxes.expired() == ["f0"]  # the unnamed frontend holds no lease
        assert boxes.expired() == []

    asyncio.run(run())

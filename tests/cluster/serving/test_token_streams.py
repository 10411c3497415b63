"""The decode workers' token deltas fanned out to the requests (cluster/serving/token_streams.py),
without Ray: workers whose `poll` hands out batches the test puts in."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import RayActorError

from pdserve.cluster.serving.pools import Pool, Worker
from pdserve.cluster.serving.router import WorkerState
from pdserve.cluster.serving.token_streams import TokenStreams, take_coalesced
from pdserve.engine.outputs import TokenDelta
from pdserve.engine.sequence import FinishReason


class _Poll:
    def __init__(self) -> None:
        self.batches: asyncio.Queue[list[TokenDelta] | Exception] = asyncio.Queue()
        self.calls = 0

    def remote(self, wait_s: float) -> Any:
        self.calls += 1
        return self._next()

    async def _next(self) -> list[TokenDelta]:
        batch = await self.batches.get()
        if isinstance(batch, Exception):
            raise batch
        return batch


class _Actor:
    def __init__(self) -> None:
        self.poll = _Poll()


def _worker(name: str) -> Worker:
    return Worker("decode", _Actor(), WorkerState(name), None)


def _delta(rid: str, token: int, reason: FinishReason | None = None) -> TokenDelta:
    return TokenDelta(rid, (token,), reason, (), 3, 0)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_deltas_reach_the_request_opened_on_their_worker_only():
    async def scenario() -> None:
        a, b = _worker("decode-a"), _worker("decode-b")
        streams = TokenStreams(Pool("decode", 2, None), poll_wait_s=0.1)
        q1, q2 = streams.open("r1", a), streams.open("r2", b)
        streams.follow(a)
        streams.follow(a)  # one poller a worker
        streams.follow(b)
        await _settle()
        assert a.actor.poll.calls == 1
        # r2 was continued on b: a's late delta for it is fenced off; one for nobody is dropped.
        a.actor.poll.batches.put_nowait([_delta("r1", 5), _delta("r2", 6), _delta("gone", 7)])
        b.actor.poll.batches.put_nowait([_delta("r2", 8, FinishReason.STOP)])
        await _settle()
        assert [q1.get_nowait().token_ids] == [(5,)] and q1.empty()
        assert [q2.get_nowait().token_ids] == [(8,)] and q2.empty()
        assert a.actor.poll.calls == 2  # polling on
        streams.close("r1")
        a.actor.poll.batches.put_nowait([_delta("r1", 9)])
        await _settle()
        assert q1.empty()
        streams.stop()

    asyncio.run(scenario())


def test_a_lost_worker_ends_its_requests_streams_and_is_replaced():
    async def scenario() -> None:
        a, b = _worker("decode-a"), _worker("decode-b")
        pool = Pool("decode", 2, None)
        replaced: list[Worker] = []

        async def replace(worker: Worker) -> None:
            replaced.append(worker)

        pool.replace = replace  # type: ignore[method-assign]
        streams = TokenStreams(pool, poll_wait_s=0.1)
        on_a, on_b = streams.open("r1", a), streams.open("r2", b)
        streams.follow(a)
        await _settle()
        a.actor.poll.batches.put_nowait(RayActorError())
        await _settle()
        assert replaced == [a]
        lost = RuntimeError("decode worker decode-a was lost")
        streams.leave(a, lost)
        assert on_a.get_nowait() is lost and on_b.empty()
        streams.follow(a)  # forgotten by leave(): a worker back to health is polled again
        await _settle()
        assert a.actor.poll.calls == 2
        streams.stop()

    asyncio.run(scenario())


def test_a_reader_that_fell_behind_takes_one_chunk_and_an_abort_or_error_on_its_own():
    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        assert queue.empty()
        for i in range(3):
            queue.put_nowait(TokenDelta("r", (i,)))
        queue.put_nowait(TokenDelta("r", (3,), FinishReason.LENGTH))
        merged = await take_coalesced(queue)
        assert (merged.token_ids, merged.finish_reason) == ((0, 1, 2, 3), FinishReason.LENGTH) and queue.empty()
        queue.put_nowait(TokenDelta("r", (5,)))
        assert (await take_coalesced(queue)).token_ids == (5,)  # nothing behind it: as it came
        lost = RuntimeError("worker lost")
        for item in (TokenDelta("r", (6,)), TokenDelta("r", (7,)), lost, TokenDelta("s", (1,)),
                     TokenDelta("s", (), FinishReason.ABORT)):
            queue.put_nowait(item)
        assert (await take_coalesced(queue)).token_ids == (6, 7)
        assert await take_coalesced(queue) is lost
        assert (await take_coalesced(queue)).token_ids == (1,)
        assert (await take_coalesced(queue)).finish_reason is FinishReason.ABORT

    asyncio.run(run())

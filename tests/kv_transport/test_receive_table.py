"""Direct writes at the receive table: a granted writer owns the blocks until it reports,
so a cancel or timeout never frees blocks that a copy may still reach."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

from pdserve.kv_transport import TransferCancelled, TransferError, TransferRejected, TransferTimeout
from pdserve.kv_transport.receive_table import ReceiveTable

pytestmark = pytest.mark.timeout(30)
TIMEOUT_S = 0.3


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


class Writer:
    """Records what the table answered a write request, and whether it aborted the writer."""

    def __init__(self) -> None:
        self.answers: list[torch.Tensor | TransferError] = []
        self.aborted = 0

    def grant(self, answer: torch.Tensor | TransferError) -> None:
        self.answers.append(answer)

    def abort(self) -> None:
        self.aborted += 1


def table() -> ReceiveTable:
    return ReceiveTable(torch.zeros(2, 2, 16, 4, 1, 8), TIMEOUT_S)


@pytest.mark.parametrize("grant_first", [False, True], ids=["expect-first", "write-first"])
def test_grant_then_written_lands(grant_first: bool) -> None:
    async def test() -> None:
        t, w = table(), Writer()
        if grant_first:
            t.grant("r", w.grant, w.abort)
            assert w.answers == [] and t.num_pending == 1
        landed = t.expect("r", [9, 2, 5])
        if not grant_first:
            t.grant("r", w.grant, w.abort)
        assert len(w.answers) == 1 and w.answers[0].tolist() == [9, 2, 5]
        assert not landed.done()
        t.written("r", "cuda_ipc")
        result = await landed
        assert result.ok and result.transport == "cuda_ipc" and t.num_pending == 0 and w.aborted == 0

    run(test)


def test_receiver_cancel_waits_for_the_writer() -> None:
    async def test() -> None:
        t, w = table(), Writer()
        landed = t.expect("r", [1, 2])
        t.grant("r", w.grant, w.abort)
        t.cancel("r")
        await asyncio.sleep(0.05)
        assert not landed.done(), "blocks freed while the writer may still be copying"
        t.written("r", "cuda_ipc")
        assert isinstance((await landed).error, TransferCancelled)

    run(test)


def test_writer_cancel_frees_at_once() -> None:
    async def test() -> None:
        t, w = table(), Writer()
        landed = t.expect("r", [1, 2])
        t.grant("r", w.grant, w.abort)
        t.cancel("r", "cancelled by the sender", writer_done=True)
        assert isinstance((await landed).error, TransferCancelled) and w.aborted == 0

    run(test)


def test_silent_writer_is_aborted_at_the_timeout() -> None:
    async def test() -> None:
        t, w = table(), Writer()
        landed = t.expect("r", [1, 2])
        t.grant("r", w.grant, w.abort)
        result = await landed
        assert isinstance(result.error, TransferTimeout) and w.aborted == 1
        t.written("r", "cuda_ipc")  # too late: ignored
        assert t.num_pending == 0

    run(test)


def test_unexpected_write_is_refused_after_the_timeout() -> None:
    async def test() -> None:
        t, w = table(), Writer()
        t.grant("nobody", w.grant, w.abort)
        await asyncio.sleep(TIMEOUT_S * 2)
        assert len(w.answers) == 1 and isinstance(w.answers[0], TransferRejected) and t.num_pending == 0

    run(test)


def test_second_write_and_write_after_failure_are_refused() -> None:
    async def test() -> None:
        t, first, second = table(), Writer(), Writer()
        landed = t.expect("r", [1, 2])
        t.grant("r", first.grant, first.abort)
        t.grant("r", second.grant, second.abort)
        assert isinstance(second.answers[0], TransferRejected)
        t.cancel("r", "cancelled by the sender", writer_done=True)
        await landed
        late = Writer()
        t.grant("r", late.grant, late.abort)  # tombstoned: the error at once
        assert isinstance(late.answers[0], TransferCancelled)

    run(test)


def test_close_aborts_writers() -> None:
    async def test() -> None:
        t, w = table(), Writer()
        landed = t.expect("r", [1, 2])
        t.grant("r", w.grant, w.abort)
        t.close()
        assert isinstance((await landed).error, TransferCancelled) and w.aborted == 1

    run(test)

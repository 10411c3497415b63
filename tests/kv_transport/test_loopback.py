"""The loopback transport, and through it the receive-side rules every transport shares."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

from pdserve.engine.kv.pool import KVLayout, KVPool
from pdserve.kv_transport import (
    HandshakeRefused,
    LoopbackNetwork,
    PeerLost,
    TransferCancelled,
    TransferRejected,
    TransferResult,
    TransferTimeout,
    TransportConfig,
    release_on_failure,
)

LAYOUT = KVLayout("tiny", torch.float16, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
CONFIG = TransportConfig(secret=b"loopback-secret-0", transfer_timeout_s=2.0)

pytestmark = pytest.mark.timeout(30)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def pools(num_blocks: int = 32) -> tuple[KVPool, KVPool]:
    src, dst = KVPool(LAYOUT, num_blocks, "cpu"), KVPool(LAYOUT, num_blocks, "cpu")
    src.kv.copy_(torch.randn_like(src.kv))
    return src, dst


@pytest.mark.parametrize("data_first", [False, True])
def test_scattered_blocks_land_byte_exact(data_first: bool) -> None:
    async def test() -> None:
        src, dst = pools()
        net = LoopbackNetwork()
        receiver, sender = net.receiver(dst.kv, LAYOUT, CONFIG), net.sender(src.kv, LAYOUT, CONFIG)
        send_ids, recv_ids = [7, 2, 30, 11], [5, 19, 0, 23]
        if data_first:
            sending = asyncio.ensure_future(sender.send("r", send_ids, receiver.address))
            await asyncio.sleep(0.01)
            landed = await receiver.expect("r", recv_ids)
            sent = await sending
        else:
            expecting = receiver.expect("r", recv_ids)
            sent, landed = await sender.send("r", send_ids, receiver.address), await expecting
        assert sent.ok and landed.ok and sent.transport == landed.transport == "loopback"
        assert sent.num_bytes == landed.num_bytes == 4 * LAYOUT.bytes_per_block
        assert torch.equal(dst.kv[:, :, recv_ids], src.kv[:, :, send_ids])
        untouched = [b for b in range(32) if b not in recv_ids]
        assert not dst.kv[:, :, untouched].any()
        assert receiver.num_pending == 0

    run(test)


@pytest.mark.parametrize(
    ("layout", "secret", "words"),
    [(dataclasses.replace(LAYOUT, block_size=16), CONFIG.secret, "block_size: ours 16, peer 4"),
     (LAYOUT, b"some-other-secret", "cluster secret")],
)
def test_handshake_mismatch_is_refused(layout: KVLayout, secret: bytes, words: str) -> None:
    async def test() -> None:
        src, dst = KVPool(layout, 8, "cpu"), KVPool(LAYOUT, 8, "cpu")
        net = LoopbackNetwork()
        receiver = net.receiver(dst.kv, LAYOUT, CONFIG)
        sender = net.sender(src.kv, layout, dataclasses.replace(CONFIG, secret=secret))
        result = await sender.send("r", [0], receiver.address)
        assert isinstance(result.error, HandshakeRefused) and words in str(result.error)
        with pytest.raises(HandshakeRefused):
            result.raise_for_error()

    run(test)


def test_expect_without_data_times_out_and_releases() -> None:
    async def test() -> None:
        _, dst = pools()
        receiver = LoopbackNetwork().receiver(dst.kv, LAYOUT, dataclasses.replace(CONFIG, transfer_timeout_s=0.05))
        released: list[bool] = []
        result = await release_on_failure(receiver.expect("r", [1, 2]), lambda: released.append(True))
        assert isinstance(result.error, TransferTimeout) and released == [True]
        assert receiver.num_pending == 0

    run(test)


def test_data_nobody_expects_is_rejected() -> None:
    async def test() -> None:
        src, dst = pools()
        net = LoopbackNetwork()
        receiver = net.receiver(dst.kv, LAYOUT, dataclasses.replace(CONFIG, transfer_timeout_s=0.05))
        result = await net.sender(src.kv, LAYOUT, CONFIG).send("r", [1], receiver.address)
        assert isinstance(result.error, TransferRejected) and receiver.num_pending == 0

    run(test)


def test_receiver_cancel_reaches_both_sides() -> None:
    async def test() -> None:
        src, dst = pools()
        net = LoopbackNetwork()
        receiver, sender = net.receiver(dst.kv, LAYOUT, CONFIG), net.sender(src.kv, LAYOUT, CONFIG)
        expecting = receiver.expect("r", [1])
        receiver.cancel("r")
        assert isinstance((await expecting).error, TransferCancelled)
        # Data arriving after the cancel is refused at once, not parked until the timeout.
        assert isinstance((await sender.send("r", [3], receiver.address)).error, TransferCancelled)
        assert not dst.kv.any()

    run(test)


def test_cancelled_caller_task_releases_blocks() -> None:
    async def test() -> None:
        _, dst = pools()
        receiver = LoopbackNetwork().receiver(dst.kv, LAYOUT, CONFIG)
        released: list[bool] = []
        waiter = asyncio.ensure_future(release_on_failure(receiver.expect("r", [1]), lambda: released.append(True)))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert released == [True] and receiver.num_pending == 0

    run(test)


def test_block_count_mismatch_is_rejected_on_both_sides() -> None:
    async def test() -> None:
        src, dst = pools()
        net = LoopbackNetwork()
        receiver, sender = net.receiver(dst.kv, LAYOUT, CONFIG), net.sender(src.kv, LAYOUT, CONFIG)
        expecting = receiver.expect("r", [1, 2, 3])
        sent = await sender.send("r", [4, 5], receiver.address)
        assert isinstance(sent.error, TransferRejected) and isinstance((await expecting).error, TransferRejected)
        assert not dst.kv.any()

    run(test)


def test_closed_receiver() -> None:
    async def test() -> None:
        src, dst = pools()
        net = LoopbackNetwork()
        receiver, sender = net.receiver(dst.kv, LAYOUT, CONFIG), net.sender(src.kv, LAYOUT, CONFIG)
        expecting = receiver.expect("r", [1])
        await receiver.close()
        assert isinstance((await expecting).error, TransferCancelled)
        assert isinstance((await sender.send("r", [1], receiver.address)).error, PeerLost)

    run(test)


def test_success_does_not_release() -> None:
    async def test() -> None:
        src, dst = pools()
        net = LoopbackNetwork()
        receiver, sender = net.receiver(dst.kv, LAYOUT, CONFIG), net.sender(src.kv, LAYOUT, CONFIG)
        released: list[bool] = []
        expecting = release_on_failure(receiver.expect("r", [1]), lambda: released.append(True))
        result: TransferResult
        _, result = await asyncio.gather(sender.send("r", [2], receiver.address), expecting)
        assert result.ok and released == []

    run(test)


@pytest.mark.parametrize("block_ids", [[], [-1], [32], [1, 1]])
def test_bad_block_ids_are_caller_bugs(block_ids: list[int]) -> None:
    async def test() -> None:
        src, dst = pools()
        net = LoopbackNetwork()
        receiver, sender = net.receiver(dst.kv, LAYOUT, CONFIG), net.sender(src.kv, LAYOUT, CONFIG)
        with pytest.raises(ValueError):
            receiver.expect("r", block_ids)
        with pytest.raises(ValueError):
            await sender.send("r", block_ids, receiver.address)

    run(test)


def test_duplicate_expect_is_a_caller_bug() -> None:
    async def test() -> None:
        _, dst = pools()
        receiver = LoopbackNetwork().receiver(dst.kv, LAYOUT, CONFIG)
        receiver.expect("r", [1])
        with pytest.raises(ValueError):
            receiver.expect("r", [2])
        await receiver.close()

    run(test)


def test_a_prepared_request_outlasts_the_transfer_timeout() -> None:
    """The receiver's bound runs from its sender's last word, not from the reservation: a
    prefill far longer than the timeout (here 5x) lands, while a request that no sender
    prepared, or one its sender forgot, times out as before."""
    async def test() -> None:
        src, dst = pools()
        config = dataclasses.replace(CONFIG, transfer_timeout_s=0.2)
        net = LoopbackNetwork()
        receiver, sender = net.receiver(dst.kv, LAYOUT, config), net.sender(src.kv, LAYOUT, config)
        slow, orphan, dropped = receiver.expect("slow", [1, 2]), receiver.expect("orphan", [3]), \
            receiver.expect("dropped", [4])
        sender.prepare("slow", receiver.address)
        sender.prepare("dropped", receiver.address)
        await asyncio.sleep(0.1)
        sender.forget("dropped")
        await asyncio.sleep(0.9)  # "the prefill"
        sent = await sender.send("slow", [5, 6], receiver.address)
        assert sent.ok and (await slow).ok
        assert torch.equal(dst.kv[:, :, [1, 2]], src.kv[:, :, [5, 6]])
        assert isinstance((await orphan).error, TransferTimeout)
        assert isinstance((await dropped).error, TransferTimeout)
        assert receiver.num_pending == 0
        await sender.close()

    run(test)

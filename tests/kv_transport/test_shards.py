"""KV between workers of different tensor-parallel sizes: the wire carries every KV head in
the one-rank layout; a sender gathers each head from a rank that holds it, a receiver writes
each head into every rank that holds it (replicated heads too). Through the loopback
transport, whose receive table and gather/scatter every transport shares."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.engine.kv.pool import KVLayout
from pdserve.kv_transport import HandshakeRefused, LoopbackNetwork, TransportConfig
from pdserve.kv_transport.shards import PoolShards

HEADS = 2
LAYOUT = KVLayout("tiny", torch.float16, num_layers=2, num_kv_heads=HEADS, head_dim=8, block_size=4)
CONFIG = TransportConfig(secret=b"loopback-secret-0", transfer_timeout_s=2.0)
NUM_BLOCKS = 32

pytestmark = pytest.mark.timeout(30)


def split(full: torch.Tensor, tp: int) -> PoolShards:
    """A worker of `tp` ranks holding `full`'s KV heads as engine.parallel.ShardPlan splits
    them: divided when there are at least as many heads as ranks, else replicated."""
    if tp <= HEADS:
        per = HEADS // tp
        return PoolShards([(full[:, :, :, :, r * per:(r + 1) * per].clone(), r * per) for r in range(tp)], HEADS)
    return PoolShards([(full[:, :, :, :, r // (tp // HEADS):r // (tp // HEADS) + 1].clone(), r // (tp // HEADS))
                       for r in range(tp)], HEADS)


def full_pool() -> torch.Tensor:
    return torch.zeros(LAYOUT.num_layers, 2, NUM_BLOCKS, LAYOUT.block_size, HEADS, LAYOUT.head_dim,
                       dtype=LAYOUT.dtype)


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2), (2, 4), (4, 2), (1, 4), (4, 1)])
def test_blocks_land_byte_exact_in_every_rank_that_holds_their_heads(src_tp: int, dst_tp: int) -> None:
    async def test() -> None:
        want = full_pool()
        want.copy_(torch.randn_like(want))
        src, dst = split(want, src_tp), split(full_pool(), dst_tp)
        net = LoopbackNetwork()
        receiver, sender = net.receiver(dst, LAYOUT, CONFIG), net.sender(src, LAYOUT, CONFIG)
        send_ids, recv_ids = [7, 2, 30, 11], [5, 19, 0, 23]
        expecting = receiver.expect("r", recv_ids)
        sent, landed = await sender.send("r", send_ids, receiver.address), await expecting
        assert sent.ok and landed.ok, (sent.error, landed.error)
        assert sent.num_bytes == landed.num_bytes == 4 * LAYOUT.bytes_per_block  # every head, once
        untouched = [b for b in range(NUM_BLOCKS) if b not in recv_ids]
        for kv, start in dst.shards:
            heads = slice(start, start + kv.shape[4])
            assert torch.equal(kv[:, :, recv_ids], want[:, :, send_ids][:, :, :, :, heads]), f"rank of heads {heads}"
            assert not kv[:, :, untouched].any(), "a block outside the request was written"

    asyncio.run(test())


def test_a_rank_layout_on_the_wire_is_refused() -> None:
    """The wire's layout is the model's: a worker that announced one rank's share of the
    heads instead would scatter garbage, and the handshake refuses it by name."""
    async def test() -> None:
        net = LoopbackNetwork()
        rank_layout = KVLayout("tiny", torch.float16, 2, 1, 8, 4, tp_size=2, kv_head_start=1)
        receiver = net.receiver(split(full_pool(), 2), LAYOUT, CONFIG)
        sender = net.sender(split(full_pool(), 2), rank_layout, CONFIG)
        receiver.expect("r", [1])
        result = await sender.send("r", [1], receiver.address)
        assert isinstance(result.error, HandshakeRefused)
        assert "num_kv_heads" in str(result.error) and "tp_size" in str(result.error)

    asyncio.run(test())


def test_shards_must_hold_every_head_of_one_shape() -> None:
    pool = full_pool()
    with pytest.raises(ValueError, match="not all 2"):
        PoolShards([(pool[:, :, :, :, :1], 0)], HEADS)
    with pytest.raises(ValueError, match="outside the model"):
        PoolShards([(pool, 1)], HEADS)
    with pytest.raises(ValueError, match="disagree"):
        PoolShards([(pool[:, :, :, :, :1], 0), (pool[:, :, :8, :, 1:], 1)], HEADS)

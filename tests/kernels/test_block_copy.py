"""copy_blocks against indexing in torch: scattered ids on both sides, pools of different
sizes, every dtype width, blocks whose size is not a multiple of the copy chunk."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.block_copy import copy_blocks
from pdserve.kv_transport.staging import blocks_view

COVERS = ("copy_blocks",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pools(shape: tuple[int, ...], src_blocks: int, dst_blocks: int, dtype: torch.dtype):
    layers, _, block_size, heads, head_dim = shape
    src = torch.randn(layers, 2, src_blocks, block_size, heads, head_dim, device=DEVICE).to(dtype)
    dst = torch.full((layers, 2, dst_blocks, block_size, heads, head_dim), float("nan"), device=DEVICE).to(dtype)
    return src, dst


@pytest.mark.parametrize("shape", [(2, 2, 16, 2, 16), (3, 2, 16, 1, 24), (1, 2, 32, 3, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 5])
def test_copy_blocks_matches_indexing(shape, dtype, n):
    src, dst = _pools(shape, src_blocks=9, dst_blocks=7, dtype=dtype)
    gen = torch.Generator().manual_seed(n)
    src_ids = torch.randperm(9, generator=gen)[:n].to(DEVICE)
    dst_ids = torch.randperm(7, generator=gen)[:n].to(DEVICE)
    expected = dst.clone()
    expected[:, :, dst_ids] = src[:, :, src_ids]
    copy_blocks(blocks_view(src), src_ids, blocks_view(dst), dst_ids, chunk=64)
    # equal_nan: blocks not named keep their NaN poison; the named ones match bit for bit.
    assert torch.equal(dst.isnan(), expected.isnan())
    assert torch.equal(dst.nan_to_num(), expected.nan_to_num())


def test_copy_blocks_nothing_to_copy():
    src, dst = _pools((1, 2, 16, 1, 16), 2, 2, torch.float32)
    none = torch.empty(0, dtype=torch.int64, device=DEVICE)
    copy_blocks(blocks_view(src), none, blocks_view(dst), none)
    assert dst.isnan().all()


@pytest.mark.gpu
def test_copy_blocks_llama_8b_layout_gpu():
    """The transport's real shape: 32 layers, 8 KV heads, head dim 128, bf16, block 16."""
    src, dst = _pools((32, 2, 16, 8, 128), 600, 500, torch.bfloat16)
    src_ids, dst_ids = torch.randperm(600, device=DEVICE)[:256], torch.randperm(500, device=DEVICE)[:256]
    expected = dst.clone()
    expected[:, :, dst_ids] = src[:, :, src_ids]
    copy_blocks(blocks_view(src), src_ids, blocks_view(dst), dst_ids)
    assert torch.equal(dst.isnan(), expected.isnan())
    assert torch.equal(dst.nan_to_num(), expected.nan_to_num())


def test_copy_blocks_copies_only_count_pairs():
    """The count is read on the GPU (a captured launch replays for any request size)."""
    src, dst = _pools((2, 2, 16, 1, 16), 6, 6, torch.float32)
    src_ids, dst_ids = torch.tensor([4, 0, 2, 5], device=DEVICE), torch.tensor([1, 3, 0, 2], device=DEVICE)
    expected = dst.clone()
    expected[:, :, dst_ids[:2]] = src[:, :, src_ids[:2]]
    count = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    copy_blocks(blocks_view(src), src_ids.int(), blocks_view(dst), dst_ids.int(), count=count)
    assert torch.equal(dst.isnan(), expected.isnan())
    assert torch.equal(dst.nan_to_num(), expected.nan_to_num())


@pytest.mark.gpu
def test_pool_writer_replays_one_graph_for_requests_of_any_size_gpu():
    """The direct path's writer: a captured copy per slot, ids through pinned memory."""
    import numpy as np

    from pdserve.kv_transport.pool_writer import PoolWriter

    src, dst = _pools((4, 2, 16, 8, 128), 300, 200, torch.bfloat16)
    writer = PoolWriter(src, dst)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 37, 150, 1, 150):
        src_ids, dst_ids = torch.randperm(300, generator=gen)[:n], torch.randperm(200, generator=gen)[:n]
        slot = writer.write(src_ids.numpy().astype(np.int32), dst_ids.numpy().astype(np.int32))
        writer.stream.synchronize()
        writer.release(slot)
        assert torch.equal(dst[:, :, dst_ids.to(DEVICE)], src[:, :, src_ids.to(DEVICE)])


@pytest.mark.gpu
def test_pool_writer_past_the_first_slot_and_behind_an_event_gpu():
    """A request of more ids than the first slot holds gets a slot (and graphs) of its own;
    a write named `after` an event copies what the work before that event wrote, even when
    that work is still running on another stream as the write is queued."""
    import numpy as np

    from pdserve.kv_transport.pool_writer import _MIN_SLOT_IDS, PoolWriter

    src, dst = _pools((1, 2, 16, 1, 128), 3000, 2600, torch.bfloat16)
    writer = PoolWriter(src, dst)
    gen = torch.Generator().manual_seed(1)
    n = _MIN_SLOT_IDS + 500
    src_ids, dst_ids = torch.randperm(3000, generator=gen)[:n], torch.randperm(2600, generator=gen)[:n]
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(20_000_000)  # ~10 ms: the write below is queued long before this ends
        src.fill_(7.0)
        kv_done = torch.cuda.Event()
        kv_done.record()
    slot = writer.write(src_ids.numpy().astype(np.int32), dst_ids.numpy().astype(np.int32), after=kv_done)
    assert slot.capacity >= n
    writer.stream.synchronize()
    writer.release(slot)
    got = dst[:, :, dst_ids.to(DEVICE)]
    assert bool((got == 7.0).all())
    untouched = dst.isnan().transpose(0, 2).reshape(2600, -1).all(1)  # per block: still all NaN
    assert int(untouched.sum()) == 2600 - n

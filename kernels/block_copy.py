"""Copy scattered KV blocks of one pool into scattered blocks of another, in one launch.

The KV transport's direct path: `dst` is the decode worker's pool mapped into the
prefill worker through a CUDA IPC handle, so every store crosses NVLink once, with no
staging buffer on either side (a gather, a peer copy and a scatter would move the bytes
three times).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr,            # [planes, num_blocks, words] (strided over planes and blocks)
    src_ids_ptr, dst_ids_ptr,    # [>= count] int32 or int64
    count_ptr,                   # [1] int32: how many id pairs to copy (read on the GPU)
    src_plane_stride, src_block_stride, dst_plane_stride, dst_block_stride,
    PLANES: tl.constexpr, WORDS: tl.constexpr, CHUNK: tl.constexpr,
):
    # Persistent: a fixed grid walks (pair, plane) items, so one launch (or one captured
    # CUDA graph) serves any count up to the id buffers' length.
    total = tl.load(count_ptr).to(tl.int64) * PLANES
    offs = tl.arange(0, CHUNK)
    for item in tl.range(tl.program_id(0), total, tl.num_programs(0)):
        pair, plane = item // PLANES, item % PLANES
        src = src_ptr + plane * src_plane_stride + tl.load(src_ids_ptr + pair).to(tl.int64) * src_block_stride
        dst = dst_ptr + plane * dst_plane_stride + tl.load(dst_ids_ptr + pair).to(tl.int64) * dst_block_stride
        for start in tl.static_range(0, WORDS, CHUNK):
            mask = start + offs < WORDS
            tl.store(dst + start + offs, tl.load(src + start + offs, mask=mask), mask=mask)


PROGRAMS_PER_SM = 8


def copy_blocks(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor,
    count: torch.Tensor | None = None, chunk: int = 1024, num_warps: int = 4, programs_per_sm: int = PROGRAMS_PER_SM,
) -> None:
    """dst[:, dst_ids[i]] = src[:, src_ids[i]] for i < count, asynchronously on the current stream.

    Args:
        src, dst: [planes, num_blocks, words], same dtype and planes/words, last dim
            contiguous (the pools viewed as rows of one block, e.g. `staging.blocks_view`).
            `dst` may live on another GPU (peer memory mapped into this process).
        src_ids, dst_ids: [n] int32 or int64 on src's device, same length and dtype; dst_ids
            must not repeat.
        count: [1] int32 on src's device, the number of pairs to copy (<= n), read by the
            kernel, so that a captured launch can be replayed for any count; None: all n.
        chunk: words one program moves per step (power of two); num_warps: per program;
        programs_per_sm: the persistent grid's size per SM (on CUDA).

    No host sync; allocates only when `count` is None.
    """
    planes, _, words = src.shape
    assert dst.shape[0] == planes and dst.shape[2] == words, (src.shape, dst.shape)
    assert src.dtype == dst.dtype and src.stride(2) == 1 and dst.stride(2) == 1
    assert src_ids.shape == dst_ids.shape and src_ids.dim() == 1, (src_ids.shape, dst_ids.shape)
    assert src_ids.dtype == dst_ids.dtype and src_ids.dtype in (torch.int32, torch.int64)
    assert src_ids.device == dst_ids.device == src.device, (src_ids.device, dst_ids.device, src.device)
    if src_ids.numel() == 0:
        return
    if count is None:
        count = torch.full((1,), src_ids.numel(), dtype=torch.int32, device=src.device)
    items = src_ids.numel() * planes
    if src.is_cuda:
        items = min(items, programs_per_sm * torch.cuda.get_device_properties(src.device).multi_processor_count)
    chunk = min(chunk, triton.next_power_of_2(words))
    _copy_blocks_kernel[(items,)](
        src, dst, src_ids, dst_ids, count, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        PLANES=planes, WORDS=words, CHUNK=chunk, num_warps=num_warps,
    )

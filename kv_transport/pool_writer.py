"""Direct writes: copy a request's blocks of the local pool into a peer's pool mapped here.

One kernel launch per request (kernels.block_copy, one NVLink pass, no staging). The
per-request host work is the transfer's fixed cost, so it is kept small: block ids go
to the GPU as int32 through pinned buffers reused across requests (one host-to-device
copy, no allocation), and the copy runs on a high-priority stream of its own, so that
it neither waits for nor queues behind later compute on the caller's stream (the
caller's KV must be complete when it asks: the prefill worker's sampling waited for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.block_copy import copy_blocks
from kv_transport.staging import blocks_view

_MIN_SLOT_IDS = 1024  # int32 ids per pinned slot at least (4 KiB); larger requests get larger slots


@dataclass(slots=True)
class _Slot:
    """Pinned host ids and their device copy; one request's until its copy is done."""

    host: torch.Tensor  # [capacity] int32, pinned
    device: torch.Tensor  # [capacity] int32, on the pool's GPU


class PoolWriter:
    """Copies blocks of `src` into blocks of `dst`, the same layout, possibly another GPU's.

    Args:
        src: the local pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        dst: the peer's pool of the same layout (its block count may differ), mapped here.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._src, self._dst = blocks_view(src), blocks_view(dst)
        self._cuda = src.is_cuda
        # Lower numbers run first: the copy's programs are scheduled ahead of queued compute.
        self.stream = torch.cuda.Stream(src.device, priority=-1) if self._cuda else None
        self._free: list[_Slot] = []

    def write(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> _Slot | None:
        """Queue dst blocks `dst_ids` = src blocks `src_ids` (int32 arrays, same length).

        On CUDA the copy is queued on `self.stream`: record an event there to know when it
        is done, then `release()` the returned slot. On the CPU it is done on return (None).
        """
        if not self._cuda:
            src_t, dst_t = torch.from_numpy(src_ids).long(), torch.from_numpy(dst_ids).long()
            self._dst.index_copy_(1, dst_t, self._src.index_select(1, src_t))
            return None
        n = len(src_ids)
        half = -(-n // 4) * 4  # dst ids 16-byte aligned: one compiled variant of the kernel
        slot = self._acquire(half + n)
        host = slot.host.numpy()
        host[:n], host[half:half + n] = src_ids, dst_ids
        with torch.cuda.stream(self.stream):
            ids = slot.device[:half + n]
            ids.copy_(slot.host[:half + n], non_blocking=True)
            copy_blocks(self._src, ids[:n], self._dst, ids[half:])
        return slot

    def release(self, slot: _Slot | None) -> None:
        """Give a slot back once the copy that used it is done (its event has completed)."""
        if slot is not None:
            self._free.append(slot)

    def _acquire(self, num_ids: int) -> _Slot:
        for i, slot in enumerate(self._free):
            if slot.host.numel() >= num_ids:
                return self._free.pop(i)
        capacity = max(_MIN_SLOT_IDS, 1 << (num_ids - 1).bit_length())
        device = self._src.device
        return _Slot(torch.empty(capacity, dtype=torch.int32, pin_memory=True),
                     torch.empty(capacity, dtype=torch.int32, device=device))

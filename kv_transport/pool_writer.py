"""Direct writes: copy a request's blocks of the local pool into a peer's pool mapped here.

One copy kernel per request (kernels.block_copy, one NVLink pass, no staging). The
per-request host work is the transfer's fixed cost, so it is kept small: the ids are
written into pinned buffers reused across requests, and one replay of a CUDA graph
(captured once per buffer) moves them to the GPU and runs the copy; a plain Triton
launch costs ~75 us of host time on the H200 machines' CPUs, more than the copy of a
256-token request. The copy runs on a high-priority stream of its own, so that it
neither waits for nor queues behind later compute on the caller's stream: it waits only
for the event the caller names as the end of the work that wrote the KV (the prefill
engine's forward), or for nothing when the caller has synchronized.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels.block_copy import copy_blocks
from pdserve.kv_transport.staging import blocks_view

_MIN_SLOT_IDS = 1024  # id pairs per slot at least (8 KiB of ids); larger requests get larger slots
_HEAD = 4  # int32 words before the ids: the count, padded so that the ids stay 16-byte aligned


class _Slot:
    """Pinned ids and a captured copy: one request's until its copy is done.

    Layout of `host` and `device` (int32): [count, pad x3, src ids x capacity, dst ids x
    capacity]. The CUDA graph copies host to device and runs the copy kernel, which reads
    the count on the GPU: one replay per request, whatever its size up to `capacity`.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, capacity: int, stream: torch.cuda.Stream) -> None:
        self.capacity = capacity
        self.host = torch.zeros(_HEAD + 2 * capacity, dtype=torch.int32, pin_memory=True)
        self.ids = self.host.numpy()
        self._device = torch.zeros(_HEAD + 2 * capacity, dtype=torch.int32, device=src.device)
        self._src, self._dst = src, dst
        with torch.cuda.stream(stream):
            self._launch()  # compiles the kernel outside the capture (count 0: copies nothing)
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the caller's other threads (the engine's) keep using CUDA meanwhile.
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self._launch()

    def _launch(self) -> None:
        self._device.copy_(self.host, non_blocking=True)
        ids = self._device[_HEAD:]
        copy_blocks(self._src, ids[:self.capacity], self._dst, ids[self.capacity:], count=self._device[:1])


class PoolWriter:
    """Copies blocks of `src` into blocks of `dst`, the same layout, possibly another GPU's.

    Args:
        src: the local pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        dst: the peer's pool of the same layout (its block count may differ), mapped here.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._src, self._dst = blocks_view(src), blocks_view(dst)
        self._free: list[_Slot] = []
        self.stream: torch.cuda.Stream | None = None
        if src.is_cuda:
            # Lower numbers run first: the copy's programs are scheduled ahead of queued compute.
            self.stream = torch.cuda.Stream(src.device, priority=-1)
            self._free.append(_Slot(self._src, self._dst, _MIN_SLOT_IDS, self.stream))

    def write(self, src_ids: np.ndarray, dst_ids: np.ndarray, after: torch.cuda.Event | None = None) -> _Slot | None:
        """Queue dst blocks `dst_ids` = src blocks `src_ids` (int32 arrays, same length),
        behind `after` if given (the event of the work that writes the source blocks).

        On CUDA the copy is queued on `self.stream`: record an event there to know when it
        is done, then `release()` the returned slot. On the CPU it is done on return (None).
        """
        if self.stream is None:
            if after is not None:
                after.synchronize()
            src_t, dst_t = torch.from_numpy(src_ids).long(), torch.from_numpy(dst_ids).long()
            self._dst.index_copy_(1, dst_t, self._src.index_select(1, src_t))
            return None
        n = len(src_ids)
        slot = self._acquire(n)
        ids, capacity = slot.ids, slot.capacity
        ids[0] = n
        ids[_HEAD:_HEAD + n] = src_ids
        ids[_HEAD + capacity:_HEAD + capacity + n] = dst_ids
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            slot.graph.replay()
        return slot

    def release(self, slot: _Slot | None) -> None:
        """Give a slot back once the copy that used it is done (its event has completed)."""
        if slot is not None:
            self._free.append(slot)

    def _acquire(self, n: int) -> _Slot:
        for i, slot in enumerate(self._free):
            if slot.capacity >= n:
                return self._free.pop(i)
        assert self.stream is not None
        return _Slot(self._src, self._dst, max(_MIN_SLOT_IDS, 1 << (n - 1).bit_length()), self.stream)

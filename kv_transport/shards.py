"""A worker's KV pool as the transport moves it: every KV head of the model, whichever of
the worker's tensor-parallel ranks holds it.

On the wire a block always carries all of the model's KV heads, in the one-rank layout
(`KVLayout` with tp_size 1): a sender gathers each head from the first of its ranks that
holds it, a receiver writes each head into every one of its ranks that holds it (KV heads
replicated over ranks get every copy). So any two tensor-parallel sizes pair, and the
handshake's fingerprint compares the model's layout, not the split. A worker of one rank
moves its pool's words as they are (`staging`); only one-rank pools offer the direct
CUDA IPC path (`single`).
"""

from __future__ import annotations

import torch

from pdserve.kv_transport.staging import blocks_view, empty_staging, gather_blocks, scatter_blocks


class PoolShards:
    """The pools of a worker's ranks: (kv, first KV head) each, kv shaped
    [num_layers, 2, num_blocks, block_size, heads of that rank, head_dim], the same block
    ids on every rank. On the CPU the other ranks' pools are shared memory; on CUDA they
    are mapped here (CUDA IPC) and may sit on other GPUs of the host."""

    def __init__(self, shards: list[tuple[torch.Tensor, int]], num_kv_heads: int) -> None:
        if not shards:
            raise ValueError("PoolShards needs at least one pool")
        first = shards[0][0]
        for kv, start in shards:
            if kv.dim() != 6 or kv.shape[:4] != first.shape[:4] or kv.shape[5] != first.shape[5] \
                    or kv.dtype != first.dtype:
                raise ValueError(f"pool shards disagree: {tuple(kv.shape)} {kv.dtype} vs "
                                 f"{tuple(first.shape)} {first.dtype}")
            if not 0 <= start or start + kv.shape[4] > num_kv_heads:
                raise ValueError(f"a shard of heads [{start}, {start + kv.shape[4]}) lies outside the model's "
                                 f"{num_kv_heads} KV heads")
        held = {h for kv, start in shards for h in range(start, start + kv.shape[4])}
        if held != set(range(num_kv_heads)):
            raise ValueError(f"the shards hold KV heads {sorted(held)}, not all {num_kv_heads}")
        self.shards = shards
        self.num_kv_heads = num_kv_heads
        self._first = first
        layers, two, _, bs, _, d = first.shape
        self._full_shape = (layers, two, bs, num_kv_heads, d)

    @classmethod
    def of(cls, kv: torch.Tensor | PoolShards) -> PoolShards:
        """A one-rank pool as shards (shards as they are)."""
        return kv if isinstance(kv, PoolShards) else cls([(kv, 0)], kv.shape[4])

    @property
    def single(self) -> torch.Tensor | None:
        """The pool when one tensor holds every head (the direct-write path needs it)."""
        return self._first if len(self.shards) == 1 else None

    @property
    def num_blocks(self) -> int:
        return self._first.shape[2]

    @property
    def device(self) -> torch.device:
        """Where the transport's buffers live: the first shard's (rank 0's) device."""
        return self._first.device

    @property
    def is_cuda(self) -> bool:
        return self._first.is_cuda

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block on the wire: every layer, K and V, every KV head."""
        return self._first[:, :, 0].numel() * self._first.element_size() * self.num_kv_heads // self._first.shape[4]

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks `ids` (int64) as one contiguous staging tensor [num_layers * 2, n, words]
        on `device`, queued on the current stream (see `staging.gather_blocks`)."""
        if self.single is not None:
            return gather_blocks(self.single, ids)
        layers, two, bs, heads, d = self._full_shape
        full = torch.empty((layers, two, ids.numel(), bs, heads, d), dtype=self._first.dtype, device=self.device)
        filled: set[int] = set()
        for kv, start in self.shards:
            heads = [h for h in range(start, start + kv.shape[4]) if h not in filled]
            if not heads:
                continue
            lo, hi = heads[0] - start, heads[-1] - start + 1  # a rank's new heads are consecutive
            part = kv[:, :, :, :, lo:hi].index_select(2, ids.to(kv.device))
            full[:, :, :, :, start + lo:start + hi] = part.to(self.device, non_blocking=True)
            filled.update(heads)
        return blocks_view(full)

    def scatter(self, ids: torch.Tensor, staging: torch.Tensor) -> None:
        """Write a staging tensor from `gather` into blocks `ids` of every rank, each its
        own heads; queued on the current stream."""
        if self.single is not None:
            scatter_blocks(self.single, ids, staging)
            return
        layers, two, bs, heads, d = self._full_shape
        full = staging.view(self._first.dtype).view(layers, two, ids.numel(), bs, heads, d)
        for kv, start in self.shards:
            part = full[:, :, :, :, start:start + kv.shape[4]].to(kv.device, non_blocking=True)
            kv.index_copy_(2, ids.to(kv.device), part.contiguous())
            if kv.is_cuda and kv.device != self.device:
                # Written on that GPU's stream: the caller's stream (whose event says "landed")
                # waits for it, so that nothing reads the blocks before every rank has them.
                done = torch.cuda.current_stream(kv.device).record_event()
                torch.cuda.current_stream(self.device).wait_event(done)

    def empty_staging(self, num_blocks: int) -> torch.Tensor:
        """An uninitialised staging tensor for `num_blocks` wire blocks, on `device`."""
        if self.single is not None:
            return empty_staging(self.single, num_blocks)
        layers, two, bs, heads, d = self._full_shape
        # The words `gather` sends: a full-head block's (blocks_view picks them by its bytes).
        words = blocks_view(torch.empty((layers, two, 1, bs, heads, d), dtype=self._first.dtype, device="meta"))
        return torch.empty((layers * two, num_blocks, words.shape[2]), dtype=words.dtype, device=self.device)

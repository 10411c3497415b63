"""Sharing a receiver's KV pool with senders on the same host through a CUDA IPC handle.

A sender that maps the decode pool writes a request's blocks straight into it
(`kernels.block_copy`): one pass over NVLink, no staging buffers, no per-message cost.
The handle travels only inside the authenticated handshake. A sender on another host,
in another container without a shared /dev/shm, or on a GPU without peer access fails
to open it and falls back to UCX messages, saying why in the log.

Built on torch's CUDA tensor sharing (the mechanism of torch.multiprocessing), whose
producer-side reference counting keeps the exported allocation alive while mapped.
"""

from __future__ import annotations

import functools
import socket
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@functools.cache
def host_id() -> str:
    """Identifies this machine's kernel: equal for every process and container on one host."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def export_pool(kv: torch.Tensor) -> dict[str, Any]:
    """A JSON-able description of a CUDA pool that `open_pool` maps in another process."""
    if not kv.is_cuda:
        raise ValueError("only a CUDA pool can be shared through CUDA IPC")
    _, args = reduce_tensor(kv)
    (_, size, stride, offset, _, dtype, _, handle, storage_bytes, storage_offset_bytes, _,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return {
        "host": host_id(),
        "shape": list(size),
        "stride": list(stride),
        "offset": offset,
        "dtype": str(dtype).removeprefix("torch."),
        "handle": handle.hex(),
        "storage_bytes": storage_bytes,
        "storage_offset_bytes": storage_offset_bytes,
        "ref_handle": ref_handle.hex(),
        "ref_offset": ref_offset,
        "event_handle": event_handle.hex() if event_handle else "",
        "event_sync": bool(event_sync),
    }


def open_pool(desc: dict[str, Any], device: torch.device) -> torch.Tensor:
    """Map a pool described by `export_pool` for kernels launched on `device` (this
    process's GPU; the memory stays on the exporter's GPU and is reached over NVLink).

    Raises:
        ValueError: the pool lives on another host.
        RuntimeError: CUDA or torch could not map it (no peer access, no shared /dev/shm).
    """
    if desc["host"] != host_id():
        raise ValueError("the pool lives on another host")
    dtype = getattr(torch, desc["dtype"])
    event = bytes.fromhex(desc["event_handle"]) or None
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(desc["shape"]), tuple(desc["stride"]), desc["offset"], torch.UntypedStorage,
        dtype, device.index if device.index is not None else torch.cuda.current_device(),
        bytes.fromhex(desc["handle"]), desc["storage_bytes"], desc["storage_offset_bytes"], False,
        bytes.fromhex(desc["ref_handle"]), desc["ref_offset"], event, desc["event_sync"],
    )

"""Which transport UCX actually uses for an endpoint's large messages.

ucxx does not expose it, so ask libucp directly (`ucp_ep_print_info`) and read the
protocol table for large tagged messages; fall back to the endpoint's bandwidth lanes.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re

# UCX transport (uct) name prefix -> our transport class.
_CLASS_OF_TL: tuple[tuple[str, str], ...] = (
    ("cuda_ipc", "cuda_ipc"),
    ("rc", "rdma"), ("dc", "rdma"), ("ud", "rdma"), ("gga", "rdma"), ("srd", "rdma"),
    ("posix", "shm"), ("sysv", "shm"), ("cma", "shm"), ("knem", "shm"), ("xpmem", "shm"),
    ("tcp", "tcp"),
)
_RANK = {"cuda_ipc": 0, "rdma": 1, "shm": 2, "tcp": 3}
# "# |   8K..inf | (?) rendezvous zero-copy read from remote | cma/memory  |"; the last
# cell may list several transports ("cuda_copy/cuda, tcp/lo" for a staged pipeline).
_LARGE_ROW = re.compile(r"^#\s*\|\s*\S+\.\.inf\s*\|[^|]*\|([^|]+)\|")
_TL = re.compile(r"([\w-]+)/")
# "#   lane[2]:  5:cma/memory.0 md[4]  -> md[4]/cma/sysdev[255] seg 4294967295 rma_bw#0"
_LANE = re.compile(r"lane\[\d+\]:\s+\d+:([\w-]+)/.*?\b(rma_bw|am_bw)#")


def classify_tl(tl: str) -> str | None:
    """Transport class of a UCX transport name ("rc_mlx5" -> "rdma"), None if not a data path."""
    for prefix, cls in _CLASS_OF_TL:
        if tl == prefix or tl.startswith(prefix + "_"):
            return cls
    return None


def transport_from_ep_info(info: str, memory: str) -> str:
    """Transport class for large messages from `ucp_ep_print_info` text.

    Args:
        info: what ucp_ep_print_info printed.
        memory: "host" or "cuda", the memory type of the KV pool.
    Returns:
        "cuda_ipc", "rdma", "shm", "tcp" or "unknown".
    """
    classes: set[str] = set()
    in_table = False
    for line in info.splitlines():
        if "tagged message by ucp_tag_send* from" in line:
            # "from host memory", "from cuda/GPU0 memory"
            in_table = re.search(rf"from {memory}\b", line) is not None
        elif in_table and (m := _LARGE_ROW.match(line)):
            classes |= {c for tl in _TL.findall(m.group(1)) if (c := classify_tl(tl))}
            in_table = False
    if not classes:
        classes = {c for m in _LANE.finditer(info) if (c := classify_tl(m.group(1)))}
    # Slowest class wins: a fast lane next to a tcp one does not make the path fast.
    known = classes & set(_RANK)
    return max(known, key=_RANK.__getitem__) if known else "unknown"


@functools.cache
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    import libucx  # the wheel that ships libucp next to ucxx

    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    lib_dir = os.path.join(os.path.dirname(libucx.__file__), "lib")
    ucp = ctypes.CDLL(sorted(glob.glob(os.path.join(lib_dir, "libucp.so*")))[0])
    ucp.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return libc, ucp


def ep_info(ucp_ep_handle: int) -> str:
    """`ucp_ep_print_info` of a live endpoint (ucxx `Endpoint.ucp_endpoint`) as text."""
    libc, ucp = _libs()
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    ucp.ucp_ep_print_info(ucp_ep_handle, stream)
    libc.fclose(stream)
    try:
        return ctypes.string_at(buf, size.value).decode(errors="replace")
    finally:
        libc.free(ctypes.cast(buf, ctypes.c_void_p))

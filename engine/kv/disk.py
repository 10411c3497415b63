"""The disk tier's files: one KV block per file, checked before it is served.

A file is `<dir>/<block hash as 16 hex digits>.kv`: a fixed header, then the block's bytes
([num_layers, 2, block_size, num_kv_heads, head_dim], the pool's dtype). The header holds a
magic, the layout fingerprint (a digest of the model's weights and config, the KV dtype, the
block size and head layout: a block another checkpoint or layout wrote is foreign), the
block's hash, the payload's length and a checksum of it. A file that fails any check is
rejected (and deleted): its block is recomputed, never served.

Files are written to a temporary name and renamed, so a crash leaves no half-written block
under a block's name; they are created 0600 in a 0700 folder (the server's user only).

`DiskFiles` is the index of one worker's folder (hash -> size, LRU order), bounded in bytes.
It is not thread-safe: `engine/kv/tiers.py` calls it under its lock, file I/O outside it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.kv.pool import KVLayout

_MAGIC = b"PDSKV001"
_HEADER = struct.Struct("<8s32sQQ16s")  # magic, fingerprint, block hash, payload bytes, checksum
_SUFFIX = ".kv"


def layout_fingerprint(layout: KVLayout, model_digest: str) -> bytes:
    """32 bytes naming everything a stored block's bytes depend on: the model's weights and
    config (`model_digest`), the KV dtype, block size and head layout."""
    text = (f"{model_digest}|{layout.dtype}|{layout.block_size}|{layout.num_layers}|{layout.num_kv_heads}|"
            f"{layout.head_dim}|{layout.tp_size}|{layout.kv_head_start}")
    return hashlib.sha256(text.encode()).digest()


def _checksum(payload: memoryview | bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class BlockCodec:
    """Turns one block's tensor into a file's bytes and back, checking them."""

    fingerprint: bytes
    shape: tuple[int, ...]  # [num_layers, 2, block_size, num_kv_heads, head_dim]
    dtype: torch.dtype

    @property
    def payload_bytes(self) -> int:
        return torch.empty(self.shape, dtype=self.dtype, device="meta").nbytes

    def encode(self, block_hash: int, block: torch.Tensor) -> tuple[bytes, memoryview]:
        """(header, payload) of a CPU block tensor."""
        payload = memoryview(block.contiguous().view(torch.uint8).numpy()).cast("B")
        header = _HEADER.pack(_MAGIC, self.fingerprint, block_hash, len(payload), _checksum(payload))
        return header, payload

    def decode(self, block_hash: int, data: bytes) -> torch.Tensor | str:
        """The block a file holds, or why it is rejected ("truncated", "foreign", "corrupt")."""
        if len(data) < _HEADER.size:
            return "truncated"
        magic, fingerprint, stored_hash, length, checksum = _HEADER.unpack_from(data)
        if magic != _MAGIC or fingerprint != self.fingerprint or stored_hash != block_hash \
                or length != self.payload_bytes:
            return "foreign"
        payload = memoryview(data)[_HEADER.size:]
        if len(payload) != length:
            return "truncated"
        if _checksum(payload) != checksum:
            return "corrupt"
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype).view(self.shape)


def block_path(folder: Path, block_hash: int) -> Path:
    return folder / f"{block_hash:016x}{_SUFFIX}"


def write_block(folder: Path, block_hash: int, header: bytes, payload: memoryview) -> None:
    """Write a block's file (temporary name, then rename); OSError (a full disk) leaves none."""
    path = block_path(folder, block_hash)
    tmp = path.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def read_block(folder: Path, block_hash: int) -> bytes | None:
    """A block file's bytes, None if it is gone."""
    try:
        return block_path(folder, block_hash).read_bytes()
    except FileNotFoundError:
        return None


def remove_block(folder: Path, block_hash: int) -> None:
    block_path(folder, block_hash).unlink(missing_ok=True)


def open_folder(folder: Path, persist: bool) -> None:
    """Make the slot's folder (0700), emptied unless its blocks are to `persist`."""
    if not persist:
        wipe_folder(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)


def wipe_folder(folder: Path) -> None:
    """Delete a disk tier's folder and every block in it (`pdserve kv-wipe`, `disk_persist` off)."""
    shutil.rmtree(folder, ignore_errors=True)


class DiskFiles:
    """One worker's block files: hash -> file size, least recently used first, bounded in bytes."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._sizes: OrderedDict[int, int] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def hashes(self) -> tuple[int, ...]:
        return tuple(self._sizes)

    def scan(self) -> list[int]:
        """Index the files a previous run left (oldest first, by modification time); their hashes.
        Leftover temporary files (a crash while writing) are deleted. Contents are checked when read."""
        found: list[tuple[int, int, int]] = []
        for entry in os.scandir(self.folder):
            name = entry.name
            if name.endswith(".tmp"):
                os.unlink(entry.path)
                continue
            try:
                block_hash = int(name.removesuffix(_SUFFIX), 16) if name.endswith(_SUFFIX) else None
            except ValueError:
                block_hash = None
            if block_hash is None:
                continue
            stat = entry.stat()
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        added = []
        for _, block_hash, size in sorted(found):
            self._sizes[block_hash] = size
            self.num_bytes += size
            added.append(block_hash)
        return added

    def touch(self, block_hash: int) -> None:
        self._sizes.move_to_end(block_hash)

    def add(self, block_hash: int, size: int) -> list[int]:
        """Index a written file; the least recently used ones that no longer fit (delete them)."""
        self.discard(block_hash)
        self._sizes[block_hash] = size
        self.num_bytes += size
        evicted = []
        while self.num_bytes > self.max_bytes:  # the new file too, if it alone is past the bound
            old, old_size = self._sizes.popitem(last=False)
            self.num_bytes -= old_size
            evicted.append(old)
        return evicted

    def discard(self, block_hash: int) -> bool:
        size = self._sizes.pop(block_hash, None)
        if size is None:
            return False
        self.num_bytes -= size
        return True

    def clear(self) -> None:
        self._sizes.clear()
        self.num_bytes = 0

"""Chained block hashes: the identity of a KV block's content.

A block's hash covers its parent's hash and its own token ids, so equal hashes
mean equal prefixes. The value is stable across processes and machines (no
Python `hash()` randomization), so the router can compute the same hashes as
the workers' prefix caches.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as SequenceT


def hash_block_tokens(parent_hash: int | None, token_ids: SequenceT[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash if parent_hash is not None else 0).to_bytes(8, "little", signed=False))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=False)


def prefix_block_hashes(token_ids: SequenceT[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids`."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes

"""Chained block hashes: the identity of a KV block's content.

A block's hash covers its parent's hash and its own token ids, so equal hashes
mean equal prefixes. The value is stable across processes and machines (no
Python `hash()` randomization), so the router can compute the same hashes as
the workers' prefix caches.

A request's `cache_salt` seeds its first block's hash (in place of the absent parent), so
salted prompts share blocks only with prompts of the same salt.
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


def salt_seed(cache_salt: str | None) -> int | None:
    """The first block's parent hash for a salted request (None: unsalted)."""
    if cache_salt is None:
        return None
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"pdserve-salt").digest(),
                          "little", signed=False)


def prefix_block_hashes(token_ids: SequenceT[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Hashes of every full block of `token_ids` (salted by `cache_salt`: see `salt_seed`)."""
    hashes: list[int] = []
    parent = salt_seed(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes

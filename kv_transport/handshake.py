"""Layout fingerprint and the secret proof both handshakes (UCX and loopback) use.

Each side sends a fresh nonce and its layout; each proves it knows the cluster
secret with HMAC(secret, role | client nonce | server nonce | fingerprint). The role
keeps a server's proof from being replayed as a client's; the nonces keep any proof
from being replayed in another session; the fingerprint binds the proof to the layout.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from pdserve.engine.kv_pool import KVLayout

PROTOCOL_VERSION = 1
NONCE_BYTES = 16


def layout_fields(layout: KVLayout) -> dict[str, str | int]:
    """The layout as plain fields, sent in the clear so a mismatch can be explained."""
    return {
        "model": layout.model,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "block_size": layout.block_size,
        "tp_size": layout.tp_size,
        "kv_head_start": layout.kv_head_start,
        "protocol_version": PROTOCOL_VERSION,
    }


def fingerprint(fields: dict[str, str | int]) -> str:
    """sha256 over the canonical JSON of `layout_fields`."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def describe_mismatch(ours: dict[str, str | int], theirs: dict[str, str | int]) -> str:
    """'head_dim: ours 64, peer 128; ...' or '' when the layouts agree."""
    keys = sorted(set(ours) | set(theirs))
    diffs = [f"{k}: ours {ours.get(k)!r}, peer {theirs.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)]
    return "; ".join(diffs)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def prove(secret: bytes, role: str, client_nonce: bytes, server_nonce: bytes, fp: str) -> str:
    """Hex HMAC-SHA256 a peer in `role` ("client" or "server") sends as its proof."""
    msg = b"|".join((role.encode(), client_nonce, server_nonce, fp.encode()))
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def check_proof(
    secret: bytes, role: str, client_nonce: bytes, server_nonce: bytes, fp: str, proof: str
) -> bool:
    return hmac.compare_digest(prove(secret, role, client_nonce, server_nonce, fp), proof)


def data_tag(session: bytes, request_id: str) -> int:
    """64-bit UCX tag for one request's data message, unique per connection."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, key=session[:64]).digest()
    return int.from_bytes(digest, "little")

"""Layout fingerprint and the secret proof both handshakes (UCX and loopback) use.

Each side sends a fresh nonce and its layout; each proves it knows the cluster
secret with HMAC(secret, role | client nonce | server nonce | fingerprint). The role
keeps a server's proof from being replayed as a client's; the nonces keep any proof
from being replayed in another session; the fingerprint binds the proof to the layout.
Over UCX two more proofs come first: the receiver's, published with its worker address
(PeerAddress.proof), and the sender's in its hello, over the worker address it names.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from pdserve.engine.kv.pool import KVLayout

PROTOCOL_VERSION = 2  # 2: connections from worker addresses (hello on HELLO_TAG), no listener
NONCE_BYTES = 16
CONNECTION_ID_BYTES = 8


def _tag(key: bytes, label: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(label, digest_size=8, key=key[:64]).digest(), "little")


# The one tag a receiver waits on at worker level, for any sender's first frame (hello).
HELLO_TAG = _tag(b"pdserve-kv", b"hello")


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


def prove_address(secret: bytes, worker_address: bytes) -> str:
    """A receiver's proof, published with its worker address, that it holds the secret:
    a sender with another secret learns so before it sends anything."""
    return hmac.new(secret, b"address|" + worker_address, hashlib.sha256).hexdigest()


def prove_hello(
    secret: bytes, client_nonce: bytes, connection_id: bytes, sn: int, worker_address: bytes, fp: str,
) -> str:
    """A sender's proof in its hello, checked before the receiver unpacks the worker address
    in it (UCX asserts, ending the process, on some malformed addresses) or makes endpoints
    up to its link's `sn` (ucx_link.Link). A replayed hello names a genuine address and a
    link already made, and cannot answer the challenge that follows."""
    msg = b"|".join((b"hello", client_nonce, connection_id, str(sn).encode(), worker_address, fp.encode()))
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def new_connection_id() -> bytes:
    """A sender's fresh id for one connection, named in its hello."""
    return os.urandom(CONNECTION_ID_BYTES)


def control_tags(connection_id: bytes) -> tuple[int, int]:
    """64-bit UCX tags of a connection's control frames: (to the receiver, to the sender).
    Tags match at worker level whichever endpoint a frame came by, so each connection and
    direction has its own: concurrent senders' frames never interleave."""
    return _tag(connection_id, b"to-receiver"), _tag(connection_id, b"to-sender")


def data_tag(session: bytes, request_id: str) -> int:
    """64-bit UCX tag for one request's data message, unique per connection."""
    return _tag(session, request_id.encode())

"""Moving KV blocks between workers: UCX transport and an in-process loopback.

    receiver = await UcxKVReceiver.start(pool.kv, layout, config)   # decode side
    landed = receiver.expect(request_id, decode_block_ids)          # registers at once
    result = await release_on_failure(landed, lambda: free(decode_block_ids))

    sender = UcxKVSender(pool.kv, layout, config)                   # prefill side
    result = await sender.send(request_id, prefill_block_ids, receiver.address)

Modules (only the ucx_* ones and transport_info import ucxx):
    api            protocols, TransferResult, typed errors, release_on_failure
    config         TransportConfig
    handshake      layout fingerprint, HMAC secret proofs, per-request data tags
    staging        gather/scatter of scattered blocks to one contiguous buffer
    receive_table  receiver bookkeeping shared by every transport (either arrival order)
    loopback       in-process fake with the same semantics, for tests above
    ucx_link       ucxx setup, control frames, the handshake over UCX
    ucx_sender     UcxKVSender (one connection per receiver)
    ucx_receiver   UcxKVReceiver (listener, authenticated connections)
    transport_info which transport UCX picked (ucp_ep_print_info)
    wire           errors in control frames

Wire protocol per connection: control endpoint (listener-made, UCX error handling on)
carries JSON frames: hello/challenge/auth/accept (handshake), then per request
xfer (sender) -> done (receiver, with the error if any), and cancel (sender gave up). KV bytes travel as one tagged
message per request on the data endpoint, tagged by (session, request id).
"""

from __future__ import annotations

from kv_transport.api import (
    HandshakeRefused,
    KVReceiver,
    KVSender,
    PeerAddress,
    PeerLost,
    SlowPathRefused,
    TransferCancelled,
    TransferError,
    TransferRejected,
    TransferResult,
    TransferTimeout,
    release_on_failure,
)
from kv_transport.config import TRANSPORT_CLASSES, TransportConfig
from kv_transport.loopback import LoopbackNetwork, LoopbackReceiver, LoopbackSender

__all__ = [
    "TRANSPORT_CLASSES",
    "HandshakeRefused",
    "KVReceiver",
    "KVSender",
    "LoopbackNetwork",
    "LoopbackReceiver",
    "LoopbackSender",
    "PeerAddress",
    "PeerLost",
    "SlowPathRefused",
    "TransferCancelled",
    "TransferError",
    "TransferRejected",
    "TransferResult",
    "TransferTimeout",
    "TransportConfig",
    "release_on_failure",
]

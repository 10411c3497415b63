"""Moving KV blocks between workers: UCX transport and an in-process loopback.

    receiver = await UcxKVReceiver.start(pool.kv, layout, config)   # decode side
    landed = receiver.expect(request_id, decode_block_ids)          # registers at once
    result = await release_on_failure(landed, lambda: free(decode_block_ids))

    sender = UcxKVSender(pool.kv, layout, config)                   # prefill side
    result = await sender.send(request_id, prefill_block_ids, receiver.address)

Modules (only the ucx_* ones and transport_info import ucxx):
    api            protocols, TransferResult, typed errors, release_on_failure
    config         TransportConfig
    node           a worker's settings on its Ray node (its registered address)
    handshake      layout fingerprint, HMAC secret proofs, per-request data tags
    staging        block id checks; gather/scatter of scattered blocks to one contiguous buffer
    pool_writer    direct writes: scattered blocks into a peer's mapped pool (one graph replay)
    cuda_ipc       the receiver's pool shared with same-host senders (CUDA IPC handle)
    receive_table  receiver bookkeeping shared by every transport (either arrival order)
    keepalive      a sender's "still computing" beat for the requests it prepared
    loopback       in-process fake with the same semantics, for tests above
    ucx_link       ucxx setup (thread progress, one event loop), ucx_io, links, control frames, the handshake over UCX
    ucx_sender     UcxKVSender (one connection per receiver: made, kept, closed)
    ucx_connection one sender's connection: grants, direct writes or data messages, keep-alives, its reader
    ucx_receiver   UcxKVReceiver (hellos at worker level, authenticated connections; no listener)
    ucx_inbound    one sender's connection at the receiver: its frames read, its data received (a
                   payload cut short refused: staging.mark_end), a protocol break refused with the reason
    transport_info which transport UCX picked (ucp_ep_print_info)
    wire           errors in control frames
    faults         TransferFault: a test seam that makes one sender cut its next transfers

Connecting: nothing listens. A receiver's PeerAddress (passed to senders through Ray)
carries its UCX worker address and a proof of the cluster secret over it (a sender with
another secret refuses at once: HandshakeRefused); a sender makes an endpoint from it (UCX
error handling on) and sends its hello on the well-known HELLO_TAG, naming its own worker
address and a fresh connection id, with a proof over them; the receiver, waiting on that
tag at worker level, drops a hello without a valid proof (UCX asserts on some malformed
addresses), else makes its endpoint back from it. One endpoint on each side, UCX error
handling on, is the link between the two workers; UCX pairs the endpoints two workers make
to each other by their order (ucx_link.Link). UCX then picks cuda_ipc or RDMA for the bulk
data where there are, else TCP (never host shared memory: see Link), and a peer that dies
mid-transfer fails the transfer, never this process nor its later links. The hello names the
sender's link, so the receiver tells a new link from another connection over the one it holds.
Either side may close a link whenever a connection over it fails, and says so ("closed": an
endpoint made from a worker address closes silently); the next connection opens another.
A dead peer's endpoint errors (at once when its sockets close, within UCX's 1 s keepalive
when its host is gone), which fails every receive posted on it (control frames, data); the
timeouts bound the rest.

Wire protocol per connection: JSON control frames, one tagged message each, on tags
derived from the connection id (one per direction), so that concurrent senders never
interleave: hello/challenge/auth/accept (handshake, HMAC proofs of the cluster secret; the
challenge names the receiver's incarnation, and a sender that addressed another one
refuses: PeerReplaced; accept carries the pool's CUDA IPC handle when the pool is on a
GPU), a probe message that shows which transport UCX picked, then one of two data paths
per connection:
- direct writes (GPUs of one host that can map the handle): xfer(mode=write, the
  sender's interprocess CUDA events) -> grant (the receiver's block ids) -> the sender
  copies block to block into the mapped pool (pool_writer: one CUDA-graph replay of
  kernels.block_copy on a stream of its own, one NVLink pass), records the next of its
  events and sends written (naming it) while the copy runs; the receiver returns that
  event as TransferResult.ready, and its engine uses the KV once its host sees the event
  complete (a GPU stream's wait on another process's event lags ~85 us). Or done(error)
  instead of a grant. `prepare()` sends the xfer before the KV exists, so the grant
  travels during the prefill.
- UCX messages (other hosts, CPU pools): xfer -> one tagged message per request
  (gathered blocks) -> done (receiver, with the error if any). On GPUs both ends pack and
  unpack on CUDA streams of their own and wait for them off the event loop; the receiver's
  result carries `ready` as on the direct path.
A sender that breaks the protocol (a malformed frame, a bad block count) gets refuse(reason)
and the connection ends. Either way the sender may cancel (it gave up); a granted writer that cancels has no copy
in flight, so the receiver may free the blocks. From `prepare()` until `send()` ends or
`forget()`, the sender names the request in an alive frame (ids, every quarter of the
transfer timeout): the receiver's wait for it starts over, so that the bound measures the
sender's silence, not the length of the prefill that computes the KV.
"""

from __future__ import annotations

from pdserve.kv_transport.api import (
    HandshakeRefused,
    KVReceiver,
    KVSender,
    PeerAddress,
    PeerLost,
    PeerReplaced,
    SlowPathRefused,
    TransferCancelled,
    TransferError,
    TransferRejected,
    TransferResult,
    TransferTimeout,
    release_on_failure,
)
from pdserve.kv_transport.config import TRANSPORT_CLASSES, TransportConfig
from pdserve.kv_transport.loopback import LoopbackNetwork, LoopbackReceiver, LoopbackSender

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
    "PeerReplaced",
    "SlowPathRefused",
    "TransferCancelled",
    "TransferError",
    "TransferRejected",
    "TransferResult",
    "TransferTimeout",
    "TransportConfig",
    "release_on_failure",
]

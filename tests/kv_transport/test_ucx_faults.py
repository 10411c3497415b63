"""Broken senders against a real UCX receiver in another process (CPU: shm or TCP): a payload
shorter than its header (UCX completes a short message as a success) is refused, never landed;
a sender that announces data and never posts it is bounded by the receiver's own timeout, however
long it keeps naming the request in its keep-alives; malformed or truncated transfer metadata
from an authenticated peer is refused with the reason, and the receiver serves on. Each ends
with nothing held or pending and the next transfer landing byte-exact."""

from __future__ import annotations

import json

import pytest

from tests.kv_transport.peers import PeerSpec
from tests.kv_transport.test_ucx_processes import SLACK_S, TIMEOUT_S, Peer, peers

pytestmark = pytest.mark.timeout(120)


def _lands(receiver: Peer, sender: Peer, name: str, recv_ids: list[int], send_ids: list[int]) -> None:
    receiver.command("expect", requests=[(name, recv_ids)])
    sender.command("send", requests=[(name, send_ids)], peer=receiver.address)
    sent = sender.wait_results([name], TIMEOUT_S + SLACK_S)[name]
    landed = receiver.wait_results([name], TIMEOUT_S + SLACK_S)[name]
    assert sent["ok"] and landed["ok"] and landed["digest"] == sent["digest"], (sent, landed)


def _clean(receiver: Peer, sender: Peer) -> None:
    stats = receiver.stats()
    assert stats["pending"] == 0 and stats["held"] == 0, stats
    assert sender.stats()["held"] == 0


@pytest.fixture(scope="module")
def pair():
    spec = PeerSpec(num_blocks=64, timeout_s=TIMEOUT_S)
    with peers(("receiver", spec), ("sender", spec.with_(seed=5))) as (receiver, sender):
        yield receiver, sender


def test_a_payload_cut_short_is_refused_not_landed(pair):
    """The sender announces 4 blocks and sends 1 block's worth of bytes: both sides fail the
    request with TransferRejected naming the cut (without the check the receiver would land
    stale memory as KV: vllm#52234), and the connection serves the next request."""
    receiver, sender = pair
    _lands(receiver, sender, "warm", [1], [2])
    sender.command("fault", fault={"action": "truncate", "after_blocks": 1})
    receiver.command("expect", requests=[("cut", [10, 11, 12, 13])])
    sender.command("send", requests=[("cut", [3, 4, 5, 6])], peer=receiver.address)
    sent = sender.wait_results(["cut"], TIMEOUT_S + SLACK_S)["cut"]
    landed = receiver.wait_results(["cut"], TIMEOUT_S + SLACK_S)["cut"]
    assert landed["error"] == "TransferRejected" and "ended short of the 4 blocks" in landed["message"], landed
    assert sent["error"] == "TransferRejected" and "ended short" in sent["message"], sent
    _clean(receiver, sender)
    assert receiver.stats()["connections"] == 1
    _lands(receiver, sender, "after-cut", [20, 21, 22, 23], [3, 4, 5, 6])


def test_a_sender_that_never_posts_its_data_is_bounded_by_the_receivers_timeout():
    """The prefill side announces its KV, never posts it and keeps naming the request in its
    keep-alives, with a transfer timeout three times the receiver's (its beats come faster than
    the receiver's bound): the receiver fails the request on its own bound (TransferTimeout), not
    kept waiting by the beats until the sender gives up (vllm#50754), and drops the link whose
    receive the sender left posted. The sender's next connection lands."""
    receiver_spec = PeerSpec(num_blocks=64, timeout_s=2.0)
    with peers(("receiver", receiver_spec), ("sender", receiver_spec.with_(timeout_s=6.0, seed=3))) as (
            receiver, sender):
        _lands(receiver, sender, "warm", [1], [2])
        receiver.command("expect", requests=[("stalled", [10, 11])])
        sender.command("prepare", prepare=["stalled"], peer=receiver.address)  # keep-alives for it
        sender.command("fault", fault={"action": "stall"})
        sender.command("send", requests=[("stalled", [3, 4])], peer=receiver.address)
        landed = receiver.wait_results(["stalled"], 6.0 + SLACK_S)["stalled"]
        assert landed["error"] == "TransferTimeout" and "within 2" in landed["message"], landed
        sent = sender.wait_results(["stalled"], 6.0 + SLACK_S)["stalled"]
        assert sent["error"] in ("PeerLost", "TransferTimeout"), sent
        _clean(receiver, sender)
        _lands(receiver, sender, "after-stall", [20, 21], [5, 6])


def test_a_link_closed_mid_transfer_fails_within_the_timeout_and_the_sender_reconnects(pair):
    """The sender's endpoints close right after the header, silently (an endpoint made from a
    worker address says nothing): the receiver's expect fails within its bound and its blocks are
    the caller's again; the sender's next send opens another link and lands."""
    receiver, sender = pair
    _lands(receiver, sender, "warm-close", [2], [2])
    sender.command("fault", fault={"action": "close"})
    receiver.command("expect", requests=[("closed", [30, 31, 32])])
    sender.command("send", requests=[("closed", [7, 8, 9])], peer=receiver.address)
    sent = sender.wait_results(["closed"], TIMEOUT_S + SLACK_S)["closed"]
    assert sent["error"] == "PeerLost" and "injected fault" in sent["message"], sent
    landed = receiver.wait_results(["closed"], TIMEOUT_S + SLACK_S)["closed"]
    assert landed["error"] in ("TransferTimeout", "PeerLost"), landed
    _clean(receiver, sender)
    _lands(receiver, sender, "after-close", [33, 34, 35], [7, 8, 9])


def _frame(payload: bytes, claimed: int | None = None) -> bytes:
    return (len(payload) if claimed is None else claimed).to_bytes(4, "little") + payload


MALFORMED = [
    ({"t": "xfer", "id": "named", "n": -3}, "names -3 blocks"),
    ({"t": "xfer", "id": "named-2", "n": 1 << 40}, f"names {1 << 40} blocks, the pool has"),
    ({"t": "xfer", "id": "x", "n": "lots"}, "is not an integer"),
    ({"t": "xfer", "id": 7, "n": 1}, "is not a string"),
    ({"t": "xfer"}, "KeyError"),
    ({"t": "cancel"}, "KeyError"),
    (_frame(json.dumps({"t": "xfer", "id": "y", "n": 2}).encode(), claimed=200), "malformed control frame"),
    (_frame(b'{"t": "xfer", "id": "z", "n": 2'), "malformed control frame"),
    (_frame(b"\xff\xfe not json"), "malformed control frame"),
]


def test_malformed_transfer_metadata_is_refused_and_the_receiver_serves_on(pair):
    """An authenticated sender sends transfer headers with bad, missing or mistyped fields, and
    frames cut short or not JSON (sglang's decode crashed on incomplete transfer parameters):
    each connection is refused with the reason, told to the sender; a request the header named is
    failed at once with that reason (its caller frees the blocks), not left to time out; then a
    good transfer lands byte-exact."""
    receiver, sender = pair
    receiver.command("expect", requests=[("named", [40, 41]), ("named-2", [42])])
    sender.command("malformed", peer=receiver.address, frames=[frame for frame, _ in MALFORMED])
    errors = sender._next("malformed", len(MALFORMED) * (TIMEOUT_S + SLACK_S))["errors"]
    for (frame, words), error in zip(MALFORMED, errors):
        assert error.startswith("TransferRejected") and words in error, (frame, error)
    named = receiver.wait_results(["named", "named-2"], SLACK_S)
    assert named["named"]["error"] == "TransferRejected" and "-3 blocks" in named["named"]["message"], named
    assert named["named-2"]["error"] == "TransferRejected", named
    _clean(receiver, sender)
    _lands(receiver, sender, "after-malformed", [50, 51, 52], [1, 2, 3])
    assert receiver.stats()["connections"] == 1

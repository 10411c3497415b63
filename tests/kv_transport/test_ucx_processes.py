"""The UCX transport between real processes, on the CPU: TCP or shared memory."""

from __future__ import annotations

import contextlib
import glob
import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.kv_transport.peers import PeerSpec, run_peer

TIMEOUT_S = 5.0
SLACK_S = 3.0  # process scheduling on a loaded 2-core CI machine
EXIT_S = 30  # a told peer's exit, UCX's teardown included

pytestmark = pytest.mark.timeout(120)

# Children fork from one server process that imported torch, ucxx and the peer code once: a
# spawned child spent seconds of CI's loaded CPU importing them, some thirty children a run.
# UCX itself starts in each child, after its fork (importing ucxx makes no context).
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["tests.kv_transport.peers"])


class Peer:
    """Parent-side handle on a child from peers.py."""

    def __init__(self, role: str, spec: PeerSpec) -> None:
        self.conn, child_conn = CONTEXT.Pipe()
        self.process = CONTEXT.Process(target=run_peer, args=(role, child_conn, spec), daemon=True)
        self.process.start()
        child_conn.close()
        self.results: dict[str, dict[str, Any]] = {}
        self.address = self._next("ready", 60)["address"]

    def command(self, op: str, **args: Any) -> None:
        self.conn.send({"op": op, **args})

    def stats(self) -> dict[str, Any]:
        self.command("stats")
        return self._next("stats", 30)

    def wait_results(self, request_ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while not set(request_ids) <= self.results.keys():
            self._next("result", deadline - time.monotonic())
        return {r: self.results[r] for r in request_ids}

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it may have exited just now
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        """Tell a live child to exit, which it must do by itself: its transport closed, no
        thread of UCX's left behind (one would hold its interpreter's shutdown forever)."""
        hung = False
        if self.process.is_alive():
            self.command("exit")
            # A UCX teardown took over 10 s on the 2-core machine under a full load.
            self.process.join(EXIT_S)
            hung = self.process.is_alive()
        if hung:
            self.kill()
        for path in glob.glob(f"/dev/shm/pdserve-test-{self.process.pid}-*"):  # direct-write pools
            os.unlink(path)
        assert not hung, f"the {self.process.name} did not exit within {EXIT_S} s of being told to"

    def _next(self, op: str, timeout_s: float) -> dict[str, Any]:
        """Next message of kind `op`; results arriving meanwhile are filed."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"no {op!r} from the {self.process.name} within {timeout_s:.1f}s")
            msg = self.conn.recv()
            if msg["op"] == "result":
                self.results[msg["id"]] = msg
            if msg["op"] == op:
                return msg


@contextmanager
def peers(*specs: tuple[str, PeerSpec]) -> Iterator[list[Peer]]:
    started: list[Peer] = []
    try:
        for role, spec in specs:
            started.append(Peer(role, spec))
        yield started
    finally:
        for peer in started:
            peer.close()


def scattered(rng: random.Random, num_blocks: int, sizes: list[int]) -> list[list[int]]:
    """Disjoint random block ids for requests of `sizes` blocks."""
    ids = rng.sample(range(num_blocks), sum(sizes))
    out, start = [], 0
    for n in sizes:
        out.append(ids[start:start + n])
        start += n
    return out


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Peer, Peer]]:
    spec = PeerSpec(num_blocks=256, timeout_s=TIMEOUT_S)
    with peers(("receiver", spec), ("sender", spec.with_(seed=7))) as (receiver, sender):
        yield receiver, sender


@pytest.fixture(scope="module")
def direct_pair() -> Iterator[tuple[Peer, Peer]]:
    """Senders write straight into the receiver's (file-mapped) pool: grant / written frames."""
    spec = PeerSpec(num_blocks=256, timeout_s=TIMEOUT_S, direct=True)
    with peers(("receiver", spec), ("sender", spec.with_(seed=7))) as (receiver, sender):
        yield receiver, sender


BOTH_PATHS = pytest.mark.parametrize("path", ["pair", "direct_pair"], ids=["messages", "direct-writes"])
TRANSPORTS = {"pair": ("tcp",), "direct_pair": ("cuda_ipc",)}  # one host, CPU pools: see ucx_link.Link


@BOTH_PATHS
@pytest.mark.parametrize("early", [False, True], ids=["expect-first", "data-first"])
def test_concurrent_requests_land_byte_exact(request: pytest.FixtureRequest, path: str, early: bool) -> None:
    receiver, sender = request.getfixturevalue(path)
    rng = random.Random(int(early))
    sizes = [rng.randint(1, 12) for _ in range(8)]
    recv_ids = scattered(rng, 256, sizes)
    send_ids = [rng.sample(range(256), n) for n in sizes]  # senders may share blocks (prefix cache)
    names = [f"{'early' if early else 'late'}-{i}" for i in range(len(sizes))]
    expects = [(name, ids) for name, ids in zip(names, recv_ids)]
    sends = [(name, ids) for name, ids in zip(names, send_ids)]
    if early:
        sender.command("send", requests=sends, peer=receiver.address)
        time.sleep(0.5)
        receiver.command("expect", requests=expects)
    else:
        receiver.command("expect", requests=expects)
        sender.command("send", requests=sends, peer=receiver.address)
    sent = sender.wait_results(names, TIMEOUT_S + SLACK_S)
    landed = receiver.wait_results(names, TIMEOUT_S + SLACK_S)
    for name in names:
        assert sent[name]["ok"] and landed[name]["ok"], (sent[name], landed[name])
        assert landed[name]["digest"] == sent[name]["digest"]
        assert sent[name]["transport"] == landed[name]["transport"] and sent[name]["transport"] in TRANSPORTS[path]
        assert sent[name]["direct"] == landed[name]["direct"] == (path == "direct_pair")
    assert receiver.stats()["stray_blocks"] == 0


@pytest.mark.parametrize("direct", [False, True], ids=["messages", "direct-writes"])
def test_fp8_pools_land_byte_exact(direct: bool) -> None:
    """An FP8 cache moves as the bytes it is (half a 16-bit pool's), either path."""
    spec = PeerSpec(num_blocks=64, timeout_s=TIMEOUT_S, direct=direct, dtype=torch.float8_e4m3fn)
    with peers(("receiver", spec), ("sender", spec.with_(seed=3))) as (receiver, sender):
        requests = [("fp8-0", [3, 40, 17]), ("fp8-1", [60])]
        receiver.command("expect", requests=requests)
        sender.command("send", requests=[(name, [b + 1 for b in ids]) for name, ids in requests],
                       peer=receiver.address)
        sent = sender.wait_results(["fp8-0", "fp8-1"], TIMEOUT_S + SLACK_S)
        landed = receiver.wait_results(["fp8-0", "fp8-1"], TIMEOUT_S + SLACK_S)
        for name, ids in requests:
            assert sent[name]["ok"] and landed[name]["ok"], (sent[name], landed[name])
            assert landed[name]["digest"] == sent[name]["digest"]
            assert sent[name]["num_bytes"] == len(ids) * spec.layout().bytes_per_block
            assert sent[name]["direct"] == direct
        assert receiver.stats()["stray_blocks"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("direct_writes", [False, True], ids=["messages", "direct-writes"])
def test_gpu_pools_land_byte_exact(direct_writes: bool) -> None:
    """GPU pools in two processes (two GPUs where there are): direct writes through the real
    CUDA IPC mapping, or UCX messages packed and unpacked on the transport's own streams;
    the receiver uses its blocks once the result's `ready` event has completed."""
    devices = ("cuda:1", "cuda:0") if torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")
    spec = PeerSpec(num_blocks=256, timeout_s=TIMEOUT_S, extra={"direct_writes": direct_writes})
    with peers(("receiver", spec.with_(device=devices[0])), ("sender", spec.with_(seed=9, device=devices[1]))) as (
            receiver, sender):
        rng = random.Random(11)
        sizes = [rng.randint(1, 40) for _ in range(8)]
        names = [f"gpu-{i}" for i in range(len(sizes))]
        recv_ids = scattered(rng, 256, sizes)
        receiver.command("expect", requests=list(zip(names, recv_ids)))
        sender.command("send", requests=[(n, rng.sample(range(256), k)) for n, k in zip(names, sizes)],
                       peer=receiver.address)
        sent = sender.wait_results(names, 60)
        landed = receiver.wait_results(names, 60)
        for name in names:
            assert sent[name]["ok"] and landed[name]["ok"], (sent[name], landed[name])
            assert landed[name]["digest"] == sent[name]["digest"]
            assert sent[name]["direct"] == landed[name]["direct"] == direct_writes
        assert receiver.stats()["stray_blocks"] == 0


@BOTH_PATHS
def test_no_leaks_after_100_transfers(request: pytest.FixtureRequest, path: str) -> None:
    receiver, sender = request.getfixturevalue(path)
    rng = random.Random(3)
    # Connected first, whatever ran before on the module's pair: the one connection is kept.
    receiver.command("expect", requests=[("leak-warm", [255])])
    sender.command("send", requests=[("leak-warm", [0])], peer=receiver.address)
    assert receiver.wait_results(["leak-warm"], TIMEOUT_S + SLACK_S)["leak-warm"]["ok"]
    assert sender.wait_results(["leak-warm"], TIMEOUT_S + SLACK_S)["leak-warm"]["ok"]
    before = sender.stats(), receiver.stats()
    for batch in range(10):  # 10 batches of 10 requests in flight at once
        names = [f"leak-{batch}-{i}" for i in range(10)]
        recv_ids = scattered(rng, 256, [rng.randint(1, 8) for _ in names])
        receiver.command("expect", requests=list(zip(names, recv_ids)))
        sender.command("send", requests=[(n, rng.sample(range(256), len(ids))) for n, ids in zip(names, recv_ids)],
                       peer=receiver.address)
        assert all(r["ok"] for r in sender.wait_results(names, TIMEOUT_S + SLACK_S).values())
        assert all(r["ok"] for r in receiver.wait_results(names, TIMEOUT_S + SLACK_S).values())
    after = sender.stats(), receiver.stats()
    for was, now in zip(before, after):
        for key in ("threads", "endpoints", "connections", "tasks"):
            assert now[key] == was[key], (key, was, now)
        assert now["pending"] == 0 and now["held"] == 0
    assert after[0]["connections"] == 1 and after[1]["connections"] == 1


@pytest.mark.parametrize(
    ("change", "words"),
    [({"head_dim": 16}, "head_dim: ours 16, peer 8"), ({"secret": b"not-the-cluster-secret"}, "cluster secret")],
    ids=["layout", "secret"],
)
def test_mismatch_is_refused(pair: tuple[Peer, Peer], change: dict[str, Any], words: str) -> None:
    receiver, _ = pair
    connections = receiver.stats()["connections"]
    with peers(("sender", PeerSpec(num_blocks=256, timeout_s=TIMEOUT_S).with_(**change))) as (stranger,):
        stranger.command("send", requests=[("stranger", [0, 1])], peer=receiver.address)
        result = stranger.wait_results(["stranger"], TIMEOUT_S + SLACK_S)["stranger"]
        assert result["error"] == "HandshakeRefused" and words in result["message"], result
        assert stranger.stats()["held"] == 0
    assert receiver.stats()["connections"] == connections


@pytest.mark.parametrize("direct", [False, True], ids=["messages", "direct-writes"])
def test_receiver_killed_mid_transfer(direct: bool) -> None:
    # 256 KiB blocks, so that a 100 MiB request is still on the wire when the receiver dies.
    spec = PeerSpec(num_blocks=512, head_dim=4096, timeout_s=TIMEOUT_S, direct=direct)
    with peers(("receiver", spec), ("sender", spec)) as (receiver, sender):
        receiver.command("expect", requests=[("warm", [1]), ("big", list(range(100, 500)))])
        sender.command("send", requests=[("warm", [2])], peer=receiver.address)
        assert sender.wait_results(["warm"], TIMEOUT_S + SLACK_S)["warm"]["ok"]
        # Sent but never expected: the data sits at the receiver, the sender awaits its ack.
        names = [f"doomed-{i}" for i in range(4)]
        sender.command("send", requests=[(n, [10 + i, 20 + i]) for i, n in enumerate(names)], peer=receiver.address)
        sender.command("send", requests=[("big", list(range(100, 500)))], peer=receiver.address)
        time.sleep(0.15)
        receiver.kill()
        results = sender.wait_results([*names, "big"], TIMEOUT_S + SLACK_S)
        for result in results.values():
            if result["id"] == "big" and result["ok"]:
                continue  # it may have landed before the kill
            assert result["error"] in ("PeerLost", "TransferTimeout"), result
            assert result["elapsed_s"] <= TIMEOUT_S + SLACK_S
        sender.command("send", requests=[("after", [3])], peer=receiver.address)
        after = sender.wait_results(["after"], TIMEOUT_S + SLACK_S)["after"]
        assert after["error"] in ("PeerLost", "TransferTimeout"), after
        stats = sender.stats()
        assert stats["held"] == 0 and stats["connections"] == 0 and stats["endpoints"] == 0


@pytest.mark.parametrize("direct", [False, True], ids=["messages", "direct-writes"])
def test_sender_killed_mid_transfer(direct: bool) -> None:
    """A sender that dies while its KV crosses fails that transfer and no more: the receiver
    lives and serves the next sender. By messages it dies just as UCX has the 100 MiB message
    (ucx_link.Link: over shared memory this once aborted the receiver, whose cma read from the
    dead process was fatal without error handling, and with error handling left its FIFO
    stalled)."""
    # 256 KiB blocks: a 100 MiB request. UCX's progress threads wake every 1 ms, not 100: the
    # message is on its way a few milliseconds after it is posted.
    spec = PeerSpec(num_blocks=512, head_dim=4096, timeout_s=TIMEOUT_S, direct=direct,
                    extra={"progress_wake_ms": 1})
    with peers(("receiver", spec), ("sender", spec)) as (receiver, sender):
        receiver.command("expect", requests=[("warm", [1]), ("big", list(range(100, 500))), ("never", [50, 51])])
        sender.command("send", requests=[("warm", [2])], peer=receiver.address)
        assert receiver.wait_results(["warm"], TIMEOUT_S + SLACK_S)["warm"]["ok"]
        if not direct:
            sender.command("announce")
        sender.command("send", requests=[("big", list(range(400)))], peer=receiver.address)
        if not direct:
            sender._next("posting", TIMEOUT_S + SLACK_S)
            time.sleep(0.005)
        sender.kill()
        results = receiver.wait_results(["big", "never"], TIMEOUT_S + SLACK_S)
        # "big" may have landed before the kill; "never" cannot have.
        assert results["never"]["error"] in ("PeerLost", "TransferTimeout"), results
        assert results["big"]["ok"] or results["big"]["error"] in ("PeerLost", "TransferTimeout"), results
        stats = receiver.stats()
        assert stats["held"] == 0 and stats["pending"] == 0 and stats["connections"] == 0
        # ...and serves the next sender.
        with peers(("sender", spec.with_(seed=5))) as (after,):
            receiver.command("expect", requests=[("after", [7, 8])])
            after.command("send", requests=[("after", [9, 10])], peer=receiver.address)
            sent = after.wait_results(["after"], TIMEOUT_S + SLACK_S)["after"]
            landed = receiver.wait_results(["after"], TIMEOUT_S + SLACK_S)["after"]
            assert sent["ok"] and landed["ok"] and landed["digest"] == sent["digest"], (sent, landed)


def test_malformed_traffic_leaves_the_receiver_serving(pair: tuple[Peer, Peer]) -> None:
    """Nothing listens, but anyone who has the receiver's worker address can send to its
    hello tag: garbage there is dropped, and the next sender connects as ever."""
    receiver, _ = pair
    connections = receiver.stats()["connections"]
    spec = PeerSpec(num_blocks=256, timeout_s=TIMEOUT_S)
    with peers(("stranger", spec), ("sender", spec.with_(seed=5))) as (stranger, sender):
        stranger.command("garbage", peer=receiver.address)
        stranger._next("garbage", TIMEOUT_S + SLACK_S)
        receiver.command("expect", requests=[("after-garbage", [80, 81])])
        sender.command("send", requests=[("after-garbage", [7, 8])], peer=receiver.address)
        sent = sender.wait_results(["after-garbage"], TIMEOUT_S + SLACK_S)["after-garbage"]
        landed = receiver.wait_results(["after-garbage"], TIMEOUT_S + SLACK_S)["after-garbage"]
        assert sent["ok"] and landed["ok"] and landed["digest"] == sent["digest"], (sent, landed)
    deadline = time.monotonic() + SLACK_S  # the sender's link closes as its process exits
    while receiver.stats()["connections"] != connections and time.monotonic() < deadline:
        time.sleep(0.1)
    assert receiver.stats()["connections"] == connections


def test_a_live_receiver_that_missed_its_handshakes_is_reached_again() -> None:
    """UCX pairs the endpoints two workers make to each other by their order, so a link
    given up while both live must be remade in step on both sides. The receiver ends the
    connection, then stalls the next handshake past the timeout, once before making its
    endpoints back (that link's endpoints exist on the sender only) and once after (both
    sides made them, then both drop them); each time the sender's next connection reaches
    it, and the KV lands. Its bound is four times the others': the reconnection after a
    stalled handshake is a fresh connection, which on 2 cores shared with another test
    worker can take far longer than TIMEOUT_S (seen: over 5 s, and once over 10 s)."""
    timeout_s = 4 * TIMEOUT_S
    spec = PeerSpec(num_blocks=64, timeout_s=timeout_s)
    with peers(("receiver", spec), ("sender", spec.with_(seed=3))) as (receiver, sender):
        rounds = [("first", None), ("after-a-missed-hello", "hello"), ("after-a-dropped-link", "link"),
                  ("again", None)]
        for i, (name, stall) in enumerate(rounds):
            if stall is not None:
                receiver.command("drop")  # the receiver ends the connection; the sender notices
                deadline = time.monotonic() + SLACK_S
                while sender.stats()["connections"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                receiver.command("stall", where=stall, count=1)
                sender.command("send", requests=[(f"lost-{i}", [1, 2])], peer=receiver.address)
                lost = sender.wait_results([f"lost-{i}"], 2 * timeout_s + SLACK_S)[f"lost-{i}"]
                assert not lost["ok"] and lost["error"] in ("TransferTimeout", "PeerLost"), lost
                # The stalled handshake lets go (2 * timeout_s after it began) before the next
                # round: a connection made while it still hangs raced its end against the
                # connect timeout, and lost on the loaded CI machine (over 20 s).
                deadline = time.monotonic() + 2 * timeout_s + SLACK_S
                while receiver.stats()["stalling"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert receiver.stats()["stalling"] == 0
            blocks = [4 * i + 8, 4 * i + 9]
            receiver.command("expect", requests=[(name, blocks)])
            sender.command("send", requests=[(name, [3 * i, 3 * i + 1])], peer=receiver.address)
            sent = sender.wait_results([name], 3 * timeout_s + SLACK_S)[name]
            landed = receiver.wait_results([name], 3 * timeout_s + SLACK_S)[name]
            assert sent["ok"] and landed["ok"], (name, sent["message"], landed["message"])
            assert landed["digest"] == sent["digest"]
        deadline = time.monotonic() + SLACK_S  # the stalled handshakes' links are closed by now
        while receiver.stats()["connections"] != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert receiver.stats()["connections"] == 1 and sender.stats()["connections"] == 1
        assert receiver.stats()["pending"] == 0 and sender.stats()["held"] == 0


def test_slow_path_is_refused_when_the_operator_asks(pair: tuple[Peer, Peer]) -> None:
    receiver, _ = pair
    connections = receiver.stats()["connections"]
    strict = PeerSpec(num_blocks=256, timeout_s=TIMEOUT_S, extra={"allowed_transports": frozenset({"cuda_ipc"})})
    with peers(("sender", strict)) as (sender,):
        sender.command("send", requests=[("strict", [0])], peer=receiver.address)
        result = sender.wait_results(["strict"], TIMEOUT_S + SLACK_S)["strict"]
        assert result["error"] == "SlowPathRefused" and "tcp" in result["message"], result
    assert receiver.stats()["connections"] == connections


def test_direct_writes_prepared_ahead(direct_pair: tuple[Peer, Peer]) -> None:
    """prepare() fetches the grant before the KV exists; forget() gives an unused one back,
    which fails the receiver's expect at once instead of at its timeout."""
    receiver, sender = direct_pair
    receiver.command("expect", requests=[("warm", [39])])
    sender.command("send", requests=[("warm", [1])], peer=receiver.address)  # connects
    assert sender.wait_results(["warm"], TIMEOUT_S + SLACK_S)["warm"]["ok"]
    receiver.command("expect", requests=[("ahead", [40, 41, 42]), ("dropped", [43, 44])])
    sender.command("prepare", prepare=["ahead", "dropped"], peer=receiver.address)
    time.sleep(0.3)  # the grants arrive while "the KV is computed"
    sender.command("send", requests=[("ahead", [7, 8, 9])], peer=receiver.address, forget=["dropped"])
    sent = sender.wait_results(["ahead"], TIMEOUT_S + SLACK_S)["ahead"]
    landed = receiver.wait_results(["ahead", "dropped"], SLACK_S)
    assert sent["ok"] and landed["ahead"]["ok"] and landed["ahead"]["digest"] == sent["digest"]
    assert landed["dropped"]["error"] == "TransferCancelled", landed["dropped"]
    stats = receiver.stats()
    assert stats["pending"] == 0 and stats["held"] == 0


def test_direct_write_block_count_mismatch(direct_pair: tuple[Peer, Peer]) -> None:
    receiver, sender = direct_pair
    receiver.command("expect", requests=[("short", [60, 61])])
    sender.command("send", requests=[("short", [1, 2, 3])], peer=receiver.address)
    sent = sender.wait_results(["short"], TIMEOUT_S + SLACK_S)["short"]
    landed = receiver.wait_results(["short"], TIMEOUT_S + SLACK_S)["short"]
    assert sent["error"] == "TransferRejected" and "expects 2" in sent["message"], sent
    assert landed["error"] == "TransferCancelled", landed
    assert receiver.stats()["stray_blocks"] == 0 and sender.stats()["held"] == 0


@pytest.mark.parametrize("direct", [False, True], ids=["messages", "direct-writes"])
def test_a_prepared_request_outlasts_the_transfer_timeout(direct: bool) -> None:
    """A prefill longer than the receiver's transfer timeout (3x here) lands: the sender's
    "alive" frames restart the receiver's wait while it computes; an expect that no sender
    works on still times out."""
    spec = PeerSpec(num_blocks=64, timeout_s=1.5, direct=direct)
    with peers(("receiver", spec), ("sender", spec.with_(seed=3))) as (receiver, sender):
        receiver.command("expect", requests=[("warm", [1])])
        sender.command("send", requests=[("warm", [2])], peer=receiver.address)  # connects
        assert sender.wait_results(["warm"], 10 + SLACK_S)["warm"]["ok"]
        receiver.command("expect", requests=[("slow", [10, 11, 12]), ("orphan", [13])])
        sender.command("prepare", prepare=["slow"], peer=receiver.address)
        time.sleep(4.5)  # "the prefill"
        sender.command("send", requests=[("slow", [20, 21, 22])], peer=receiver.address)
        sent = sender.wait_results(["slow"], 10 + SLACK_S)["slow"]
        landed = receiver.wait_results(["slow", "orphan"], 10 + SLACK_S)
        assert sent["ok"] and landed["slow"]["ok"], (sent, landed)
        assert landed["slow"]["digest"] == sent["digest"]
        assert landed["orphan"]["error"] == "TransferTimeout", landed["orphan"]
        stats = receiver.stats()
        assert stats["pending"] == 0 and stats["held"] == 0


def test_a_stale_incarnation_is_refused_at_once(pair: tuple[Peer, Peer]) -> None:
    """KV addressed to an earlier incarnation of the receiver at its address (a replaced
    worker whose port was reused) is refused at the handshake, not parked until a timeout;
    the current incarnation's traffic is unaffected."""
    import dataclasses

    receiver, sender = pair
    stale = dataclasses.replace(receiver.address, incarnation="an-old-one")
    assert receiver.address.incarnation and stale != receiver.address
    sender.command("send", requests=[("stale", [3, 4])], peer=stale)
    sent = sender.wait_results(["stale"], TIMEOUT_S + SLACK_S)["stale"]
    assert sent["error"] == "PeerReplaced" and "replaced" in sent["message"], sent
    receiver.command("expect", requests=[("current", [70, 71])])
    sender.command("send", requests=[("current", [5, 6])], peer=receiver.address)
    assert sender.wait_results(["current"], TIMEOUT_S + SLACK_S)["current"]["ok"]
    assert receiver.wait_results(["current"], TIMEOUT_S + SLACK_S)["current"]["ok"]
    assert sender.stats()["held"] == 0 and receiver.stats()["pending"] == 0

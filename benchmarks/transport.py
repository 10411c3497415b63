"""KV transfer benchmark: a request's scattered KV blocks from a sender pool to a receiver
pool in another process over the UCX transport, beside baselines measured in the same run.

    python -m benchmarks.transport --device cuda   # pools on cuda:0 and cuda:1, two processes
    python -m benchmarks.transport --device cpu    # shm / tcp between two processes
    [--tokens 256,1024,4096,16384] [--iters 100] [--json PATH]

Layout: Llama-3.1-8B (32 layers, 8 KV heads, head dim 128, bf16, block 16): 128 KiB per
token. Each iteration the receiver expects the request on fresh random block ids, then
the time from `send()` starting until the receiver's `expect()` resolves ("landed": the KV
is in the receiver's pool and the receiver knows it) is taken, with CLOCK_MONOTONIC on
both sides; `send()`'s own time is shown beside it. Block ids are random
on both sides; the last request of each size is checked byte for byte (sha256 of the
blocks on both sides). The data paths:
- "direct" (GPU only): the sender maps the receiver's pool (CUDA IPC handle from the
  handshake) and copies block to block into it: grant, one kernel, written.
- "direct+prepare": the same with `prepare()` called 5 ms before `send()`, as the
  prefill worker calls it before computing the prompt: the grant's round trip is off
  the timed path (the sleep stands in for a prefill, which takes longer at any size).
- "direct+overlap": as the prefill worker sends: prepared, then `send(after=event)` called
  while the GPU still computes (a ~2 ms stand-in kernel; the event marks its end, as the
  engine's marks the prompt's forward), so the copy is queued behind it and send()'s host
  work overlaps the GPU's. Landed is timed from when the stand-in ended: the transfer's
  exposed time. That moment is the GPU's own clock, stamped by a one-thread kernel behind
  the stand-in and put on the host clock by benchmarks.gpu_clock (within ~1 us; a host
  waiting on a CUDA event sees it tens of microseconds late).
- "ucx messages": gather, one UCX message over the link's endpoint (error handling on; UCX
  picks cuda_ipc or RDMA where there are, else TCP), scatter, acknowledgement.
On GPU the receiver process sees only its own GPU (CUDA_VISIBLE_DEVICES), as under Ray.

Baselines in the same run, same bytes: cuda, a torch peer copy cuda:0 -> cuda:1,
contiguous ("peer copy") and with the same gather/scatter around it; cpu, a local
memcpy and a local gather/scatter.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import multiprocessing as mp
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import torch

from benchmarks.gpu_clock import GpuClock, stamp
from pdserve.engine.kv.pool import KVLayout, KVPool
from pdserve.kv_transport import PeerAddress, TransferResult, TransportConfig
from pdserve.kv_transport.staging import check_block_ids, gather_blocks, scatter_blocks

LAYOUT = KVLayout("llama-3.1-8b", torch.bfloat16, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
SECRET = b"pdserve-benchmark-secret"
NVLINK_H200_GBPS = 450.0  # NVLink 4 x18, one direction


@dataclass(slots=True)
class Row:
    """One timed case; ratios are against the baselines of the same size in this run."""

    path: str
    tokens: int
    mib: float
    p50_ms: float  # until the receiver's expect() resolved (baselines: until the copy is done)
    send_p50_ms: float | None  # until the sender's send() returned
    gbps: float
    transport: str
    vs_copy: float  # share of the plain copy's bandwidth (peer copy or memcpy)
    vs_packed: float  # share of the same copy with the gather/scatter around it


PATHS = {  # name: (direct_writes, prepare ahead, sent while the GPU computes)
    "direct+overlap": (True, True, True),
    "direct+prepare": (True, True, False),
    "direct": (True, False, False),
    "ucx messages": (False, False, False),
}
PREFILL_STANDIN_S = 0.005  # "prefill compute" between prepare() and send(): shorter than any real one
STANDIN_GPU_CYCLES = 4_000_000  # direct+overlap: ~2 ms of GPU work still running when send() is called
BREAKDOWN: list[bool] = []  # --breakdown: time the direct path's parts (patches the transport; slower)


class _Marks:
    """CLOCK_MONOTONIC times of one process's steps of the request in flight (--breakdown).

    The benchmark sends one request at a time, so `current` names the request.
    """

    def __init__(self) -> None:
        self.current = ""
        self.at: dict[str, dict[str, float]] = {}
        self.kernel_ms: dict[str, float] = {}
        self._events: tuple[str, torch.cuda.Event, torch.cuda.Event] | None = None
        self.kv_done: torch.cuda.Event | None = None  # direct+overlap: the stand-in's end (the KV done)
        self.kv_done_to_copy_end_ms: dict[str, float] = {}

    def mark(self, step: str, request_id: str | None = None) -> None:
        self.at.setdefault(request_id or self.current, {})[step] = time.monotonic()

    def patch_sender(self) -> None:
        """Time the copy's launch (PoolWriter.write) and its GPU duration, and when `written` has left."""
        from pdserve.kv_transport import pool_writer, ucx_link

        write, send = pool_writer.PoolWriter.write, ucx_link.Control.send

        def timed_write(writer: pool_writer.PoolWriter, *args: object) -> object:
            self.mark("copy called")
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(writer.stream)
            slot = write(writer, *args)
            end.record(writer.stream)
            self.mark("copy launched")
            self._events = (self.current, start, end)
            return slot

        async def timed_send(ctl: ucx_link.Control, msg: dict) -> None:
            await send(ctl, msg)
            if msg["t"] == "written":
                self.mark("written sent", str(msg["id"]))

        pool_writer.PoolWriter.write = timed_write  # type: ignore[method-assign]
        ucx_link.Control.send = timed_send  # type: ignore[method-assign]

    def read_kernel_time(self) -> None:
        assert self._events is not None
        request_id, start, end = self._events
        end.synchronize()
        self.kernel_ms[request_id] = start.elapsed_time(end)
        if self.kv_done is not None:  # one GPU's events: from the KV being done to the copy's end
            self.kv_done_to_copy_end_ms[request_id] = self.kv_done.elapsed_time(end)

    def patch_receiver(self) -> None:
        """Time when `written` arrives and when the table hears of it."""
        from pdserve.kv_transport import ucx_link
        from pdserve.kv_transport.receive_table import ReceiveTable

        recv, written = ucx_link.Control.recv, ReceiveTable.written

        def timed_written(table: ReceiveTable, request_id: str, *args: object) -> None:
            self.mark("table.written", request_id)
            written(table, request_id, *args)  # type: ignore[arg-type]

        ReceiveTable.written = timed_written  # type: ignore[method-assign]

        async def timed_recv(ctl: ucx_link.Control) -> dict:
            msg = await recv(ctl)
            if msg["t"] == "written":
                self.mark("written received", str(msg["id"]))
            return msg

        ucx_link.Control.recv = timed_recv  # type: ignore[method-assign]


def _config(path: str) -> TransportConfig:
    direct, *_ = PATHS[path]
    return TransportConfig(secret=SECRET, direct_writes=direct, transfer_timeout_s=60.0,
                           connect_timeout_s=30.0)


def _digest(kv: torch.Tensor, ids: list[int]) -> str:
    return hashlib.sha256(kv[:, :, ids].contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _receiver_process(conn: Connection, device: str, num_blocks: int, path: str, breakdown: bool) -> None:
    """Receiver: expects what the parent announces, digests blocks on request, reports
    failures when told to stop."""
    from pdserve.kv_transport import ucx_link
    from pdserve.kv_transport.ucx_receiver import UcxKVReceiver

    marks = _Marks()
    if breakdown:
        marks.patch_receiver()

    async def serve() -> None:
        pool = KVPool(LAYOUT, num_blocks, device)  # creates the CUDA context before UCX starts
        receiver = await UcxKVReceiver.start(pool.kv, LAYOUT, _config(path))
        failures: list[str] = []
        landed_at: dict[str, float] = {}  # CLOCK_MONOTONIC: comparable with the sender's process
        inbox: asyncio.Queue[tuple[str, list[int]] | None] = asyncio.Queue()
        asyncio.get_running_loop().add_reader(conn.fileno(), lambda: inbox.put_nowait(conn.recv()))
        conn.send(receiver.address)
        while (cmd := await inbox.get()) is not None:
            if cmd[0] == "digest":
                conn.send(_digest(pool.kv, cmd[1]))
                continue
            if cmd[0] == "landed_at":
                conn.send((landed_at, marks.at))
                continue

            def done(f: asyncio.Future[TransferResult], request_id: str = cmd[0]) -> None:
                marks.mark("expect resolved", request_id)
                if f.result().ready is not None:
                    # A direct write may still be copying: landed means readable here, which
                    # is when the decode engine would admit the request.
                    f.result().ready.synchronize()
                landed_at[request_id] = time.monotonic()
                if not f.result().ok:
                    failures.append(str(f.result().error))

            receiver.expect(*cmd).add_done_callback(done)
            conn.send("armed")
        await receiver.close()
        ucx_link.stop_ucx()  # or this process waits at its exit for ucxx's notifier thread
        conn.send(failures)

    if device.startswith("cuda"):
        # Only its own GPU, as Ray gives a worker: the pool is cuda:0 here, GPU 1 physically.
        os.environ["CUDA_VISIBLE_DEVICES"] = device.removeprefix("cuda:")
        device = "cuda:0"
        torch.cuda.set_device(0)
    asyncio.run(serve())


async def _bench_ucx(
    path: str, device: str, peer_device: str, tokens_list: list[int], iters: int, num_blocks: int
) -> list[tuple[int, float, float | None, str]]:
    """(tokens, p50 seconds until the receiver knows, p50 seconds of send(), transport) per size."""
    from pdserve.kv_transport import ucx_link
    from pdserve.kv_transport.ucx_sender import UcxKVSender

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_process, args=(child, peer_device, num_blocks, path, bool(BREAKDOWN)),
                       daemon=True)
    proc.start()
    peer: PeerAddress = conn.recv()
    pool = KVPool(LAYOUT, num_blocks, device)
    pool.kv.copy_(torch.randn(pool.kv.shape, device=device).to(LAYOUT.dtype))
    if pool.kv.is_cuda:
        torch.cuda.synchronize()  # send() needs complete KV (its copy runs on a stream of its own)
    sender = UcxKVSender(pool.kv, LAYOUT, _config(path))
    marks = _Marks()
    if BREAKDOWN and PATHS[path][0]:
        marks.patch_sender()
    rng = random.Random(0)
    out = []
    try:
        for tokens in tokens_list:
            n = tokens // LAYOUT.block_size
            times, started, transport = [], {}, "?"
            if PATHS[path][2]:
                clock = GpuClock.calibrate(device)
                kv_done_ns = torch.zeros(iters + 1, dtype=torch.int64, device=device)
            for i in range(iters + 1):  # the first one connects and warms up
                request_id = f"{tokens}-{i}"
                recv_ids, send_ids = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
                conn.send((request_id, recv_ids))
                assert conn.recv() == "armed"
                if PATHS[path][1]:  # as the prefill worker does: ask for the grant, then compute
                    sender.prepare(request_id, peer)
                    await asyncio.sleep(PREFILL_STANDIN_S)
                marks.current = request_id
                if PATHS[path][2]:  # as the prefill worker does: send behind the forward's event
                    kv_done = torch.cuda.Event(enable_timing=bool(BREAKDOWN))
                    torch.cuda._sleep(STANDIN_GPU_CYCLES)
                    stamp(kv_done_ns[i:i + 1])  # the GPU's clock as the KV is done (read after the loop)
                    kv_done.record()
                    marks.kv_done = kv_done
                    result = await sender.send(request_id, send_ids, peer, after=kv_done)
                else:
                    started[request_id] = time.monotonic()
                    result = await sender.send(request_id, send_ids, peer)
                marks.mark("send returned")
                result.raise_for_error()
                if marks.at.get(request_id, {}).get("copy launched"):
                    marks.read_kernel_time()
                transport = result.transport
                if i:
                    times.append(result.elapsed_s)
                await asyncio.sleep(0.002)  # the receiver's side resolves before the next one
            if PATHS[path][2]:  # landed is timed from when the KV was done, on the GPU's clock
                drift_us = abs(GpuClock.calibrate(device).offset_ns - clock.offset_ns) / 1e3
                for i, ns in enumerate(kv_done_ns.tolist()):
                    started[f"{tokens}-{i}"] = clock.to_host_s(ns)
                if drift_us > 5:
                    print(f"{path}, {tokens} tokens: the GPU clock's offset moved {drift_us:.1f} us during the run")
            conn.send(("landed_at",))
            landed_at, recv_marks = conn.recv()
            recv_times = [landed_at[r] - t for r, t in started.items() if not r.endswith("-0")]
            if BREAKDOWN:
                _print_breakdown(path, tokens, started, marks, recv_marks, landed_at)
            conn.send(("digest", recv_ids))
            if conn.recv() != _digest(pool.kv, send_ids):
                raise RuntimeError(f"{path}, {tokens} tokens: the receiver's blocks differ from the sender's")
            if PATHS[path][0] and device.startswith("cuda") and sender.direct_peers() != [peer]:
                raise RuntimeError("direct writes were not set up (see the log above for why)")
            send_time = None if PATHS[path][2] else statistics.median(times)  # overlap: includes the stand-in
            out.append((tokens, statistics.median(recv_times), send_time, transport))
        if COPY_SWEEP and sender.direct_peers():
            _copy_sweep(pool.kv, sender._conns[peer].peer_kv, tokens_list, num_blocks)
    finally:
        await sender.close()
        ucx_link.stop_ucx()  # the next path's ensure_ucx starts UCX afresh
        conn.send(None)
        failures = conn.recv()
        proc.join(30)
    if failures:
        raise RuntimeError(f"receiver saw failures: {failures[:3]}")
    return out


def _print_breakdown(
    path: str, tokens: int, started: dict[str, float], marks: _Marks, recv_marks: dict[str, dict[str, float]],
    landed_at: dict[str, float],
) -> None:
    """p50 of each step's time since send() started (ms), both processes on one clock."""
    steps: dict[str, list[float]] = {}
    for request_id, t0 in started.items():
        if request_id.endswith("-0"):
            continue
        at = {**marks.at.get(request_id, {}), **recv_marks.get(request_id, {}), "landed": landed_at[request_id]}
        for step, t in at.items():
            steps.setdefault(step, []).append((t - t0) * 1e3)
        if request_id in marks.kernel_ms:
            steps.setdefault("(copy kernel GPU time)", []).append(marks.kernel_ms[request_id])
        if request_id in marks.kv_done_to_copy_end_ms:  # started is the KV done, on the GPU's clock
            steps.setdefault("copy ended (GPU)", []).append(marks.kv_done_to_copy_end_ms[request_id])
    order = sorted(steps, key=lambda k: statistics.median(steps[k]) if not k.startswith("(") else 1e9)
    print(f"breakdown {path}, {tokens} tokens (p50 ms since send() started): " +
          ", ".join(f"{k} {statistics.median(steps[k]):.3f}" for k in order))


COPY_SWEEP: list[tuple[int, int, int]] = []  # (chunk, num_warps, programs per SM) of kernels.block_copy


def _copy_sweep(src: torch.Tensor, peer_kv: torch.Tensor, tokens_list: list[int], num_blocks: int) -> None:
    """Time copy_blocks variants into the mapped peer pool, no protocol around them: GPU time
    (CUDA events around the launch, median of 30), beside a peer copy of the same bytes."""
    from pdserve.kernels.block_copy import copy_blocks
    from pdserve.kv_transport.staging import blocks_view

    rng = random.Random(5)
    print(f"{'copy_blocks into the peer pool':34} " + " ".join(f"{t:>8}" for t in tokens_list) + "  (GB/s)")
    peer_rates = []
    for tokens in tokens_list:
        nbytes = tokens // LAYOUT.block_size * LAYOUT.bytes_per_block
        a, b = src.view(-1)[:nbytes // src.element_size()], peer_kv.view(-1)[:nbytes // src.element_size()]
        peer_rates.append(nbytes / _gpu_seconds(lambda: b.copy_(a)) / 1e9)  # noqa: B023
    print(f"{'peer copy, contiguous':34} " + " ".join(f"{r:>8.1f}" for r in peer_rates))
    for chunk, warps, per_sm in COPY_SWEEP:
        rates = []
        for tokens in tokens_list:
            n = tokens // LAYOUT.block_size
            src_ids = torch.tensor(rng.sample(range(num_blocks), n), device=src.device)
            dst_ids = torch.tensor(rng.sample(range(num_blocks), n), device=src.device)

            def copy() -> None:
                copy_blocks(blocks_view(src), src_ids, blocks_view(peer_kv), dst_ids, chunk=chunk,  # noqa: B023
                            num_warps=warps, programs_per_sm=per_sm)  # noqa: B023

            rates.append(n * LAYOUT.bytes_per_block / _gpu_seconds(copy) / 1e9)
        print(f"{f'chunk {chunk}, {warps} warps, {per_sm}/SM':34} " + " ".join(f"{r:>8.1f}" for r in rates))


def _gpu_seconds(fn: Callable[[], object], iters: int = 30) -> float:
    """Median GPU time of fn between two CUDA events, launched while the GPU is still busy
    (~0.5 ms of sleep ahead of it), so the host's launch cost is not counted."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _p50_seconds(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _baselines(device: str, peer_device: str, tokens: int, iters: int, num_blocks: int) -> dict[str, float]:
    """p50 seconds to move the same bytes without the transport: plain, and with gather/scatter."""
    n = tokens // LAYOUT.block_size
    nbytes = n * LAYOUT.bytes_per_block
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=peer_device)
    src_pool, dst_pool = KVPool(LAYOUT, num_blocks, device), KVPool(LAYOUT, num_blocks, peer_device)
    src_ids = check_block_ids(random.Random(1).sample(range(num_blocks), n), num_blocks)
    dst_ids = check_block_ids(random.Random(2).sample(range(num_blocks), n), num_blocks)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
            torch.cuda.synchronize(peer_device)

    def packed() -> None:
        scatter_blocks(dst_pool.kv, dst_ids, gather_blocks(src_pool.kv, src_ids).to(peer_device))

    name = "peer copy" if device.startswith("cuda") else "memcpy"
    return {
        name: _p50_seconds(lambda: dst.copy_(src), iters, sync),
        f"{name} + gather/scatter": _p50_seconds(packed, iters, sync),
    }


def run(device: str, tokens_list: list[int], iters: int, paths: list[str]) -> list[Row]:
    src_dev, dst_dev = ("cuda:0", "cuda:1") if device == "cuda" else ("cpu", "cpu")
    # Twice the largest request, so that random block ids are really scattered.
    num_blocks = 2 * max(tokens_list) // LAYOUT.block_size
    bases = {t: _baselines(src_dev, dst_dev, t, iters, num_blocks) for t in tokens_list}
    measured: list[tuple[str, int, float, float | None, str]] = []
    for path in paths:
        results = asyncio.run(_bench_ucx(path, src_dev, dst_dev, tokens_list, iters, num_blocks))
        measured += [(path, tokens, landed, send, transport) for tokens, landed, send, transport in results]
    for tokens, base in bases.items():
        measured += [(name, tokens, seconds, None, "-") for name, seconds in base.items()]
    rows = []
    for path, tokens, seconds, send_s, transport in measured:
        nbytes = tokens // LAYOUT.block_size * LAYOUT.bytes_per_block
        copy_s, packed_s = bases[tokens].values()
        rows.append(Row(path, tokens, nbytes / 2**20, seconds * 1e3, send_s * 1e3 if send_s else None,
                        nbytes / seconds / 1e9, transport, copy_s / seconds, packed_s / seconds))
    return rows


def print_table(rows: list[Row], device: str) -> None:
    copy = "peer copy" if device == "cuda" else "memcpy"
    print(f"{'path':26} {'tokens':>6} {'MiB':>6} {'landed p50 ms':>13} {'send() p50 ms':>13} {'GB/s':>7} "
          f"{'transport':>9} {'vs ' + copy:>13} {'vs +gather/scatter':>19}")
    for r in rows:
        send = f"{r.send_p50_ms:.3f}" if r.send_p50_ms is not None else "-"
        print(f"{r.path:26} {r.tokens:>6} {r.mib:>6.0f} {r.p50_ms:>13.3f} {send:>13} {r.gbps:>7.2f} "
              f"{r.transport:>9} {r.vs_copy:>13.1%} {r.vs_packed:>19.1%}")
    print("landed: from send() starting (direct+overlap: from the KV being done, on the GPU's clock) until the"
          " receiver's expect() resolved and the KV is readable there (one clock, two processes); peer copy: host"
          " time of the copy and both GPUs' sync")
    if device == "cuda":
        print(f"physical limit: NVLink (H200, NV18) {NVLINK_H200_GBPS:.0f} GB/s per direction; "
              "goal >= 85% of peer copy at >= 1k tokens, 4k tokens landed in <= 2 ms p50")
    else:
        print("physical limit: the local memcpy rows (one copy of the bytes on this machine)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default=None, help="comma-separated request sizes in tokens")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per size (p50 over them)")
    parser.add_argument("--json", default=None, help="also write every row here")
    parser.add_argument("--paths", default=None, help=f"comma-separated subset of {list(PATHS)}")
    parser.add_argument("--breakdown", action="store_true", help="time the direct path's steps (patches it)")
    parser.add_argument("--copy-sweep", default="",
                        help="chunk:warps:programs_per_sm,... variants of the direct path's copy kernel")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    BREAKDOWN.extend([True] if args.breakdown else [])
    COPY_SWEEP.extend(tuple(int(x) for x in v.split(":")) for v in args.copy_sweep.split(",") if v)  # type: ignore[misc]
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error("--device cuda needs two GPUs")
    default_tokens = "256,1024,4096,16384" if args.device == "cuda" else "256,1024,4096"
    tokens = [int(t) for t in (args.tokens or default_tokens).split(",")]
    if any(t < LAYOUT.block_size or t % LAYOUT.block_size for t in tokens):
        parser.error(f"token counts must be multiples of the block size {LAYOUT.block_size}")
    default = list(PATHS) if args.device == "cuda" else ["ucx messages"]
    paths = args.paths.split(",") if args.paths else default
    if bad := [p for p in paths if p not in PATHS or (args.device == "cpu" and PATHS[p][0])]:
        parser.error(f"--paths: {bad} unknown, or direct (GPU only)")
    rows = run(args.device, tokens, args.iters or (100 if args.device == "cuda" else 10), paths)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    print_table(rows, args.device)


if __name__ == "__main__":
    main()

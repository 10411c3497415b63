"""KV transfer benchmark: a request's scattered KV blocks from a sender pool to a receiver
pool in another process over the UCX transport, beside baselines measured in the same run.

    python -m benchmarks.transport --device cuda   # pools on cuda:0 and cuda:1, two processes
    python -m benchmarks.transport --device cpu    # shm / tcp between two processes
    [--tokens 256,1024,4096,16384] [--iters 100] [--json PATH]

Layout: Llama-3.1-8B (32 layers, 8 KV heads, head dim 128, bf16, block 16): 128 KiB per
token. Each iteration the receiver expects the request on fresh random block ids, then
the sender's `send()` is timed: gather on the sender, transfer, scatter on the receiver,
acknowledgement; so "landed" means the KV is in the receiver's pool. Block ids are random
on both sides. Two data paths: "fast" (worker-address endpoint without UCX error
handling) and "checked" (the listener endpoint, error handling on).

Baselines in the same run, same bytes: cuda, a torch peer copy cuda:0 -> cuda:1,
contiguous ("peer copy") and with the same gather/scatter around it; cpu, a local
memcpy and a local gather/scatter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import torch

from engine.kv_pool import KVLayout, KVPool
from kv_transport import PeerAddress, TransportConfig
from kv_transport.staging import check_block_ids, gather_blocks, scatter_blocks

LAYOUT = KVLayout("llama-3.1-8b", torch.bfloat16, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
SECRET = b"pdserve-benchmark-secret"
NVLINK_H200_GBPS = 450.0  # NVLink 4 x18, one direction


@dataclass(slots=True)
class Row:
    """One timed case; ratios are against the baselines of the same size in this run."""

    path: str
    tokens: int
    mib: float
    p50_ms: float
    gbps: float
    transport: str
    vs_copy: float  # share of the plain copy's bandwidth (peer copy or memcpy)
    vs_packed: float  # share of the same copy with the gather/scatter around it


def _config(fast: bool) -> TransportConfig:
    return TransportConfig(secret=SECRET, fast_data_path=fast, transfer_timeout_s=60.0, connect_timeout_s=30.0)


def _receiver_process(conn: Connection, device: str, num_blocks: int, fast: bool) -> None:
    """Receiver: expects what the parent announces; reports failures when told to stop."""
    from kv_transport.ucx_receiver import UcxKVReceiver

    async def serve() -> None:
        pool = KVPool(LAYOUT, num_blocks, device)  # creates the CUDA context before UCX starts
        receiver = await UcxKVReceiver.start(pool.kv, LAYOUT, _config(fast))
        failures: list[str] = []
        inbox: asyncio.Queue[tuple[str, list[int]] | None] = asyncio.Queue()
        asyncio.get_running_loop().add_reader(conn.fileno(), lambda: inbox.put_nowait(conn.recv()))
        conn.send(receiver.address)
        while (cmd := await inbox.get()) is not None:
            landed = receiver.expect(*cmd)
            landed.add_done_callback(lambda f: f.result().ok or failures.append(str(f.result().error)))
            conn.send("armed")
        await receiver.close()
        conn.send(failures)

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    asyncio.run(serve())


async def _bench_ucx(
    fast: bool, device: str, peer_device: str, tokens_list: list[int], iters: int, num_blocks: int
) -> list[tuple[int, float, str]]:
    """(tokens, p50 seconds from send() to landed, transport) per request size."""
    from kv_transport.ucx_sender import UcxKVSender

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_process, args=(child, peer_device, num_blocks, fast), daemon=True)
    proc.start()
    peer: PeerAddress = conn.recv()
    pool = KVPool(LAYOUT, num_blocks, device)
    pool.kv.copy_(torch.randn(pool.kv.shape, device=device).to(LAYOUT.dtype))
    sender = UcxKVSender(pool.kv, LAYOUT, _config(fast))
    rng = random.Random(0)
    out = []
    try:
        for tokens in tokens_list:
            n = tokens // LAYOUT.block_size
            times, transport = [], "?"
            for i in range(iters + 1):  # the first one connects and warms up
                request_id = f"{tokens}-{i}"
                conn.send((request_id, rng.sample(range(num_blocks), n)))
                assert conn.recv() == "armed"
                result = await sender.send(request_id, rng.sample(range(num_blocks), n), peer)
                result.raise_for_error()
                transport = result.transport
                if i:
                    times.append(result.elapsed_s)
            out.append((tokens, statistics.median(times), transport))
    finally:
        await sender.close()
        conn.send(None)
        failures = conn.recv()
        proc.join(30)
    if failures:
        raise RuntimeError(f"receiver saw failures: {failures[:3]}")
    return out


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


def run(device: str, tokens_list: list[int], iters: int) -> list[Row]:
    src_dev, dst_dev = ("cuda:0", "cuda:1") if device == "cuda" else ("cpu", "cpu")
    # Twice the largest request, so that random block ids are really scattered.
    num_blocks = 2 * max(tokens_list) // LAYOUT.block_size
    bases = {t: _baselines(src_dev, dst_dev, t, iters, num_blocks) for t in tokens_list}
    measured: list[tuple[str, int, float, str]] = []
    for fast in (True, False):
        path = "ucx fast (no UCX error handling)" if fast else "ucx checked (error handling)"
        results = asyncio.run(_bench_ucx(fast, src_dev, dst_dev, tokens_list, iters, num_blocks))
        measured += [(path, tokens, seconds, transport) for tokens, seconds, transport in results]
    for tokens, base in bases.items():
        measured += [(name, tokens, seconds, "-") for name, seconds in base.items()]
    rows = []
    for path, tokens, seconds, transport in measured:
        nbytes = tokens // LAYOUT.block_size * LAYOUT.bytes_per_block
        copy_s, packed_s = bases[tokens].values()
        rows.append(Row(path, tokens, nbytes / 2**20, seconds * 1e3, nbytes / seconds / 1e9, transport,
                        copy_s / seconds, packed_s / seconds))
    return rows


def print_table(rows: list[Row], device: str) -> None:
    copy = "peer copy" if device == "cuda" else "memcpy"
    print(f"{'path':34} {'tokens':>6} {'MiB':>6} {'p50 ms':>9} {'GB/s':>7} {'transport':>9} "
          f"{'vs ' + copy:>13} {'vs +gather/scatter':>19}")
    for r in rows:
        print(f"{r.path:34} {r.tokens:>6} {r.mib:>6.0f} {r.p50_ms:>9.3f} {r.gbps:>7.2f} {r.transport:>9} "
              f"{r.vs_copy:>13.1%} {r.vs_packed:>19.1%}")
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
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error("--device cuda needs two GPUs")
    default_tokens = "256,1024,4096,16384" if args.device == "cuda" else "256,1024,4096"
    tokens = [int(t) for t in (args.tokens or default_tokens).split(",")]
    if any(t < LAYOUT.block_size or t % LAYOUT.block_size for t in tokens):
        parser.error(f"token counts must be multiples of the block size {LAYOUT.block_size}")
    rows = run(args.device, tokens, args.iters or (100 if args.device == "cuda" else 10))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    print_table(rows, args.device)


if __name__ == "__main__":
    main()

"""Soak: a real `pdserve serve` under steady load for a long time, its decode worker killed
every few minutes; is anything lost, failed, leaked or growing?

    python -m benchmarks.soak [--minutes 30] [--kill-every 5] [--rate R] [--out /tmp/pdserve-soak]

Starts `pdserve serve` (CPU, the default model, one prefill and one decode worker) as a
child process, measures its capacity with a short burst (unless --rate is given) and
then sends requests at --rate (default 80% of that capacity) for --minutes, through
`pdserve bench`'s gRPC backend and Poisson load generator (pdserve.cluster.bench). Every
--kill-every minutes it SIGKILLs the decode worker's Ray actor process (found among the
server's descendants by its process title, `ray::DecodeWorker`); the server replaces it
and the requests it held continue on the replacement (migration). Every --sample-s
seconds it records the RSS of the server and of each of its Ray processes (CSV, and a
PNG when matplotlib is installed). At the end, once idle, every worker's KV blocks must
all be free again. Prints one table; exits 1 if a request failed or a block leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.bench.backends import GrpcBackend, RequestResult
from pdserve.cluster.bench.dataset import random_requests
from pdserve.cluster.bench.runner import LoadShape, run_load
from pdserve.proto.v1 import generation_pb2 as pb
from pdserve.proto.v1 import generation_pb2_grpc as pb_grpc

DECODE_TITLE = "ray::DecodeWorker"


@dataclass(frozen=True, slots=True)
class SoakConfig:
    minutes: float = 30.0
    kill_every_min: float = 5.0  # 0: never
    rate: float | None = None  # req/s; None: 80% of the measured capacity
    capacity_fraction: float = 0.8
    burst_requests: int = 16  # the capacity burst
    input_len: int = 128
    output_len: int = 32
    sample_s: float = 5.0
    idle_timeout_s: float = 120.0  # after the load, for the workers to become idle
    out: Path = Path(tempfile.gettempdir()) / "pdserve-soak"

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.kill_every_min < 0 or self.sample_s <= 0:
            raise ValueError(f"--minutes and --sample-s must be > 0 and --kill-every >= 0, got {self.minutes}, "
                             f"{self.sample_s}, {self.kill_every_min}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")


# The server --------------------------------------------------------------------------


@dataclass(slots=True)
class ServeProcess:
    """`pdserve serve` in a session of its own (its Ray processes are its descendants)."""

    proc: subprocess.Popen
    grpc_port: int
    metrics_port: int
    log: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def processes(self) -> list[psutil.Process]:
        """The server and all its descendants (GCS, raylet, Ray workers and actors)."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def metrics(self) -> dict[str, float]:
        """The server's counters, e.g. 'pdserve_request_migrations_total' -> 3.0 (labels summed)."""
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        totals: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] += sample.value
        return dict(totals)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
                self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(out: Path, timeout_s: float = 600.0) -> ServeProcess:
    grpc_port, metrics_port = _free_port(), _free_port()
    log = out / "serve.log"
    cmd = [sys.executable, "-m", "pdserve.cluster.cli", "serve", "--device", "cpu", "--port", str(grpc_port),
           "--metrics-port", str(metrics_port), "--no-http"]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    server = ServeProcess(proc, grpc_port, metrics_port, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {proc.returncode}; see {log}:\n{log.read_text()[-3000:]}")
        try:
            if server_info(server.target).workers:
                return server
        except grpc.RpcError:
            time.sleep(2)
    server.stop()
    raise RuntimeError(f"pdserve serve did not answer within {timeout_s:.0f} s; see {log}")


def server_info(target: str) -> pb.ServerInfo:
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.GenerationStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


# Killing, sampling --------------------------------------------------------------------


def _title(p: psutil.Process) -> str:
    """What a process is: a Ray worker's title without the method it runs
    (`ray::DecodeWorker.poll` -> `ray::DecodeWorker`), else its program (and script)."""
    cmd = p.cmdline()
    if not cmd:
        return p.name()
    if cmd[0].startswith("ray::"):
        return cmd[0].split()[0].split(".")[0]
    program = os.path.basename(cmd[0])
    if not program.startswith("python"):
        return program
    args = iter(cmd[1:])
    for arg in args:
        if arg == "-m":
            return f"{program} -m {next(args, '')}"
        if not arg.startswith("-"):
            return f"{program} {os.path.basename(arg)}"
    return program


def _titled(server: ServeProcess) -> Iterator[tuple[psutil.Process, str]]:
    for p in server.processes():
        try:
            yield p, _title(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def kill_decode_worker(server: ServeProcess) -> int | None:
    """SIGKILL the decode worker's actor process; its pid, or None when there is none now."""
    for p, title in _titled(server):
        if title == DECODE_TITLE:
            p.send_signal(signal.SIGKILL)
            return p.pid
    return None


@dataclass(slots=True)
class RssSample:
    t_s: float
    pid: int
    title: str
    rss_mb: float


def sample_rss(server: ServeProcess, t_s: float) -> list[RssSample]:
    samples = []
    for p, title in _titled(server):
        try:
            samples.append(RssSample(t_s, p.pid, title, p.memory_info().rss / 2**20))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return samples


# The run ------------------------------------------------------------------------------


@dataclass(slots=True)
class SoakResult:
    rate: float
    capacity: float | None
    results: list[RequestResult]
    kills: list[tuple[float, int]] = field(default_factory=list)  # (seconds in, pid)
    rss: list[RssSample] = field(default_factory=list)
    metrics_before: dict[str, float] = field(default_factory=dict)
    metrics_after: dict[str, float] = field(default_factory=dict)
    workers: list[pb.WorkerInfo] = field(default_factory=list)  # once idle, at the end
    duration_s: float = 0.0


async def measure_capacity(backend: GrpcBackend, cfg: SoakConfig, vocab: int) -> float:
    """Requests/s the server completes when `burst_requests` arrive at once."""
    burst = random_requests(cfg.burst_requests, cfg.input_len, cfg.output_len, vocab, seed=1)
    run = await run_load(backend, burst, LoadShape(), progress=False)
    ok = sum(r.ok for r in run.results)
    if not ok:
        raise RuntimeError(f"the capacity burst failed: {[r.error for r in run.results][:3]}")
    return ok / run.duration_s


async def soak(server: ServeProcess, cfg: SoakConfig) -> SoakResult:
    backend = GrpcBackend(server.target, temperature=1.0)
    try:
        vocab = await backend.vocab_size()
        assert vocab is not None
        await run_load(backend, random_requests(2, cfg.input_len, 4, vocab, seed=2), LoadShape(), progress=False)
        capacity = await measure_capacity(backend, cfg, vocab) if cfg.rate is None else None
        rate = cfg.rate if capacity is None else cfg.capacity_fraction * capacity
        num = max(1, math.ceil(rate * cfg.minutes * 60))
        print(f"soak: {num} requests at {rate:.3f} req/s for {cfg.minutes:g} min"
              + (f" (capacity {capacity:.3f} req/s)" if capacity else ""), flush=True)
        result = SoakResult(rate, capacity, [], metrics_before=server.metrics())
        start = time.monotonic()
        load = asyncio.create_task(run_load(backend, random_requests(num, cfg.input_len, cfg.output_len, vocab,
                                                                     seed=3), LoadShape(request_rate=rate),
                                            progress=False))
        helpers = [asyncio.create_task(_sample(server, cfg, start, load, result))]
        if cfg.kill_every_min:
            helpers.append(asyncio.create_task(_kill(server, cfg, start, result)))
        run = await load
        result.duration_s = time.monotonic() - start
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        result.results = run.results
        result.workers = await _idle_workers(server, cfg.idle_timeout_s)
        result.metrics_after = server.metrics()
        result.rss += sample_rss(server, time.monotonic() - start)
        return result
    finally:
        await backend.close()


async def _sample(server: ServeProcess, cfg: SoakConfig, start: float, load: asyncio.Task,
                  result: SoakResult) -> None:
    while not load.done():
        result.rss += sample_rss(server, time.monotonic() - start)
        await asyncio.sleep(cfg.sample_s)


async def _kill(server: ServeProcess, cfg: SoakConfig, start: float, result: SoakResult) -> None:
    """A kill every kill_every_min while requests still arrive (not in the tail)."""
    period = cfg.kill_every_min * 60
    k = 1
    while k * period < cfg.minutes * 60:
        await asyncio.sleep(max(0.0, start + k * period - time.monotonic()))
        pid = kill_decode_worker(server)
        t = time.monotonic() - start
        print(f"soak: {t:6.0f} s: " + (f"SIGKILL decode worker pid {pid}" if pid else "no decode worker to kill"),
              flush=True)
        if pid:
            result.kills.append((t, pid))
        k += 1


async def _idle_workers(server: ServeProcess, timeout_s: float) -> list[pb.WorkerInfo]:
    """The workers once all are healthy and idle, read twice a few seconds apart."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = list(server_info(server.target).workers)
        idle = all(w.healthy and w.running == 0 and w.waiting == 0 for w in workers)
        if idle or time.monotonic() > deadline:
            await asyncio.sleep(3)  # the coordinator's load refresh and any late frees
            return list(server_info(server.target).workers)
        await asyncio.sleep(1)


# The report ---------------------------------------------------------------------------


def write_rss(samples: list[RssSample], out: Path) -> Path | None:
    """rss.csv, and rss.png when matplotlib is there (None otherwise)."""
    with (out / "rss.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "pid", "process", "rss_mb"])
        w.writerows((f"{s.t_s:.1f}", s.pid, s.title, f"{s.rss_mb:.1f}") for s in samples)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(10, 6))
    for key in sorted({(s.title, s.pid) for s in samples}):
        pts = [(s.t_s, s.rss_mb) for s in samples if (s.title, s.pid) == key]
        if max(m for _, m in pts) >= 50:  # leave out small helpers (shells, log monitors)
            ax.plot(*zip(*pts), label=f"{key[0]} ({key[1]})")
    ax.set(xlabel="seconds", ylabel="RSS (MiB)", title="pdserve soak: RSS per process")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=100)
    plt.close(fig)
    return out / "rss.png"


def report(result: SoakResult, cfg: SoakConfig, png: Path | None) -> tuple[str, bool]:
    """The table, and whether the run passed (nothing failed, nothing leaked)."""
    ok = sum(r.ok for r in result.results)
    failed = Counter((r.error or "no output").split(":")[0] for r in result.results if not r.ok)

    def delta(name: str) -> str:
        if name not in result.metrics_after:
            return "n/a"
        return f"{result.metrics_after[name] - result.metrics_before.get(name, 0.0):.0f}"

    leaked = {w.id: w.total_kv_blocks - w.free_kv_blocks for w in result.workers}
    lines = [
        f"| {'':<40} | {'':>24} |", f"|{'-' * 42}|{'-' * 26}|",
        f"| {'duration (load + tail)':<40} | {result.duration_s:>22.0f} s |",
        f"| {'request rate':<40} | {result.rate:>18.3f} req/s |",
        f"| {'measured capacity (burst)':<40} | "
        + (f"{result.capacity:>18.3f} req/s |" if result.capacity else f"{'given (--rate)':>24} |"),
        f"| {'requests sent':<40} | {len(result.results):>24} |",
        f"| {'requests completed':<40} | {ok:>24} |",
        f"| {'requests migrated (server metric)':<40} | {delta('pdserve_request_migrations_total'):>24} |",
        f"| {'decode workers killed / lost (metric)':<40} | "
        f"{f'{len(result.kills)} / ' + delta('pdserve_workers_lost_total'):>24} |",
    ]
    for code, n in sorted(failed.items()) or [("-", 0)]:
        lines.append(f"| {f'failed: {code}':<40} | {n:>24} |")
    messages = Counter(r.error or "no output" for r in result.results if not r.ok)
    for wid, n in sorted(leaked.items()):
        w = next(w for w in result.workers if w.id == wid)
        lines.append(f"| {f'leaked KV blocks, {wid} ({w.role})':<40} | "
                     f"{f'{n} of {w.total_kv_blocks}':>24} |")
    lines += [f"  {n} x {message[:160]}" for message, n in messages.most_common(5)]
    lines += ["", "RSS (MiB) by process: first sample, max, last"]
    lines.append(f"| {'process':<28} | {'pid':>8} | {'first':>7} | {'max':>7} | {'last':>7} | {'seen s':>9} |")
    lines.append(f"|{'-' * 30}|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 11}|")
    for key in sorted({(s.title, s.pid) for s in result.rss}):
        pts = [s for s in result.rss if (s.title, s.pid) == key]
        if max(p.rss_mb for p in pts) < 50:
            continue
        lines.append(f"| {key[0][:28]:<28} | {key[1]:>8} | {pts[0].rss_mb:>7.0f} | "
                     f"{max(p.rss_mb for p in pts):>7.0f} | {pts[-1].rss_mb:>7.0f} | "
                     f"{f'{pts[0].t_s:.0f}-{pts[-1].t_s:.0f}':>9} |")
    lines.append(f"(samples every {cfg.sample_s:g} s in {cfg.out / 'rss.csv'}"
                 + (f", plot {png}" if png else "; matplotlib missing: no plot") + ")")
    passed = not failed and not any(leaked.values()) and bool(result.workers)
    return "\n".join(lines), passed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long requests arrive")
    ap.add_argument("--kill-every", type=float, default=5.0, help="minutes between decode worker kills (0: none)")
    ap.add_argument("--rate", type=float, default=None, help="req/s (default: 80%% of the measured capacity)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--out", type=Path, default=SoakConfig.out, help="folder for rss.csv, rss.png, serve.log")
    args = ap.parse_args()
    cfg = SoakConfig(minutes=args.minutes, kill_every_min=args.kill_every, rate=args.rate,
                     input_len=args.input_len, output_len=args.output_len, sample_s=args.sample_s, out=args.out)
    cfg.out.mkdir(parents=True, exist_ok=True)
    server = start_serve(cfg.out)
    try:
        result = asyncio.run(soak(server, cfg))
    finally:
        server.stop()
    table, passed = report(result, cfg, write_rss(result.rss, cfg.out))
    print(table)
    print("soak: PASS" if passed else "soak: FAIL (failed requests or leaked KV blocks)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

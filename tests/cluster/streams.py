"""Helpers for driving a server through real gRPC clients."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams

# The engine section of a server on the default model (the cluster tests' servers run the
# small model otherwise): for tests whose point needs a real model's text or its long steps.
DEFAULT_MODEL = {"model": {"source": "default", "device": "cpu", "dtype": "float32"}}


@dataclass
class Streamed:
    token_ids: list[int]
    text: str
    finish_reason: int
    num_responses: int
    num_cached_tokens: int = 0  # the last response's usage.cached_prompt_tokens


def collect(target: str, prompt: str | list[int], params: SamplingParams, timeout_s: float = 120.0) -> Streamed:
    with Client(target) as client:
        ids: list[int] = []
        text, reason, n = "", 0, 0
        for resp in client.generate(prompt, params, timeout_s=timeout_s):
            ids.extend(resp.token_ids)
            text += resp.text
            reason = resp.finish_reason or reason
            n += 1
        return Streamed(ids, text, reason, n, resp.usage.cached_prompt_tokens)


def collect_concurrently(target: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[Streamed]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda a: collect(target, *a), zip(prompts, params)))


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def pools_are_full(target: str, credentials: ClientCredentials | None = None) -> bool:
    """Every worker has all its KV blocks free and nothing running (from GetServerInfo)."""
    with Client(target, credentials) as client:
        info = client.server_info()
    return all(w.healthy and w.free_kv_blocks == w.total_kv_blocks and w.running == 0 and w.waiting == 0
               for w in info.workers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """The samples of a server's /metrics (Prometheus text), by name with labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


@contextlib.contextmanager
def serve_process(command: list[str], cwd: Path | None = None,
                  start_timeout_s: float = 300.0) -> Iterator[subprocess.Popen[str]]:
    """`pdserve serve ...` as a process of its own (a session of its own: its Ray goes with
    it), once it says it is serving; SIGTERM at the end, SIGKILL to the group past 60 s."""
    import pytest

    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("pdserve: serving"):
                proc.serving_line = line  # what it said (e.g. the address that frontends join)
                break
            if not line and proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"pdserve serve did not start (exit {proc.poll()}):\n{''.join(lines[-60:])}")
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

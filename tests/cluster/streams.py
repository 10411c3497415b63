"""Helpers for driving a server through real gRPC clients."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.cluster.client import Client
from pdserve.engine.sampling import SamplingParams


@dataclass
class Streamed:
    token_ids: list[int]
    text: str
    finish_reason: int
    num_responses: int


def collect(target: str, prompt: str | list[int], params: SamplingParams, timeout_s: float = 120.0) -> Streamed:
    with Client(target) as client:
        ids: list[int] = []
        text, reason, n = "", 0, 0
        for resp in client.generate(prompt, params, timeout_s=timeout_s):
            ids.extend(resp.token_ids)
            text += resp.text
            reason = resp.finish_reason or reason
            n += 1
        return Streamed(ids, text, reason, n)


def collect_concurrently(target: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[Streamed]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda a: collect(target, *a), zip(prompts, params)))


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def pools_are_full(target: str) -> bool:
    """Every worker has all its KV blocks free and nothing running (from GetServerInfo)."""
    with Client(target) as client:
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

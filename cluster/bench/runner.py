"""Sends a benchmark's requests: arrivals of a Poisson process at a given rate (or all at
once), at most `max_concurrency` in flight, with a progress bar."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from pdserve.cluster.bench.backends import Backend, RequestResult
from pdserve.cluster.bench.dataset import BenchRequest

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class LoadShape:
    request_rate: float = float("inf")  # requests/s of a Poisson process; inf sends all at once
    max_concurrency: int | None = None  # requests in flight at most (None: no cap)
    timeout_s: float = 600.0  # per request
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be positive (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {self.max_concurrency}")


@dataclass(frozen=True, slots=True)
class RunResult:
    shape: LoadShape
    results: list[RequestResult]
    duration_s: float  # first send to last answer


async def run_load(backend: Backend, requests: list[BenchRequest], shape: LoadShape,
                   progress: bool = True) -> RunResult:
    limit = asyncio.Semaphore(shape.max_concurrency or len(requests) or 1)

    async def one(request: BenchRequest) -> RequestResult:
        async with limit:
            return await backend.send(request, shape.timeout_s)

    results, duration = await paced(requests, one, shape, f"rate {shape.request_rate:g}", "req", progress)
    return RunResult(shape, results, duration)


async def paced(items: list[T], send: Callable[[T], Awaitable[R]], shape: LoadShape, desc: str, unit: str,
                progress: bool) -> tuple[list[R], float]:
    """`send` each item, starts spaced as a Poisson process at `shape.request_rate` (all at
    once at inf), with a progress bar: the results in order, and the seconds from the first
    start to the last result."""
    rng = random.Random(shape.seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), unit=unit, desc=desc, leave=False)

    async def one(item: T) -> R:
        result = await send(item)
        if bar is not None:
            bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for i, item in enumerate(items):
        if i and shape.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(shape.request_rate))
        tasks.append(asyncio.create_task(one(item)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration

"""Runs an Engine on its own thread so that an event loop (a worker actor) stays responsive.

Every engine call goes through `submit`: a function applied to the engine
between two steps, on the loop's thread, so the engine needs no locks. Token
deltas of each step are collected and taken in batches by `take_deltas`, one
call for every request's new tokens (not one per token).

`heartbeat()` answers without waiting for the engine: how many times the loop has
turned (a step or a batch of commands ends a turn, an idle wait too) and whether its
thread still runs. A busy engine is alive; one whose loop stops turning is stuck.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pdserve.engine.kv.events import EventFanout, KVSnapshot
from pdserve.engine.outputs import EngineLoad, TokenDelta
from pdserve.engine.sequence import FinishReason

if TYPE_CHECKING:  # the cluster's config reads LoopConfig without loading the engine's modules
    from pdserve.engine.engine import Engine

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """The engine loop's own waits (the `loop` section of `pdserve serve`'s config).

    idle_wait_s: with nothing to run, the loop waits up to this long for a command before
        turning again (a command wakes it at once: no latency cost). Each turn counts in
        the heartbeat, so it must stay far below `health.stuck_after_s`.
    stop_timeout_s: bound on waiting, at shutdown, for the loop's thread to end its step.
    """

    idle_wait_s: float = 0.05
    stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("idle_wait_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LoopConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A worker's answer to a ping, made without waiting for its engine.

    num_turns: times the engine loop has gone round (after each step, each batch of
        commands and each idle wait): it stops moving only while one step or command runs.
    engine_alive: the engine's thread still runs.
    """

    worker_id: str
    num_turns: int
    engine_alive: bool



class EngineLoop:
    def __init__(self, engine: Engine, config: LoopConfig | None = None,
                 threads: Callable[[Engine], int] | None = None) -> None:
        """`threads`: the torch intra-op threads each step runs on (asked before every step, set
        on the loop's thread when it changes); None: the process's own."""
        self.engine = engine
        self.config = config or LoopConfig()
        self._threads = threads
        self.num_threads = 0  # what `threads` last set (0: never set)
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], object], Future]] = queue.SimpleQueue()
        self._deltas: list[TokenDelta] = []
        self._deltas_ready = threading.Condition()
        self._stopped = threading.Event()
        self.num_turns = 0  # written by the loop thread only; read by heartbeats
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run `fn(engine)` on the loop thread before the next step."""
        future: Future[T] = Future()
        if self._stopped.is_set():
            future.set_exception(RuntimeError("engine loop is stopped"))
        else:
            self._commands.put((fn, future))
        return future

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """`submit`, awaited from an event loop (a worker actor's)."""
        return await asyncio.wrap_future(self.submit(fn))

    def take_deltas(self, timeout_s: float) -> list[TokenDelta]:
        """Every delta since the last call; waits up to `timeout_s` for the first."""
        with self._deltas_ready:
            if not self._deltas:
                self._deltas_ready.wait(timeout_s)
            deltas, self._deltas = self._deltas, []
        return deltas

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the thread, then the engine's other tensor-parallel ranks (if any)."""
        self._stopped.set()
        self._thread.join(self.config.stop_timeout_s if timeout_s is None else timeout_s)
        self.engine.close()

    def _run_commands(self, block_s: float) -> None:
        try:
            fn, future = self._commands.get(timeout=block_s) if block_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._run_commands(0 if self.engine.has_unfinished else self.config.idle_wait_s)
            self.num_turns += 1
            if not self.engine.has_unfinished:
                continue
            try:
                self._set_threads()
                deltas = self.engine.step()
            except Exception:
                # A failed step must not kill the worker silently: abort what ran
                # in it (their callers see the finish) and keep serving.
                logger.exception("engine step failed; aborting its requests")
                deltas = self._abort_all()
            if deltas:
                with self._deltas_ready:
                    self._deltas.extend(deltas)
                    self._deltas_ready.notify_all()
        while not self._commands.empty():
            _, future = self._commands.get_nowait()
            future.set_exception(RuntimeError("engine loop is stopped"))

    def _set_threads(self) -> None:
        if self._threads is None:
            return
        n = self._threads(self.engine)
        if n != self.num_threads:  # torch's count is per thread (OpenMP's): set here, not by the caller
            import torch  # here: the cluster's config reads LoopConfig without loading torch

            torch.set_num_threads(n)
            self.num_threads = n

    def _abort_all(self) -> list[TokenDelta]:
        ids = [s.request_id for s in (*self.engine.scheduler.running, *self.engine.scheduler.waiting)]
        for rid in ids:
            self.engine.abort(rid)
        return [TokenDelta(rid, (), FinishReason.ABORT) for rid in ids]


def log_failure(done: Future[object]) -> None:
    """Done-callback for a command whose caller does not wait for it: its failure is a bug."""
    if not done.cancelled() and done.exception() is not None:
        logger.error("engine command failed", exc_info=done.exception())


@dataclass(frozen=True, slots=True)
class WorkerDescription:
    worker_id: str
    slot: str | None
    address: object | None  # a kv_transport PeerAddress (a decode worker's), None for others


class LoopWorker:
    """What both worker roles answer the cluster with about their engine (the Ray actor
    methods they share); each role adds its own way in."""

    def __init__(self, worker_id: str, engine: Engine, loop_config: LoopConfig | None = None, *,
                 slot: str | None = None, frontend_lease_s: float = 10.0,
                 threads: Callable[[Engine], int] | None = None) -> None:
        self.worker_id = worker_id
        self.slot = slot
        self.address: object | None = None  # where KV reaches it once started (a kv_transport PeerAddress)
        self.loop = EngineLoop(engine, loop_config, threads)
        # Every reader of the load (each frontend's KV index, the control plane's) sees every event.
        self.kv_readers = EventFanout(engine.config.cache.kv_events_max_pending, frontend_lease_s)

    async def load(self, reader: str = "") -> EngineLoad:
        """The engine's load, carrying its KV events since `reader`'s last call (each reader
        its own cursor, `EventFanout`; a report lost on the way leaves a gap in their
        numbers, which the router repairs with `kv_snapshot`). A call renews `reader`'s lease."""
        load, fresh = await self.loop.call(lambda e: (e.load(), e.kv_events.take()))
        return dataclasses.replace(load, kv_events=self.kv_readers.take(reader, fresh, time.monotonic()))

    async def describe(self) -> WorkerDescription:
        """Who this worker is, for a control plane that adopts it after a restart."""
        return WorkerDescription(self.worker_id, self.slot, self.address)

    async def kv_snapshot(self) -> KVSnapshot:
        """Every block the engine's prefix cache holds, and the event number it is as of."""
        return await self.loop.call(lambda e: e.kv_snapshot())

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (reported as a cleared event); False while a
        request holds blocks."""
        return await self.loop.call(lambda e: e.reset_prefix_cache())

    async def max_model_len(self) -> int:
        return self.loop.engine.max_model_len

    async def ping(self) -> Heartbeat:
        """Liveness and progress; never waits for the engine (the cluster calls it on
        the actor's own health thread, so it does not queue behind other calls either)."""
        return Heartbeat(self.worker_id, self.loop.num_turns, self.loop.alive)

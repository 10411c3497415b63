"""The decode worker, a plain class that the cluster runs as a Ray actor.

Two ways in: `reserve` + `admit` for a request whose KV a prefill worker sends
(disaggregated), `submit` for one prefilled here (colocated). Tokens leave in
batches through `poll`, one call for every request's new tokens of the calling frontend
(`outbox.py`); a frontend that stops polling for `WorkerConfig.frontend_lease_s` has its
requests aborted here, their seats and blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

import torch

from pdserve.decode_node.outbox import Outboxes
from pdserve.engine.config import EngineConfig, WorkerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv_handoff import NoCapacity
from pdserve.engine.loop import LoopConfig, LoopWorker, log_failure
from pdserve.engine.messages import KVTransferInfo, WorkerRequest, request_owner
from pdserve.engine.outputs import TokenDelta
from pdserve.kv_transport import PeerAddress, TransportConfig
from pdserve.kv_transport.shards import PoolShards

logger = logging.getLogger(__name__)


def cpu_threads(engine: Engine, wanted: int) -> Callable[[Engine], int] | None:
    """The torch threads of each step (`WorkerConfig.decode_cpu_threads`): `wanted`, at most the
    cores this process may run on, while no sequence receives its KV (no prefill worker computes
    for it); the process's own while one does. None where they stay the process's own: `wanted`
    0, a GPU, tensor parallelism."""
    if not wanted or engine.device.type != "cpu" or engine.config.parallel.tensor_parallel_size > 1:
        return None
    own = torch.get_num_threads()  # Ray's: one per CPU the actor asked for
    alone = max(own, min(wanted, len(os.sched_getaffinity(0))))
    return lambda e: own if e.scheduler.receiving else alone


class DecodeWorker(LoopWorker):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transport: TransportConfig | None,
                 worker_config: WorkerConfig | None = None, loop_config: LoopConfig | None = None, *,
                 slot: str | None = None) -> None:
        """`slot`: its place in the pool (`cluster.pools`), which names its KV disk tier; None: its id."""
        config = worker_config or WorkerConfig()
        engine = Engine(engine_config.for_worker(slot or worker_id))
        super().__init__(worker_id, engine, loop_config, slot=slot, frontend_lease_s=config.frontend_lease_s,
                         threads=cpu_threads(engine, config.decode_cpu_threads))
        self._transport = transport
        self._config = config
        self._receiver = None
        self._landing: dict[str, asyncio.Task] = {}
        self._outboxes = Outboxes(config.frontend_lease_s)
        self._tasks: list[asyncio.Task] = []  # the delta pump and the lease reaper, from the first call
        self.lease_aborts: dict[str, int] = {}  # requests aborted per frontend whose lease ran out

    async def start(self) -> PeerAddress | None:
        """Open the KV receiver (disaggregated mode); returns where senders reach it."""
        if self._transport is None:
            return None
        from pdserve.kv_transport.node import on_this_node
        from pdserve.kv_transport.ucx_receiver import UcxKVReceiver

        engine = self.loop.engine
        pool = PoolShards(engine.kv_shards, engine.kv_wire_layout.num_kv_heads)  # every rank's, under TP
        self._receiver = await UcxKVReceiver.start(pool, engine.kv_wire_layout, on_this_node(self._transport))
        self.address = self._receiver.address
        return self.address

    def _running(self) -> None:
        """The delta pump and the lease reaper run (started by the first call that needs them:
        they live on the actor's event loop)."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._reap())]

    async def _pump(self) -> None:
        while True:
            self._outboxes.put(await asyncio.to_thread(self.loop.take_deltas, self._config.delta_wait_s))

    async def _reap(self) -> None:
        """Abort the requests of frontends whose lease ran out (they died, or lost us)."""
        while True:
            await asyncio.sleep(min(1.0, self._config.frontend_lease_s / 4))
            for owner in self._outboxes.expired():
                self.kv_readers.forget(owner)
                ids = await self.loop.call(lambda e: [r for r in e.core.requests if request_owner(r) == owner])
                ids += [r for r in self._landing if request_owner(r) == owner and r not in ids]
                if not ids:  # only its aborted requests' last deltas were left for it
                    continue
                logger.warning("decode worker %s: frontend %r polled nothing for %g s (its lease): aborting its "
                               "%d request(s)", self.worker_id, owner, self._config.frontend_lease_s, len(ids))
                self.lease_aborts[owner] = self.lease_aborts.get(owner, 0) + len(ids)
                for rid in ids:
                    with contextlib.suppress(Exception):  # one failed abort must not keep the rest
                        await self.abort(rid)

    async def submit(self, req: WorkerRequest) -> None:
        """Prefill and decode here (colocated mode). Raises NoCapacity when `max_num_seqs`
        sequences run and `WorkerConfig.max_queued` more wait (every frontend's together: each
        frontend's own count is only its share)."""
        self._running()
        self._outboxes.seen(request_owner(req.request_id))
        await self.loop.call(lambda e: self._admit_queued(e, req))

    def _admit_queued(self, engine: Engine, req: WorkerRequest) -> None:
        bound = self._config.max_queued
        if bound:
            scheduler = engine.scheduler
            max_num_seqs = engine.config.scheduler.max_num_seqs
            if scheduler.num_seats_taken >= max_num_seqs + bound:  # running, receiving and waiting
                raise NoCapacity(f"{max_num_seqs} sequences run and {bound} wait (worker.max_queued)")
        engine.add_worker_request(req)

    async def reserve(self, req: WorkerRequest) -> None:
        """Take blocks for the prompt and start expecting its KV. Raises NoCapacity or ValueError
        (BadWorkerRequest: `req` failed its integrity check; the frontend validated it)."""
        if self._receiver is None:
            raise RuntimeError(f"decode worker {self.worker_id} has no KV receiver (colocated mode)")
        self._running()
        self._outboxes.seen(request_owner(req.request_id))
        block_ids = await self.loop.call(lambda e: e.reserve(req))
        self._landing[req.request_id] = asyncio.ensure_future(self._receiver.expect(req.request_id, block_ids))

    async def admit(self, request_id: str, first_token_id: int, grammar: str | None = None,
                    draft_state: bytes = b"") -> KVTransferInfo:
        """Wait (bounded by the transfer timeout) for the KV, then decode from `first_token_id`
        (`grammar`: the request's compiled grammar from its prefill worker, `PrefillOutput.grammar`;
        `draft_state`: where to start an MTP drafter from, `PrefillOutput.draft_state`).

        On a failed transfer the reserved blocks are freed and the TransferError raised.
        """
        landing = self._landing.pop(request_id)
        result = await landing
        if not result.ok:
            await self.loop.call(lambda e: e.abort(request_id))
            result.raise_for_error()
        # Not awaited: the engine admits it before its next step; waiting would add the rest of
        # the current step to the request's first token. A failure here is a bug, logged.
        self.loop.submit(lambda e: e.admit_prefilled(request_id, first_token_id, result.ready, grammar, draft_state)
                         ).add_done_callback(log_failure)
        return KVTransferInfo(result.num_bytes, result.transport, result.elapsed_s, result.direct)

    async def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is here (receiving, running, waiting) and free its blocks."""
        landing = self._landing.pop(request_id, None)
        if landing is not None and self._receiver is not None:
            self._receiver.cancel(request_id)
            await asyncio.wait([landing], timeout=self._config.abort_landing_wait_s)
        return await self.loop.call(lambda e: e.abort(request_id))

    async def poll(self, max_wait_s: float, frontend: str = "") -> list[TokenDelta]:
        """Every token delta of `frontend`'s requests since its last poll (waits up to
        `max_wait_s` for one); renews its lease."""
        self._running()
        return await self._outboxes.take(frontend, max_wait_s)

    async def expired_leases(self) -> dict[str, int]:
        """The frontends whose lease ran out here, and how many of their requests were aborted."""
        return dict(self.lease_aborts)

    async def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._receiver is not None:
            await self._receiver.close()
        self.loop.stop()

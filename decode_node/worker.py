"""The decode worker, a plain class that the cluster runs as a Ray actor.

Two ways in: `reserve` + `admit` for a request whose KV a prefill worker sends
(disaggregated), `submit` for one prefilled here (colocated). Tokens leave in
batches through `poll`, one call for every request's new tokens.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.engine.config import EngineConfig, WorkerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loop import LoopConfig, LoopWorker, log_failure
from pdserve.engine.messages import KVTransferInfo, WorkerRequest
from pdserve.engine.outputs import TokenDelta
from pdserve.kv_transport import PeerAddress, TransportConfig
from pdserve.kv_transport.shards import PoolShards

logger = logging.getLogger(__name__)


class DecodeWorker(LoopWorker):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transport: TransportConfig | None,
                 worker_config: WorkerConfig | None = None, loop_config: LoopConfig | None = None, *,
                 slot: str | None = None) -> None:
        """`slot`: its place in the pool (`cluster.pools`), which names its KV disk tier; None: its id."""
        super().__init__(worker_id, Engine(engine_config.for_worker(slot or worker_id)), loop_config)
        self._transport = transport
        self._config = worker_config or WorkerConfig()
        self._receiver = None
        self._landing: dict[str, asyncio.Task] = {}

    async def start(self) -> PeerAddress | None:
        """Open the KV receiver (disaggregated mode); returns where senders reach it."""
        if self._transport is None:
            return None
        from pdserve.kv_transport.node import on_this_node
        from pdserve.kv_transport.ucx_receiver import UcxKVReceiver

        engine = self.loop.engine
        pool = PoolShards(engine.kv_shards, engine.kv_wire_layout.num_kv_heads)  # every rank's, under TP
        self._receiver = await UcxKVReceiver.start(pool, engine.kv_wire_layout, on_this_node(self._transport))
        return self._receiver.address

    async def submit(self, req: WorkerRequest) -> None:
        """Prefill and decode here (colocated mode)."""
        await self.loop.call(lambda e: e.add_worker_request(req))

    async def reserve(self, req: WorkerRequest) -> None:
        """Take blocks for the prompt and start expecting its KV. Raises NoCapacity or ValueError
        (BadWorkerRequest: `req` failed its integrity check; the frontend validated it)."""
        if self._receiver is None:
            raise RuntimeError(f"decode worker {self.worker_id} has no KV receiver (colocated mode)")
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

    async def poll(self, max_wait_s: float) -> list[TokenDelta]:
        """Every token delta since the last poll (waits up to `max_wait_s` for one)."""
        return await asyncio.to_thread(self.loop.take_deltas, max_wait_s)

    async def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def shutdown(self) -> None:
        if self._receiver is not None:
            await self._receiver.close()
        self.loop.stop()

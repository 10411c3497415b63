"""The prefill worker, a plain class that the cluster runs as a Ray actor."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loop import LoopWorker
from engine.messages import KVTransferInfo, PrefillOutput, WorkerRequest
from engine.outputs import TokenDelta
from engine.sequence import FinishReason
from kv_transport import PeerAddress, TransportConfig

logger = logging.getLogger(__name__)

POLL_S = 0.5


class PrefillWorker(LoopWorker):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transport: TransportConfig,
                 prefill_timeout_s: float = 60.0) -> None:
        super().__init__(worker_id, Engine(engine_config))
        self._transport = transport
        self._prefill_timeout_s = prefill_timeout_s
        self._sender = None
        self._waiters: dict[str, asyncio.Future[TokenDelta]] = {}
        self._pump: asyncio.Task | None = None

    async def start(self) -> None:
        from kv_transport.ucx_sender import UcxKVSender

        engine = self.loop.engine
        self._sender = UcxKVSender(engine.pool.kv, engine.pool.layout, self._transport)
        self._pump = asyncio.create_task(self._pump_deltas())

    async def _pump_deltas(self) -> None:
        while True:
            for delta in await asyncio.to_thread(self.loop.take_deltas, POLL_S):
                waiter = self._waiters.pop(delta.request_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(delta)

    async def prefill(self, req: WorkerRequest, decode_peer: PeerAddress | None) -> PrefillOutput:
        """Compute the prompt's KV, sample the first token and, unless that ends the
        request, send the KV to `decode_peer`. The blocks are released (full ones
        stay in the prefix cache) whatever happens; a failed send raises its TransferError."""
        rid = req.request_id
        waiter: asyncio.Future[TokenDelta] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = waiter
        params = dataclasses.replace(req.params, max_tokens=1)
        if decode_peer is not None:
            # The decode worker's grant of its blocks (direct writes) travels while we compute.
            self._sender.prepare(rid, decode_peer)
        try:
            await self.loop.call(lambda e: e.add_request(list(req.prompt_token_ids), params, rid, hold_kv=True))
            first = await asyncio.wait_for(waiter, self._prefill_timeout_s)
        except BaseException:
            self._waiters.pop(rid, None)
            if decode_peer is not None:
                self._sender.forget(rid)
            await self.loop.call(lambda e: e.abort(rid))
            raise
        needs_decode = first.finish_reason is FinishReason.LENGTH and req.params.max_tokens > 1
        transfer = None
        try:
            if needs_decode and decode_peer is not None:
                block_ids = await self.loop.call(lambda e: e.held_block_ids(rid))
                result = await self._sender.send(rid, block_ids, decode_peer)
                result.raise_for_error()
                transfer = KVTransferInfo(result.num_bytes, result.transport, result.elapsed_s, result.direct)
        finally:
            if decode_peer is not None:
                self._sender.forget(rid)  # a no-op once sent
            await self.loop.call(lambda e: e.release(rid))
        first = dataclasses.replace(first, finish_reason=None if needs_decode else first.finish_reason)
        return PrefillOutput(first, needs_decode, transfer)

    async def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def shutdown(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        if self._sender is not None:
            await self._sender.close()
        self.loop.stop()

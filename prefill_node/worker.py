"""The prefill worker, a plain class that the cluster runs as a Ray actor.

A named frontend (`engine.messages.request_owner`) renews its lease here with `renew_lease`
(every quarter lease, a call that never waits for the engine) and with each prefill it
places; one silent for `WorkerConfig.frontend_lease_s` is taken for dead, and its prefills
still running here are cut: computing or sending, each stops the way a cancelled call does
(its send stopped, its request aborted, its blocks released), so a dead frontend's prompts
neither hold blocks nor take the engine's steps from live ones."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import torch

from pdserve.engine.config import EngineConfig, WorkerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loop import LoopConfig, LoopWorker, log_failure
from pdserve.engine.messages import KVTransferInfo, PrefillOutput, PrefillTimes, WorkerRequest, request_owner
from pdserve.engine.outputs import TokenDelta
from pdserve.engine.sequence import FinishReason, tokens_left
from pdserve.kv_transport import PeerAddress, TransferResult, TransportConfig
from pdserve.kv_transport.shards import PoolShards

logger = logging.getLogger(__name__)

class PrefillWorker(LoopWorker):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transport: TransportConfig,
                 worker_config: WorkerConfig | None = None, loop_config: LoopConfig | None = None, *,
                 slot: str | None = None) -> None:
        """`slot`: its place in the pool (`cluster.pools`), which names its KV disk tier; None: its id."""
        config = worker_config or WorkerConfig()
        super().__init__(worker_id, Engine(engine_config.for_worker(slot or worker_id)), loop_config, slot=slot,
                         frontend_lease_s=config.frontend_lease_s)
        self._transport = transport
        self._config = config
        self._sender = None
        self._waiters: dict[str, asyncio.Future[TokenDelta]] = {}
        self._peers: dict[str, PeerAddress] = {}  # where each request in prefill sends its KV
        self._sends: dict[str, asyncio.Task[TransferResult]] = {}  # started before the first token
        self._pump: asyncio.Task | None = None
        self._reaper: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lease_seen: dict[str, float] = {}  # each named frontend's last renewal (loop time)
        self._calls: dict[str, asyncio.Task] = {}  # each prefill call's task, to cut a dead frontend's
        self.lease_cuts: dict[str, int] = {}  # prefills cut per frontend whose lease ran out

    async def start(self) -> None:
        from pdserve.kv_transport.node import on_this_node
        from pdserve.kv_transport.ucx_sender import UcxKVSender

        engine = self.loop.engine
        pool = PoolShards(engine.kv_shards, engine.kv_wire_layout.num_kv_heads)  # every rank's, under TP
        self._sender = UcxKVSender(pool, engine.kv_wire_layout, on_this_node(self._transport))
        self._pump = asyncio.create_task(self._pump_deltas())
        self._reaper = asyncio.create_task(self._reap())
        self._loop = asyncio.get_running_loop()
        engine.set_kv_computed_callback(self._kv_computed)

    def _kv_computed(self, rid: str, block_ids: tuple[int, ...], event: torch.cuda.Event | None) -> None:
        """On the engine's thread, mid-step: hand over to the event loop and return."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
            self._loop.call_soon_threadsafe(self._send_early, rid, block_ids, event)

    def _send_early(self, rid: str, block_ids: tuple[int, ...], event: torch.cuda.Event | None) -> None:
        """The prompt's forward is queued: send its KV behind it, while the GPU computes and samples."""
        peer = self._peers.get(rid)
        if peer is not None and rid not in self._sends:
            self._sends[rid] = asyncio.ensure_future(self._sender.send(rid, block_ids, peer, after=event))

    async def _pump_deltas(self) -> None:
        while True:
            for delta in await asyncio.to_thread(self.loop.take_deltas, self._config.delta_wait_s):
                waiter = self._waiters.pop(delta.request_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(delta)

    async def prefill(self, req: WorkerRequest, decode_peer: PeerAddress | None) -> PrefillOutput:
        """Compute the prompt's KV, sample the first token and, unless that ends the
        request, send the KV to `decode_peer` (queued behind the prompt's forward, so that
        it travels while the first token is sampled). The blocks are released (full ones
        stay in the prefix cache) whatever happens; a failed send raises its TransferError."""
        called = time.perf_counter()
        rid = req.request_id
        owner = request_owner(rid)
        if owner:
            self._lease_seen[owner] = asyncio.get_running_loop().time()
            self._calls[rid] = asyncio.current_task()
        try:
            return await self._prefill(req, decode_peer, called)
        finally:
            self._calls.pop(rid, None)

    async def _prefill(self, req: WorkerRequest, decode_peer: PeerAddress | None, called: float) -> PrefillOutput:
        rid = req.request_id
        waiter: asyncio.Future[TokenDelta] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = waiter
        # Validated by the frontend: the engine checks its integrity only (WorkerRequest.check).
        share = dataclasses.replace(req, params=dataclasses.replace(req.params, max_tokens=1))
        if decode_peer is not None:
            # The decode worker's grant of its blocks (direct writes) travels while we compute.
            self._peers[rid] = decode_peer
            self._sender.prepare(rid, decode_peer)
        try:
            await self.loop.call(lambda e: e.add_worker_request(share, hold_kv=True))
            taken = time.perf_counter()
            # No bound of its own: a long prompt's steps take minutes on a CPU. The request's
            # deadline cancels this call, and the pool replaces an engine that stopped progressing.
            first = await waiter
            sampled = time.perf_counter()
        except BaseException:
            self._waiters.pop(rid, None)
            await self._stop_sending(rid)
            await self.loop.call(lambda e: e.abort(rid))
            raise
        # It ran with max_tokens 1: the first token ends the request only if its own params
        # or the context say so (a prompt one token short of the context needs no decode).
        num_prompt = len(req.prompt_token_ids)
        needs_decode = (first.finish_reason is FinishReason.LENGTH
                        and tokens_left(req.params, num_prompt, num_prompt + 1, self.loop.engine.max_model_len) > 0)
        transfer = None
        try:
            if needs_decode and decode_peer is not None:
                self._peers.pop(rid)
                # The ids come with the delta: a call into the engine would wait for its current step.
                # An early send stays in _sends until _stop_sending has seen it end.
                result = await (self._sends.get(rid) or self._sender.send(rid, first.held_block_ids, decode_peer))
                result.raise_for_error()
                transfer = KVTransferInfo(result.num_bytes, result.transport, result.elapsed_s, result.direct)
        finally:
            # The first token ended it (its early send is wasted), the send failed or we were cancelled.
            await self._stop_sending(rid)
            # Not awaited, for the same reason; the engine runs it before its next step.
            self.loop.submit(lambda e: e.release(rid)).add_done_callback(log_failure)
        sent = time.perf_counter()
        draft_state = first.held_draft_state if needs_decode else b""
        first = dataclasses.replace(first, finish_reason=None if needs_decode else first.finish_reason,
                                    held_block_ids=(), held_draft_state=b"")
        times = PrefillTimes(taken - called, sampled - taken, sent - sampled)
        # The grammar compiled for the first token goes to the decode worker, which need not compile it again.
        structured = req.params.structured
        grammar = self.loop.engine.structured.export(structured) if needs_decode and structured is not None else None
        return PrefillOutput(first, needs_decode, transfer, times, grammar, draft_state)

    async def _stop_sending(self, rid: str) -> None:
        """Whatever of `rid` is still being sent or prepared stops before its blocks go back."""
        self._peers.pop(rid, None)
        sending = self._sends.pop(rid, None)
        if sending is not None:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)  # a copy in flight finishes first
        self._sender.forget(rid)  # a no-op once sent

    async def renew_lease(self, frontend: str) -> None:
        """`frontend` is alive: its prefills here go on (never waits for the engine)."""
        self._lease_seen[frontend] = asyncio.get_running_loop().time()

    async def expired_leases(self) -> dict[str, int]:
        """The frontends whose lease ran out here, and how many of their prefills were cut."""
        return dict(self.lease_cuts)

    async def _reap(self) -> None:
        """Cut the prefills of frontends whose lease ran out (they died, or lost us)."""
        lease_s = self._config.frontend_lease_s
        while True:
            await asyncio.sleep(min(1.0, lease_s / 4))
            now = asyncio.get_running_loop().time()
            for owner in [o for o, seen in self._lease_seen.items() if now - seen > lease_s]:
                del self._lease_seen[owner]
                self.kv_readers.forget(owner)
                cut = [rid for rid in self._calls if request_owner(rid) == owner]
                if not cut:
                    continue
                logger.warning("prefill worker %s: frontend %r renewed no lease for %g s: cutting its %d prefill(s)",
                               self.worker_id, owner, lease_s, len(cut))
                self.lease_cuts[owner] = self.lease_cuts.get(owner, 0) + len(cut)
                for rid in cut:
                    self._calls.pop(rid).cancel()

    async def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def shutdown(self) -> None:
        for task in (self._pump, self._reaper):
            if task is not None:
                task.cancel()
        if self._sender is not None:
            await self._sender.close()
        self.loop.stop()

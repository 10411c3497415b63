"""The engine's side of disaggregation: KV handed from a prefill worker to a decode worker.

A prefill worker's request may hold its KV: when it finishes, its blocks stay (the
scheduler's "held") until `release`, and the step that computes the last of its prompt
reports the blocks (`KVComputed`) so that the send starts while the GPU still samples.
A decode worker reserves a seat and blocks for a prompt whose KV another worker writes
(the scheduler's "receiving"), lands it (its copy maybe still running) and runs it once
the copy has completed. The sequences' states are the scheduler's; this class decides
when they move and bounds every wait on a copy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import FinishReason, Sequence

logger = logging.getLogger(__name__)

# (request_id, block_ids, event): a hold_kv request's prompt KV is computed, or will be once
# the CUDA event completes (None: now). See Engine.set_kv_computed_callback.
KVComputed = Callable[[str, tuple[int, ...], "torch.cuda.Event | None"], None]


class NoCapacity(RuntimeError):
    """The pool cannot hold a request right now (retry later or elsewhere)."""


class KVHandoff:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, kv: KVCache, device: torch.device) -> None:
        self.config = config  # read at each use: kv_copy_wait_s bounds every wait on a copy
        self._scheduler = scheduler
        self._kv = kv
        self._device = device
        self._hold_kv: set[str] = set()  # requests whose blocks stay once they finish, until release()
        self._on_kv_computed: KVComputed | None = None

    # Prefill role: KV held for sending -----------------------------------

    def hold_when_finished(self, request_id: str) -> None:
        self._hold_kv.add(request_id)

    def set_kv_computed_callback(self, callback: KVComputed | None) -> None:
        self._on_kv_computed = callback

    def report_kv_computed(self, batch: ScheduledBatch) -> None:
        """Hand the callback the blocks of each held request whose prompt's last chunk this
        (just queued) step computes, with an event that completes once their KV is there."""
        if self._on_kv_computed is None:
            return
        done = [seq for seq, num_new in zip(batch.seqs, batch.num_new_tokens)
                if seq.request_id in self._hold_kv
                and seq.num_computed_tokens < seq.num_prompt_tokens <= seq.num_computed_tokens + num_new]
        if not done:
            return
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for seq in done:
            self._on_kv_computed(seq.request_id, tuple(seq.block_ids), event)

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks (full ones stay in the prefix cache)."""
        return self._scheduler.release(request_id)

    # Decode role: waiting for remote KV, then landing ---------------------

    def check_seat(self, priority: int = 0, tenant: str = "", tenant_weight: float = 1.0) -> None:
        """NoCapacity unless a sequence of `priority` and `tenant` may take a seat
        (`Scheduler.can_seat`: a free one, or under the priority policy one that a sequence of
        lower priority, or of a tenant over its share, gives up)."""
        if not self._scheduler.can_seat(priority, tenant, tenant_weight):
            raise NoCapacity(f"all {self.config.scheduler.max_num_seqs} sequence slots are taken"
                             + (" by requests of this priority or a higher one, this tenant's share among them"
                                if self.config.scheduler.policy == "priority" else ""))

    def reserve(self, seq: Sequence) -> list[int]:
        """Blocks for `seq`'s tokens, which another worker writes (NoCapacity when short): their
        ids in position order. The sequence waits, receiving, until `land`."""
        bm = self._kv.block_manager
        if bm.num_blocks_needed(seq, seq.num_tokens) > self._scheduler.num_reservable_blocks \
                or not bm.allocate(seq, seq.num_tokens):
            raise NoCapacity(f"not enough free KV blocks for {seq.num_tokens} tokens")
        self._kv.offload_evicted(wait=True)  # another worker writes these blocks, outside our stream
        self._scheduler.receive(seq)
        return list(seq.block_ids)

    def land(self, seq: Sequence, first_token_id: int, kv_ready: torch.cuda.Event | None) -> None:
        self._scheduler.land(seq, first_token_id, kv_ready)

    def admit_landed(self) -> None:
        """Run the sequences whose KV has landed; with nothing else to run, wait for one
        (bounded) rather than spin."""
        if not self._scheduler.has_unfinished:
            _wait_for_copy(self._scheduler.landing[0], self.config.cache.kv_copy_wait_s)
        self._scheduler.admit_landed()

    # Either role, as a sequence finishes ---------------------------------

    def finishing(self, seq: Sequence, reason: FinishReason) -> bool:
        """`seq` finishes for `reason`: once a copy into its blocks is done (bounded), whether
        it holds them (a held request not aborted)."""
        copy = self._scheduler.pending_copy(seq)
        wait_s = self.config.cache.kv_copy_wait_s
        if copy is not None and not _wait_for_copy(copy, wait_s):  # free the blocks after the copy into them
            logger.warning("KV copy into request %s's blocks not done after %.0f s: freeing them anyway",
                           seq.request_id, wait_s)
        hold = seq.request_id in self._hold_kv and reason is not FinishReason.ABORT
        self._hold_kv.discard(seq.request_id)
        return hold


def _wait_for_copy(event: torch.cuda.Event, timeout_s: float) -> bool:
    """`event.synchronize()`, bounded by `timeout_s` (CUDA offers no timeout, so a helper
    thread waits); whether the copy completed."""
    if event.query():
        return True
    waiter = threading.Thread(target=event.synchronize, name="kv-copy-wait", daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    return not waiter.is_alive()

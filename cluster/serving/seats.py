"""The line for decode seats: who runs where, and who waits.

A disaggregated request waits here, first come first served, for a decode worker with a free
running seat and the free KV blocks to reserve its prompt (`WorkerState.kv_headroom`: its last
load, less the reservations that may not show in it yet) or, where the decode engines preempt
by priority, a running seat that a request of lower priority gives up there; beyond a bounded queue
(`max_queued()`) it is refused at once, and the service admits no more than `capacity()` (seats
plus the queue). A colocated request takes its seat at once and queues in its worker's
scheduler; a prefill worker's requests are seated there while it computes them. `SeatLine` is
the one writer of a worker's `inflight` and `claims` (the routers read them). A `Seat` is one
request attempt's hold on its place, from its taking to its freeing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from dataclasses import dataclass

from pdserve.cluster.serving.errors import Overloaded, WorkerUnavailable
from pdserve.cluster.serving.pools import Pool, Worker
from pdserve.cluster.serving.router import KVClaim, PromptBlocks, RoutingPolicy
from pdserve.cluster.settings.config import CoordinatorConfig
from pdserve.cluster.settings.tenants import DEFAULT_TENANT, Tenant
from pdserve.engine.tenant_share import under_share


def may_wait(pool: Pool, migrated: bool, give_up: float) -> bool:
    """Whether a request finding no serving worker in `pool` waits on: until `give_up`
    (`config.migration_wait_s` after it began), while a lost worker is being replaced, or
    in any case for a `migrated` request (its lost worker's replacement may not have
    begun yet). With nothing being replaced a new request is refused at once."""
    return (migrated or pool.replacing > 0) and asyncio.get_running_loop().time() < give_up


class SeatLine:
    def __init__(self, decode: Pool, policy: RoutingPolicy, block_size: int, seats_per_worker: int,
                 max_waiting_per_worker: int, config: CoordinatorConfig, preempt: bool = False) -> None:
        self.decode = decode
        self.policy = policy  # which of the workers that fit takes the head of the line
        self.block_size = block_size
        self.seats_per_worker = seats_per_worker  # the decode engines' max_num_seqs
        self.max_waiting_per_worker = max_waiting_per_worker
        self.config = config
        self.preempt = preempt  # the decode engines' policy is "priority": `Scheduler.can_seat`
        # Requests waiting for a decode seat, in order: the head (`_head`) takes the next one that fits.
        self._line: collections.deque[asyncio.Event] = collections.deque()
        self._priority: dict[asyncio.Event, int] = {}  # each waiting request's (lower first)
        self._tenant: dict[asyncio.Event, Tenant] = {}  # each waiting request's
        self._retried: set[asyncio.Event] = set()  # waiting retried requests: they keep their place
        self._seated: collections.Counter[str] = collections.Counter()  # decode seats by tenant name
        # Decode seats given to each tenant since it last had none and none waiting: of tenants
        # holding as many seats for their weights, the one given fewer goes first (`_head`).
        self._granted: collections.Counter[str] = collections.Counter()

    def capacity(self) -> int:
        """Requests the pools take at once: per serving decode worker (healthy, not draining),
        its running seats and a bounded queue of requests waiting for one."""
        return len(self.decode.serving()) * (self.seats_per_worker + self.max_waiting_per_worker)

    def max_queued(self) -> int:
        """Requests that may wait for a decode seat (or the KV blocks to use one) at once: a
        queue per serving decode worker and per one being replaced (requests that find no
        serving worker wait for its replacement, `may_wait`)."""
        return (len(self.decode.serving()) + self.decode.replacing) * self.max_waiting_per_worker

    @property
    def num_queued(self) -> int:
        """Requests waiting for a decode seat now."""
        return len(self._line)

    def kv_need(self, num_prompt_tokens: int) -> int:
        """KV blocks a decode worker reserves for a prompt (the tokens it generates take
        blocks as they come; the engine preempts where they run out, as vLLM's does)."""
        return -(-num_prompt_tokens // self.block_size)

    def fits(self, worker: Worker, need: int, priority: int = 0, tenant: Tenant = DEFAULT_TENANT) -> bool:
        """Whether `worker` has a running seat for a request of `priority` and `need` KV blocks
        to reserve. A worker whose load is not known yet is tried: its engine's reservation
        decides. With `preempt` a seat held by a request of lower priority, or at its priority by
        a tenant holding more than `tenant`'s share, counts as free: its engine preempts that one
        (`Scheduler.can_seat`, the same rule), which waits there holding its seat. At most
        `over_seats()` are seated so beyond the seats."""
        state = worker.state
        headroom = state.kv_headroom()
        if headroom is not None and need > headroom:
            return False
        if state.inflight < self.seats_per_worker:
            return True
        if not self.preempt or state.inflight >= self.seats_per_worker + self.over_seats():
            return False
        claims = state.claims.values()
        if sum(c.priority <= priority for c in claims) < self.seats_per_worker:
            return True
        if any(c.priority > priority for c in claims):
            return False
        return under_share([(c.tenant, c.tenant_weight) for c in claims], tenant.name, tenant.weight)

    def over_seats(self) -> int:
        """Requests a decode worker seats beyond its running seats, in the places of preempted
        ones (`fits`): fewer than its queue, so that a full server always holds a request that
        has no token yet, which a higher-priority arrival may displace (`cluster/api/admission.py`),
        and no more than the engine's own bound (`max_num_seqs`). A queue of one still gives one
        (else no request would ever take a lower one's seat there): a full server then refuses a
        higher-priority arrival, as one without priorities does, instead of displacing."""
        if not self.preempt or self.max_waiting_per_worker < 1:
            return 0
        return min(self.seats_per_worker, max(1, self.max_waiting_per_worker - 1))

    async def take(self, request_id: str, need: int, front: bool, migrated: bool, give_up: float,
                   prompt: PromptBlocks, priority: int = 0, tenant: Tenant = DEFAULT_TENANT) -> Worker:
        """A decode worker with a free running seat and `need` KV blocks to reserve (`fits`),
        seated there with its claim on the blocks; of those that fit, the policy picks for
        `prompt` (prefix-aware: the one holding its prefix wins a close call). Requests wait
        for one in priority order (lower first), arrival order within one priority (`front`:
        ahead of all of its priority, a retried one), except that of the requests of the head's
        priority the one whose `tenant` holds the fewest decode seats for its weight goes
        first (`_head`: a weighted fair share); one that would wait
        behind `max_queued()` others (`_ahead`: those that go first by that rule, not those that
        came first) is refused at once (Overloaded). The head re-checks
        whenever a seat or blocks are freed, the load is read, or `config.seat_recheck_s`
        passed (a replaced worker's seats). A draining worker takes no one. With no serving
        decode worker, waits while
        `may_wait`, then WorkerUnavailable."""
        me = asyncio.Event()
        self._priority[me], self._tenant[me] = priority, tenant
        if front:
            self._retried.add(me)
        line, rank = self._line, self._priority
        if front:
            at = next((i for i, e in enumerate(line) if rank[e] >= priority), len(line))
        else:
            at = next((i for i in range(len(line), 0, -1) if rank[line[i - 1]] <= priority), 0)
        line.insert(at, me)
        waited = front  # a retried request is never refused
        try:
            while True:
                if self._head() is me:
                    serving = self.decode.serving()
                    if not serving and not may_wait(self.decode, migrated, give_up):
                        raise WorkerUnavailable("no healthy decode worker")
                    free = [w for w in serving if self.fits(w, need, priority, tenant)]
                    if free:
                        state = self.policy.choose([w.state for w in free], prompt)
                        worker = next(w for w in free if w.state is state)
                        self.seat(worker, request_id, need, priority, tenant)
                        return worker
                # Refused when `max_queued()` others are ahead: one of higher priority goes ahead of
                # the lower ones instead (the frontend refuses those: cluster/api/admission.py).
                if not waited and self._ahead(me) >= self.max_queued():
                    raise Overloaded(f"server is at its capacity: {self.max_queued()} requests are queued for a "
                                     f"decode seat or the KV blocks of one")
                waited = True
                me.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), self.config.seat_recheck_s)
        finally:
            self._line.remove(me)
            self._forget_if_idle(self._tenant[me].name)
            del self._priority[me], self._tenant[me]
            self._retried.discard(me)
            self.wake()

    def seat(self, worker: Worker, request_id: str, need: int | None = None, priority: int = 0,
             tenant: Tenant = DEFAULT_TENANT) -> None:
        """`request_id` runs on `worker`, a worker of either pool (chosen with no await since:
        the seat is its own), with a claim on `need` KV blocks (a decode reservation) until the
        worker's load shows it."""
        worker.state.inflight += 1
        if need is not None:
            worker.state.claims[request_id] = KVClaim(need, priority=priority, tenant=tenant.name,
                                                      tenant_weight=tenant.weight)
            self._seated[tenant.name] += 1
            self._granted[tenant.name] += 1

    def reserved(self, worker: Worker, request_id: str) -> None:
        """`worker`'s engine holds `request_id`'s blocks: its loads asked for from now on show them."""
        claim = worker.state.claims.get(request_id)
        if claim is not None:
            claim.reserved_at = asyncio.get_running_loop().time()

    def free(self, worker: Worker, request_id: str) -> None:
        """`request_id`'s seat and claim on `worker` are free (the worker has let them go); the
        head of the line looks again."""
        worker.state.inflight -= 1
        claim = worker.state.claims.pop(request_id, None)
        if claim is not None:
            self._seated[claim.tenant] -= 1
            self._forget_if_idle(claim.tenant)
        self.wake()

    def wake(self) -> None:
        """Have the request at the head of the queue look for a seat again."""
        if self._line:
            self._head().set()

    def _ahead(self, me: asyncio.Event) -> int:
        """The requests in line that go before `me` (`_head`'s rule): those of a higher priority,
        retried ones, and those of its own whose tenants hold no more seats for their weights than
        its tenant. A tenant under its share is not refused for the backlog of one over it."""
        mine = self._load(me)
        ahead = 0
        for e in self._line:
            if e is me:
                return ahead
            ahead += self._priority[e] < self._priority[me] or e in self._retried or self._load(e) <= mine
        return ahead

    def _load(self, e: asyncio.Event) -> tuple[float, float]:
        """A waiting request's tenant's seats for its weight, then the seats it was given so."""
        tenant = self._tenant[e]
        return self._seated[tenant.name] / tenant.weight, self._granted[tenant.name] / tenant.weight

    def _forget_if_idle(self, name: str) -> None:
        """A tenant with no seat and no request in line starts afresh (`_granted`)."""
        if not self._seated[name] and not any(self._tenant[e].name == name for e in self._line):
            self._granted.pop(name, None)

    def _head(self) -> asyncio.Event:
        """The request that takes the next seat: the first in line (a retried one keeps its
        place) or, of those of the first one's priority, the first whose tenant holds the
        fewest decode seats for its weight (of equals, the one given fewer since it had none)."""
        first = self._line[0]
        if first in self._retried:
            return first
        same = itertools.takewhile(lambda e: self._priority[e] == self._priority[first], self._line)
        return min(same, key=self._load)


@dataclass(eq=False, slots=True)
class Seat:
    """A request attempt's seat on one worker (with a decode reservation, its claim on the
    worker's KV blocks), held by that attempt alone from its taking to its freeing."""

    worker: Worker
    request_id: str
    _line: SeatLine
    _freed: bool = False

    def reserved(self) -> None:
        """The worker's engine holds the request's blocks (`SeatLine.reserved`)."""
        self._line.reserved(self.worker, self.request_id)

    def free(self) -> None:
        """The worker has let the request go: its seat and claim are free (once)."""
        if not self._freed:
            self._freed = True
            self._line.free(self.worker, self.request_id)

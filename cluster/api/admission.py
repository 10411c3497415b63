"""Who goes first at the frontend when the server is full: request priorities (vLLM's
`priority`, lower first; `SamplingParams.priority`) and the tenants' weighted fair share
(`cluster/settings/tenants.py`).

The frontend admits requests up to the pools' capacity (running seats plus bounded queues).
A request admitted that has no token yet is queued, wherever it waits (a decode seat, a
worker's scheduler). When the server is full, an arrival takes the place of a queued request
that it outranks, which is refused (RESOURCE_EXHAUSTED, with the retry hint, as a full server
refuses) and aborted in the pools; an arrival that outranks none is refused itself. One request
outranks another when its priority is higher, or when at the same priority its tenant is
within its share of the capacity (capacity x its weight / the weights of the tenants with
requests admitted, max-min: what a tenant asking for less leaves goes to the others,
`fair_shares`) and the other's tenant is over its own. The victim: the lowest priority,
then the tenant most over its share, then the latest arrival. Inside the pools the seats and
the engines' schedulers order the queued ones by priority too (`SeatLine`, `engine/scheduler.py`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from pdserve.cluster.settings.tenants import DEFAULT_TENANT, Tenant


@dataclass(eq=False, slots=True)
class Queued:
    """One admitted request: its priority, its tenant and the task that runs it."""

    priority: int
    tenant: Tenant
    task: asyncio.Task | None
    started: bool = False  # its first token came: no longer queued
    displaced: bool = False  # refused to make room for an arrival that outranks it


class AdmissionQueue:
    """The frontend's queued requests, in arrival order, and each tenant's admitted ones."""

    def __init__(self) -> None:
        self._queued: list[Queued] = []
        self._admitted: Counter[str] = Counter()  # per tenant: admitted, not ended, not displaced
        self._weights: dict[str, float] = {}

    def add(self, priority: int, tenant: Tenant = DEFAULT_TENANT) -> Queued:
        """A request admitted now, run by the current task."""
        queued = Queued(priority, tenant, asyncio.current_task())
        self._queued.append(queued)
        self._admitted[tenant.name] += 1
        self._weights[tenant.name] = tenant.weight
        return queued

    def started(self, queued: Queued) -> None:
        """`queued` has its first token: nobody displaces it any more."""
        if not queued.started:
            queued.started = True
            if not queued.displaced:
                self._queued.remove(queued)

    def ended(self, queued: Queued) -> None:
        """`queued` is over (finished, failed, cancelled or displaced)."""
        self.started(queued)
        if not queued.displaced:
            self._leave(queued.tenant.name)

    def displace(self, priority: int, num_requests: int, tenant: Tenant = DEFAULT_TENANT,
                 capacity: int = 0) -> int | None:
        """Make room for `num_requests` of `priority` for `tenant` on a server of `capacity`:
        refuse as many queued requests they outrank, cancelling their tasks (the frontend
        turns that into RESOURCE_EXHAUSTED). Returns how many, or None (and refuses nobody)
        when too few are outranked."""
        over = self._over_share(tenant, num_requests, capacity)
        outranked = [q for q in reversed(self._queued)
                     if q.priority > priority or (q.priority == priority and q.tenant.name in over)]
        if len(outranked) < num_requests:
            return None
        outranked.sort(key=lambda q: (-q.priority, -self._load(q.tenant.name)))  # stable: the latest first
        for queued in outranked[:num_requests]:
            queued.displaced = True
            self._queued.remove(queued)
            self._leave(queued.tenant.name)
            if queued.task is not None:
                queued.task.cancel()
        return num_requests

    def _over_share(self, tenant: Tenant, num_requests: int, capacity: int) -> set[str]:
        """The other tenants over their shares, if `tenant` with `num_requests` more is within its own."""
        weights = {name: self._weights[name] for name in self._admitted} | {tenant.name: tenant.weight}
        demand = dict(self._admitted)
        demand[tenant.name] = demand.get(tenant.name, 0) + num_requests
        shares = fair_shares(capacity, demand, weights)
        if len(weights) < 2 or demand[tenant.name] > shares[tenant.name]:
            return set()
        return {name for name in self._admitted if name != tenant.name and self._admitted[name] > shares[name]}

    def _load(self, name: str) -> float:
        return self._admitted[name] / self._weights[name]

    def _leave(self, name: str) -> None:
        self._admitted[name] -= 1
        if not self._admitted[name]:
            del self._admitted[name]


def fair_shares(capacity: float, demand: dict[str, int], weights: dict[str, float]) -> dict[str, float]:
    """Each tenant's weighted max-min fair share of `capacity`: a tenant that asks for less
    than its weight's part gets what it asks, and what it leaves is shared by the others by
    their weights (so a tenant with one request in does not hold a third of the places while
    two others flood)."""
    shares: dict[str, float] = {}
    left, open_ = float(capacity), set(demand)
    while open_:
        total = sum(weights[t] for t in open_)
        small = {t for t in open_ if demand[t] <= left * weights[t] / total}
        if not small:
            shares.update({t: left * weights[t] / total for t in open_})
            break
        for t in small:
            shares[t] = float(demand[t])
            left -= demand[t]
        open_ -= small
    return shares

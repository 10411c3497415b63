"""The tenants' weighted fair share of an engine's seats: pure functions of the scheduler's
queues, no state of their own.

A request's tenant and weight travel in its `SamplingParams` (`tenant`, `tenant_weight`), set
by whichever frontend took it. Each frontend shares its own line of waiting requests fairly
(`cluster/serving/seats.py`), but with several frontends each sees only its own requests: a
frontend that floods one tenant's requests would take every seat a worker frees. The engines
see every frontend's requests, so the share that holds across frontends is decided here:

- Admission (`next_waiting`): among the waiting sequences of the head's priority, the first of
  the tenant that runs the fewest sequences for its weight goes first (arrival order within a
  tenant; with one tenant, plain arrival order).
- Seats under the priority policy (`Scheduler.can_seat`, `victim`): a full decode worker seats
  a received sequence whose tenant runs fewer than its share among the sequences of its
  priority or a higher one, in the place of one of the tenant that runs the most for its
  weight (the youngest of it, of the lowest priority), which the next step preempts.

A running sequence holds its seat until it finishes: the share is of seats, and so of the
output tokens steps give out (one a step for each running sequence) while tenants have backlog.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from pdserve.engine.sequence import Sequence


def load(seqs: Iterable[Sequence]) -> Counter[str]:
    """Sequences by tenant name."""
    return Counter(s.params.tenant for s in seqs)


def next_waiting(waiting: Seq[Sequence], running: Counter[str], waiting_tenants: Counter[str]) -> int:
    """The index in `waiting` (kept in priority order) of the sequence to admit next: of those
    of the head's priority, the first of the tenant with the fewest `running` for its weight.
    `waiting_tenants` (waiting sequences by tenant) ends the scan once every tenant was seen:
    with one tenant waiting, the head at once, however long the queue."""
    head = waiting[0]
    best, best_share = 0, running[head.params.tenant] / head.params.tenant_weight
    seen = {head.params.tenant}
    for i in range(1, len(waiting)):
        params = waiting[i].params
        if best_share == 0 or len(seen) >= len(waiting_tenants) or params.priority != head.params.priority:
            break
        if params.tenant in seen:
            continue
        seen.add(params.tenant)
        share = running[params.tenant] / params.tenant_weight
        if share < best_share:
            best, best_share = i, share
    return best


def under_share(seated: Iterable[tuple[str, float]], tenant: str, weight: float) -> bool:
    """Whether one more seat for `tenant` (of `weight`) leaves it holding, for its weight, fewer
    than the tenant that holds the most of `seated` ((tenant, weight) pairs) for its own: that
    one's seat is the one given up (`victim`), never the newcomer's. The frontends' seat line
    follows the same rule (`cluster/serving/seats.py`)."""
    counts, weights = Counter[str](), {}
    for name, w in seated:
        counts[name] += 1
        weights[name] = w
    most = max((n / weights[t] for t, n in counts.items() if t != tenant), default=0.0)
    return (counts[tenant] + 1) / weight < most


def victim(running: Seq[Sequence]) -> Sequence:
    """The running sequence a preemption takes under the priority policy: of the lowest
    priority, of the tenant running the most of those for its weight, the youngest."""
    lowest = max(s.params.priority for s in running)
    mine = [s for s in running if s.params.priority == lowest]
    counts = load(mine)
    return max(reversed(mine), key=lambda s: counts[s.params.tenant] / s.params.tenant_weight)

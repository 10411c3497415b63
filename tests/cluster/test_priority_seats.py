"""A seat on a full decode worker (issue 56), on a real disaggregated server whose engines preempt
by priority, with a tenants file of two tenants of equal weight. With every decode seat held by
a long generation, an arrival takes the seat of one of them (the seat line seats it over the
worker's running cap, the decode engine preempts a running sequence, which waits there and goes
on later) when it has a higher priority, or, at the same priority, when its tenant holds fewer
seats than the one holding them all (the engines' share, which also holds across frontends:
`engine/tenant_share.py`). So its first token comes before any of the long ones finishes;
nothing is lost: every request finishes, with the tokens it would have written undisturbed."""

from __future__ import annotations

import threading

import pytest

from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import pools_are_full, wait_until

pytestmark = pytest.mark.timeout(600)

SEATS = 2
LOW = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, priority=1)
HIGH = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, priority=-1)
SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, priority=1)
KEYS = {"a": "priority-seats-key-a", "b": "priority-seats-key-b"}


@pytest.fixture(scope="module")
def srv(start, tmp_path_factory):
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text("tenants:\n" + "".join(f"  - {{name: {t}, api_keys: [{k}]}}\n" for t, k in KEYS.items()))
    return start(pools={"mode": "disaggregated"}, admission={"max_waiting_per_worker": 2},
                 server={"tenants_file": str(tenants)},
                 engine={"scheduler": {"max_num_seqs": SEATS, "policy": "priority"}})


def _busy_seats_then(srv, engine, last: SamplingParams, last_tenant: str) -> None:
    """Tenant a's SEATS long generations take every seat; then one request of `last_tenant` with
    `last`: its first token before any long one finishes, every output as undisturbed."""
    prompts = [[100 + i, 7, 8, 9, 10] for i in range(SEATS)] + [[300, 11, 12]]
    params = [LOW] * SEATS + [last]
    want = [o.token_ids for o in engine.generate(prompts, params)]
    events: list[tuple[str, int]] = []  # ("first" | "done", request index), in the order they came
    lock = threading.Lock()
    tokens: dict[int, list[int]] = {}
    started = [threading.Event() for _ in prompts]

    def run(i: int, tenant: str) -> None:
        tokens[i] = []
        with Client(srv.target, ClientCredentials(api_key=KEYS[tenant])) as client:
            for resp in client.generate(prompts[i], params[i], timeout_s=300):
                if resp.token_ids and not tokens[i]:
                    with lock:
                        events.append(("first", i))
                    started[i].set()
                tokens[i] += resp.token_ids
                if resp.finish_reason:
                    with lock:
                        events.append(("done", i))

    threads = [threading.Thread(target=run, args=(i, "a")) for i in range(SEATS)]
    for t in threads:
        t.start()
    for i in range(SEATS):
        assert started[i].wait(120), f"long request {i} never started"
    arrival = threading.Thread(target=run, args=(SEATS, last_tenant))
    arrival.start()
    for t in (*threads, arrival):
        t.join(300)
    assert not any(t.is_alive() for t in (*threads, arrival))
    done = [i for kind, i in events if kind == "done"]
    assert sorted(done) == list(range(SEATS + 1)), f"not every request finished: {events}"
    first_long_done = min(events.index(("done", i)) for i in range(SEATS))
    assert events.index(("first", SEATS)) < first_long_done, f"the arrival waited for a seat: {events}"
    assert [tokens[i] for i in range(SEATS + 1)] == want, "a preempted request did not go on as it would have"
    wait_until(lambda: pools_are_full(srv.target, ClientCredentials(api_key=KEYS["a"])), 30, "every block to be free")


def test_a_high_priority_request_takes_a_busy_seat_and_nothing_is_lost(srv, engine):
    _busy_seats_then(srv, engine, HIGH, "a")


def test_a_tenant_holding_no_seat_takes_one_of_the_tenant_holding_them_all(srv, engine):
    _busy_seats_then(srv, engine, SHORT, "b")

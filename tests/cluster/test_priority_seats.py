"""A higher-priority request on a full decode worker (issue 56), on a real disaggregated server:
with every decode seat held by a long low-priority generation, a high-priority arrival takes
the seat of one of them (the seat line seats it over the worker's running cap, the decode
engine preempts the lowest-priority running sequence, which waits there and goes on later), so
its first token comes before any low-priority request finishes; nothing is lost: every request
finishes, with the tokens it would have written undisturbed."""

from __future__ import annotations

import threading

import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import pools_are_full, wait_until

pytestmark = pytest.mark.timeout(600)

SEATS = 2
LOW = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, priority=1)
HIGH = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, priority=-1)


@pytest.fixture(scope="module")
def srv(start):
    return start(pools={"mode": "disaggregated"}, admission={"max_waiting_per_worker": 2},
                 engine={"scheduler": {"max_num_seqs": SEATS, "policy": "priority"}})


def test_a_high_priority_request_takes_a_busy_seat_and_nothing_is_lost(srv, engine):
    prompts = [[100 + i, 7, 8, 9, 10] for i in range(SEATS)] + [[300, 11, 12]]
    want = [o.token_ids for o in engine.generate(prompts, [LOW] * SEATS + [HIGH])]
    events: list[tuple[str, int]] = []  # ("first" | "done", request index), in the order they came
    lock = threading.Lock()
    tokens: dict[int, list[int]] = {}
    started = [threading.Event() for _ in prompts]

    def run(i: int, params: SamplingParams) -> None:
        tokens[i] = []
        with Client(srv.target) as client:
            for resp in client.generate(prompts[i], params, timeout_s=300):
                if resp.token_ids and not tokens[i]:
                    with lock:
                        events.append(("first", i))
                    started[i].set()
                tokens[i] += resp.token_ids
                if resp.finish_reason:
                    with lock:
                        events.append(("done", i))

    threads = [threading.Thread(target=run, args=(i, LOW)) for i in range(SEATS)]
    for t in threads:
        t.start()
    for i in range(SEATS):
        assert started[i].wait(120), f"low-priority request {i} never started"
    high = threading.Thread(target=run, args=(SEATS, HIGH))
    high.start()
    for t in (*threads, high):
        t.join(300)
    assert not any(t.is_alive() for t in (*threads, high))
    done = [i for kind, i in events if kind == "done"]
    assert sorted(done) == list(range(SEATS + 1)), f"not every request finished: {events}"
    first_low_done = min(events.index(("done", i)) for i in range(SEATS))
    assert events.index(("first", SEATS)) < first_low_done, f"the high-priority request waited: {events}"
    assert [tokens[i] for i in range(SEATS + 1)] == want, "a preempted request did not go on as it would have"
    wait_until(lambda: pools_are_full(srv.target), 30, "every block to be free")

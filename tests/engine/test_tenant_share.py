"""The tenants' fair share in the engine's scheduler (`engine/tenant_share.py`): requests that
two frontends sent, each flooding one tenant's, meet in one engine, whose seats (and so the
output tokens its steps give out) are shared by the tenants' weights while both have backlog;
a full decode worker under the priority policy seats a received request of a tenant under its
share in the place of one of a tenant over it."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import FinishReason, Sequence

BS = 4


def make(max_seqs: int, policy: str = "fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_seqs, policy=policy),
                     BlockManager(512, BS), 4096)


def request(rid: str, tenant: str, weight: float = 1.0, priority: int = 0, max_tokens: int = 6) -> Sequence:
    first = 100 * int(rid.rsplit("-", 1)[1]) + (0 if tenant == "a" else 50)  # no shared prefixes
    params = SamplingParams(max_tokens=max_tokens, tenant=tenant, tenant_weight=weight, priority=priority)
    return Sequence(rid, tuple(range(first, first + 8)), params, BS)


def run_until_one_drains(sched: Scheduler, tenants: tuple[str, ...]) -> Counter[str]:
    """Steps (each running sequence's prompt, then a token a step, each request `max_tokens`)
    while every tenant has backlog (waiting or running): the output tokens each got."""
    out: Counter[str] = Counter()
    while all(any(s.params.tenant == t for s in (*sched.waiting, *sched.running)) for t in tenants):
        batch = sched.schedule()
        assert batch.seqs, "a step with backlog schedules someone"
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(7)
                out[s.params.tenant] += 1
                if s.num_tokens - s.num_prompt_tokens == s.params.max_tokens:
                    sched.finish(s, FinishReason.LENGTH)
    return out


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
def test_tenants_flooding_from_two_frontends_share_the_output_by_weight(policy, weights):
    sched = make(max_seqs=4, policy=policy)
    # Frontend 1's flood of tenant a arrives first, then frontend 2's of tenant b: each
    # frontend's own line is fair, but neither knows the other's requests.
    for i in range(24):
        sched.add(request(f"a-{i}", "a", weights[0]))
    for i in range(24):
        sched.add(request(f"b-{i}", "b", weights[1]))
    out = run_until_one_drains(sched, ("a", "b"))
    share = out["a"] / (out["a"] + out["b"])
    expected = weights[0] / sum(weights)
    assert out["a"] + out["b"] > 40 and abs(share - expected) <= 0.1 * expected, out
    assert sched._waiting_tenants == Counter(s.params.tenant for s in sched.waiting)  # the count the scan stops by


def test_within_a_tenant_and_across_priorities_the_order_holds():
    sched = make(max_seqs=2)
    for rid, tenant, priority in [("a-0", "a", 0), ("a-1", "a", 0), ("b-0", "b", 1), ("b-1", "b", 0)]:
        sched.add(request(rid, tenant, priority=priority))
    order = []
    while sched.waiting:
        waited = set(sched.waiting)
        order += [s.request_id for s in sched.schedule().seqs if s in waited]
        sched.finish(sched.running[0], FinishReason.STOP)  # the oldest ends: one seat frees a step
    # b-1 (priority 0) goes before b-0 (priority 1) and beside a-0 (a runs one, b none); a's
    # keep their arrival order.
    assert order == ["a-0", "b-1", "a-1", "b-0"]


def received(sched: Scheduler, rid: str, tenant: str) -> Sequence:
    """A sequence whose prompt's KV another worker sent: seated, its blocks reserved, landed."""
    seq = request(rid, tenant)
    assert sched.can_seat(0, tenant, 1.0)
    assert sched.block_manager.allocate(seq, seq.num_tokens)
    sched.receive(seq)
    sched.land(seq, 7, None)
    return seq


def test_a_full_decode_worker_seats_a_tenant_under_its_share_in_place_of_one_over_it():
    sched = make(max_seqs=4, policy="priority")
    a = [received(sched, f"a-{i}", "a") for i in range(4)]  # frontend 1 took every seat
    assert not sched.can_seat(0, "a", 1.0), "no seat beyond max_num_seqs for the tenant holding them all"
    received(sched, "b-0", "b")  # frontend 2's: under its share
    batch = sched.schedule()
    assert batch.preempted == [a[3]], "the youngest of the tenant over its share gives its seat up"
    received(sched, "b-1", "b")
    sched.schedule()
    running = Counter(s.params.tenant for s in sched.running)
    assert running == {"a": 2, "b": 2}
    assert not sched.can_seat(0, "b", 1.0) and not sched.can_seat(0, "a", 1.0), "at its share: no more"


def test_fcfs_seats_no_tenant_beyond_max_num_seqs():
    sched = make(max_seqs=2)
    for i in range(2):
        received(sched, f"a-{i}", "a")
    assert not sched.can_seat(0, "b", 1.0)


def test_a_bad_tenant_weight_is_refused_naming_it():
    with pytest.raises(ValueError, match="tenant_weight must be a number > 0"):
        SamplingParams(tenant="a", tenant_weight=0)


def test_one_engine_gives_two_frontends_tenants_equal_output(small_model):
    """The real engine (the small model), fed as two frontends would feed it: 16 requests of
    tenant a, then 16 of tenant b. While both have backlog each gets half its output tokens."""
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.config import SchedulerConfig as Sched
    from pdserve.engine.engine import Engine

    engine = Engine(EngineConfig(model=small_model.engine_config(), cache=CacheConfig(cpu_kv_cache_gib=0.05),
                                 scheduler=Sched(max_num_seqs=4)))
    try:
        tenant_of, unfinished = {}, Counter[str]()
        for tenant in ("a", "b"):
            for i in range(16):
                params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, tenant=tenant)
                rid = engine.add_request([1 + i, 2 + i, 3, 4, 5, 6, 7] + [60 if tenant == "a" else 61], params)
                tenant_of[rid] = tenant
                unfinished[tenant] += 1
        out: Counter[str] = Counter()
        while unfinished["a"] and unfinished["b"]:
            for delta in engine.step():
                out[tenant_of[delta.request_id]] += len(delta.token_ids)
                unfinished[tenant_of[delta.request_id]] -= delta.finish_reason is not None
        assert out["a"] + out["b"] > 64 and abs(out["a"] / (out["a"] + out["b"]) - 0.5) <= 0.05, out
    finally:
        engine.close()

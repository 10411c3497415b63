"""cluster/serving/metrics.py on a real prometheus_client registry, read back as Prometheus scrapes it:
a lost worker's series leave /metrics (its replacement reports under an id of its own)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.serving.kv_index import KVIndex
from pdserve.cluster.serving.metrics import Metrics
from pdserve.engine.kv.events import AllBlocksCleared, BlockStored, KVEventBatch
from pdserve.engine.outputs import EngineLoad
from pdserve.engine.speculator import SpecMetrics


def series(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def load(free: int, spec: SpecMetrics | None = None) -> EngineLoad:
    return EngineLoad(num_running=2, num_waiting=1, num_receiving=0, num_held=0, queued_prefill_tokens=0,
                      num_free_blocks=free, num_blocks=100, num_reservable_blocks=free - 2,
                      prefix_queried_tokens=64, prefix_hit_tokens=32,
                      num_preemptions=0, spec=spec)


def of_worker(found, worker_id: str) -> set[str]:
    return {name for name, labels in found if ("worker", worker_id) in labels}


def test_a_lost_workers_series_leave_and_the_others_stay():
    metrics = Metrics()
    spec = SpecMetrics(num_passes=3, num_proposed=12, num_accepted=9)
    spec.record_step(4)
    spec.record_step(0)
    metrics.worker_load("decode", "decode-0", load(25, spec))
    metrics.worker_load("decode", "decode-1", load(50, spec))
    metrics.worker_load("prefill", "prefill-0", load(100))
    index = KVIndex()
    index.apply("decode-0", KVEventBatch("d0", 0, (BlockStored(1, None), BlockStored(2, 1))))
    metrics.kv_index(index, [("decode", "decode-0")])
    before = series(metrics)
    assert before[("pdserve_kv_block_usage_ratio", (("role", "decode"), ("worker", "decode-0")))] == 0.75
    assert {"pdserve_running_sequences", "pdserve_spec_steps", "pdserve_spec_acceptance_alpha"} <= \
        of_worker(before, "decode-0")

    metrics.worker_lost("decode", "decode-0")
    after = series(metrics)
    assert of_worker(after, "decode-0") == set()
    assert of_worker(after, "decode-1") == of_worker(before, "decode-1")
    assert of_worker(after, "prefill-0") == of_worker(before, "prefill-0")
    assert after[("pdserve_workers_lost_total", (("role", "decode"),))] == 1

    metrics.worker_lost("prefill", "prefill-9")  # never reported a load: nothing to drop, still counted
    assert series(metrics)[("pdserve_workers_lost_total", (("role", "prefill"),))] == 1


def test_the_kv_index_its_events_and_each_workers_cached_blocks_by_tier():
    metrics, index = Metrics(), KVIndex()
    index.apply("prefill-0", KVEventBatch("p0", 0, (BlockStored(1, None), BlockStored(2, 1))))
    index.apply("decode-0", KVEventBatch("d0", 0, (BlockStored(1, None),)))
    index.apply("decode-0", KVEventBatch("d0", 3, ()))  # a gap: out of sync
    workers = [("prefill", "prefill-0"), ("decode", "decode-0")]
    metrics.kv_index(index, workers)
    found = series(metrics)
    assert found[("pdserve_kv_index_blocks", ())] == 3
    assert found[("pdserve_kv_events_received", ())] == found[("pdserve_kv_events_applied", ())] == 3
    assert found[("pdserve_kv_cached_blocks", (("role", "prefill"), ("tier", "device"), ("worker", "prefill-0")))] == 2
    index.apply("prefill-0", KVEventBatch("p0", 2, (AllBlocksCleared(),)))
    metrics.kv_index(index, workers)
    found = series(metrics)
    assert found[("pdserve_kv_cached_blocks", (("role", "prefill"), ("tier", "device"), ("worker", "prefill-0")))] == 0
    assert found[("pdserve_kv_index_blocks", ())] == 1


def test_a_workers_tiers_are_on_metrics_and_leave_with_it():
    import dataclasses

    from pdserve.engine.kv.tiers import KVTierStats

    stats = KVTierStats(hit_tokens={"host": 32, "disk": 16}, bytes_offloaded={"host": 100, "disk": 50},
                        bytes_onboarded={"host": 20, "disk": 10}, onboard_seconds=0.5,
                        num_blocks={"host": 2, "disk": 1}, num_bytes={"host": 200, "disk": 100},
                        num_rejected={"corrupt": 1}, disk_full=True, num_in_flight=0)
    metrics = Metrics()
    metrics.worker_load("prefill", "prefill-0", dataclasses.replace(load(10), kv_tiers=stats,
                                                                    prompt_tokens_computed=77))
    found = series(metrics)
    worker = (("role", "prefill"), ("worker", "prefill-0"))
    assert found[("pdserve_kv_tier_hit_tokens", (("role", "prefill"), ("tier", "disk"), ("worker", "prefill-0")))] == 16
    assert found[("pdserve_kv_disk_full", worker)] == 1
    assert found[("pdserve_kv_disk_rejected_blocks", (("reason", "corrupt"), *worker))] == 1
    assert found[("pdserve_prompt_tokens_computed", worker)] == 77
    metrics.worker_left("prefill", "prefill-0")
    assert not of_worker(series(metrics), "prefill-0")


def test_preemptions_and_queue_time_by_tenant_and_priority_class():
    metrics = Metrics()
    preempted = EngineLoad(num_running=2, num_waiting=1, num_receiving=0, num_held=0, queued_prefill_tokens=0,
                           num_free_blocks=10, num_blocks=100, num_reservable_blocks=8, prefix_queried_tokens=0,
                           prefix_hit_tokens=0, num_preemptions=4,
                           preemptions_by=(("a", 1, 2), ("", 0, 1)))
    metrics.worker_load("decode", "decode-0", preempted)
    found = series(metrics)
    key = "pdserve_preempted_sequences"
    assert found[(key, (("priority_class", "low"), ("role", "decode"), ("tenant", "a"), ("worker", "decode-0")))] == 2
    assert found[(key, (("priority_class", "default"), ("role", "decode"), ("tenant", "default"),
                        ("worker", "decode-0")))] == 1
    metrics.worker_lost("decode", "decode-0")
    assert of_worker(series(metrics), "decode-0") == set()

    # The queue: a decode seat and the prefill engine's queue, not the work after them.
    metrics.first_token_hops({"seat": 0.5, "prefill_queue": 0.25, "prefill_compute": 4.0}, 5.0, "b", -1)
    found = series(metrics)
    assert found[("pdserve_queue_seconds_sum", (("priority_class", "high"), ("tenant", "b")))] == 0.75
    assert found[("pdserve_queue_seconds_count", (("priority_class", "high"), ("tenant", "b")))] == 1

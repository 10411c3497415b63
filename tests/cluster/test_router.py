"""Routing policies over reported loads, weighed as RouterConfig says."""

from __future__ import annotations

import pytest

from pdserve.cluster.config import RouterConfig, config_from_dict
from pdserve.cluster.router import WorkerState, make_policy
from pdserve.engine.outputs import EngineLoad


def _worker(worker_id: str, free_blocks: int, queued_tokens: int, inflight: int = 0) -> WorkerState:
    load = EngineLoad(num_running=0, num_waiting=0, num_receiving=0, num_held=0, queued_prefill_tokens=queued_tokens,
                      num_free_blocks=free_blocks, num_blocks=100, num_reservable_blocks=free_blocks,
                      prefix_queried_tokens=0, prefix_hit_tokens=0,
                      num_preemptions=0)
    return WorkerState(worker_id, load, inflight=inflight)


def test_the_weights_come_from_the_config():
    full_kv, long_queue = _worker("a", free_blocks=0, queued_tokens=0), _worker("b", free_blocks=100,
                                                                                queued_tokens=8192)
    # Defaults: a full pool weighs 4, 8,192 queued tokens weigh 2.
    assert make_policy("least_load").choose([full_kv, long_queue], []) is long_queue
    kv_light = RouterConfig(kv_usage_weight=1.0)
    assert make_policy("least_load", kv_light).choose([full_kv, long_queue], []) is full_kv
    assert full_kv.score(kv_light) == 1.0 and long_queue.score(kv_light) == 2.0


def test_prefix_aware_keeps_the_prefix_within_the_configured_imbalance():
    hashes = [11, 12, 13]
    cached, idle = _worker("cached", 100, 0, inflight=3), _worker("idle", 100, 0)
    cached.cached_hashes.update(dict.fromkeys(hashes))
    assert make_policy("prefix_aware").choose([cached, idle], hashes) is cached
    assert make_policy("prefix_aware", RouterConfig(max_imbalance=2.0)).choose([cached, idle], hashes) is idle


@pytest.mark.parametrize("values", [{"kv_usage_weight": -1}, {"queued_tokens_per_request": 0},
                                    {"max_hashes_per_worker": 0}])
def test_bad_router_config_is_refused(values):
    with pytest.raises(ValueError, match="RouterConfig"):
        config_from_dict({"router": values})

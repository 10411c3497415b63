"""Routing policies over reported loads and the KV index, weighed as RouterConfig says."""

from __future__ import annotations

import pytest

from pdserve.cluster.serving.kv_index import KVIndex
from pdserve.cluster.serving.router import PromptBlocks, WorkerState, make_policy
from pdserve.cluster.settings.config import RouterConfig, config_from_dict
from pdserve.engine.kv.events import DEVICE_TIER, DISK_TIER, HOST_TIER, BlockStored, KVEventBatch
from pdserve.engine.outputs import EngineLoad

NO_PROMPT = PromptBlocks(0, (), 16)


def _worker(worker_id: str, free_blocks: int, queued_tokens: int, inflight: int = 0) -> WorkerState:
    load = EngineLoad(num_running=0, num_waiting=0, num_receiving=0, num_held=0, queued_prefill_tokens=queued_tokens,
                      num_free_blocks=free_blocks, num_blocks=100, num_reservable_blocks=free_blocks,
                      prefix_queried_tokens=0, prefix_hit_tokens=0,
                      num_preemptions=0)
    return WorkerState(worker_id, load, inflight=inflight)


def _holding(worker_id: str, prompt: PromptBlocks, num_blocks: int) -> KVIndex:
    """An index in which `worker_id` holds the first `num_blocks` blocks of `prompt`."""
    index = KVIndex()
    hashes = prompt.block_hashes[:num_blocks]
    index.apply(worker_id, KVEventBatch("i", 0, tuple(
        BlockStored(h, hashes[i - 1] if i else None) for i, h in enumerate(hashes))))
    return index


def test_the_weights_come_from_the_config():
    full_kv, long_queue = _worker("a", free_blocks=0, queued_tokens=0), _worker("b", free_blocks=100,
                                                                                queued_tokens=8192)
    # Defaults: a full pool weighs 4, 8,192 queued tokens weigh 2.
    assert make_policy("least_load", KVIndex()).choose([full_kv, long_queue], NO_PROMPT) is long_queue
    kv_light = RouterConfig(kv_usage_weight=1.0)
    assert make_policy("least_load", KVIndex(), kv_light).choose([full_kv, long_queue], NO_PROMPT) is full_kv
    assert full_kv.score(kv_light) == 1.0 and long_queue.score(kv_light) == 2.0


def test_prefix_aware_weighs_the_prompt_work_left_against_the_load():
    prompt = PromptBlocks.of(list(range(8192 + 1)), 16)  # 512 full blocks and one token
    index = _holding("cached", prompt, 512)
    cached, idle = _worker("cached", 100, 0, inflight=1), _worker("idle", 100, 0)
    # In requests: cached 1 + 1 / 4096 (one new token), idle 8193 / 4096 = 2.0002: cached wins...
    policy = make_policy("prefix_aware", index)
    assert policy.choose([cached, idle], prompt) is cached
    # ... unless it is busier than the prompt's work is worth,
    cached.inflight = 3
    assert policy.choose([cached, idle], prompt) is idle
    # or the prompt weighs more.
    assert make_policy("prefix_aware", index, RouterConfig(prompt_weight=2.0)).choose([cached, idle], prompt) is cached
    # Half the prompt cached saves half its work (1 request): a load of 2 more loses it.
    half = make_policy("prefix_aware", _holding("cached", prompt, 256))
    cached.inflight = 2
    assert half.choose([cached, idle], prompt) is idle
    cached.inflight = 0
    assert half.choose([cached, idle], prompt) is cached


def test_ties_go_to_the_less_loaded_then_to_the_first_by_name():
    prompt = PromptBlocks.of(list(range(64)), 16)
    index = KVIndex()
    b, a = _worker("b", 100, 0), _worker("a", 100, 0)
    policy = make_policy("prefix_aware", index, RouterConfig(prompt_weight=0.0))
    assert policy.choose([b, a], prompt) is a
    assert make_policy("least_load", index).choose([b, a], prompt) is a
    a.inflight = 1
    assert policy.choose([b, a], prompt) is b


@pytest.mark.parametrize("values", [{"kv_usage_weight": -1}, {"queued_tokens_per_request": 0},
                                    {"prompt_weight": -0.5}, {"max_hashes_per_worker": 100}])
def test_bad_router_config_is_refused(values):
    with pytest.raises(ValueError, match="RouterConfig|router"):
        config_from_dict({"router": values})


def test_a_prefix_below_a_pool_earns_its_tier_s_smaller_credit():
    prompt = PromptBlocks.of(list(range(8192 + 1)), 16)
    hashes = prompt.block_hashes
    index = KVIndex()
    for worker_id, tier in (("device", DEVICE_TIER), ("host", HOST_TIER), ("disk", DISK_TIER)):
        index.apply(worker_id, KVEventBatch("i", 0, tuple(BlockStored(h, None, tier) for h in hashes)))
    config = RouterConfig(host_tier_credit=0.75, disk_tier_credit=0.25)
    assert index.prefix_credit(hashes, config.tier_credits) == {"device": 512, "host": 384, "disk": 128}
    workers = [_worker(w, 100, 0) for w in ("disk", "host", "device")]
    policy = make_policy("prefix_aware", index, config)
    assert policy.choose(workers, prompt).worker_id == "device"
    assert policy.choose(workers[:2], prompt).worker_id == "host"
    # A tier without credit counts as a miss; one block of each tier takes the best of them.
    assert index.prefix_credit(hashes, {DEVICE_TIER: 1.0}) == {"device": 512}
    index.apply("host", KVEventBatch("i", 512, (BlockStored(hashes[0], None, DEVICE_TIER),)))
    assert index.prefix_credit(hashes[:2], config.tier_credits)["host"] == 1.75
    with pytest.raises(ValueError, match="disk_tier_credit"):
        RouterConfig(disk_tier_credit=1.5)


def test_salted_prompts_hash_as_the_workers_do():
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence

    tokens = list(range(40))
    plain, salted = PromptBlocks.of(tokens, 16), PromptBlocks.of(tokens, 16, "tenant-a")
    assert plain.block_hashes != salted.block_hashes
    assert PromptBlocks.of(tokens, 16, "tenant-b").block_hashes[0] != salted.block_hashes[0]
    seq = Sequence("r", tuple(tokens), SamplingParams(cache_salt="tenant-a"), 16)
    assert tuple(seq.block_hashes(2)) == salted.block_hashes

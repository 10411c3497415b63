"""The KV tiers in the engine, on the real default model: a conversation's second turn after
its prefix left a tiny pool is served from host memory, then from disk after a restart, with
the greedy tokens of a cold run and fewer prompt tokens computed; bad disk blocks are
recomputed; aborts leave nothing held; cache salts keep tenants' prefixes apart."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.block_hash import prefix_block_hashes
from pdserve.engine.config import CacheConfig, EngineConfig, KVTierConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv.disk import block_path
from pdserve.engine.kv.events import DISK_TIER, HOST_TIER
from pdserve.engine.sampling import SamplingParams
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
NUM_BLOCKS = 24  # 384 tokens: three 150-token prompts push a turn's blocks out
HOST_BYTES = 64 * (2 * 30 * 16 * 3 * 64 * 4)  # 64 blocks of the default model's float32 KV


def tiered(tmp_path, host_bytes: int, max_num_batched_tokens: int = 2048) -> Engine:
    return Engine(EngineConfig(
        model=ModelConfig(device="cpu", dtype="float32"),
        cache=CacheConfig(num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        kv_tiers=KVTierConfig(host_bytes=host_bytes, disk_dir=tmp_path, slot="prefill-0"),
    ))


@pytest.fixture(scope="module")
def turns(tokenizer, default_engine):
    """(first turn, second turn, the second's cold greedy tokens, its first 6 blocks' cold KV)."""
    first = prompt_ids(tokenizer, 100, variant=1)
    second = first + prompt_ids(tokenizer, 40, variant=2)
    default_engine.reset_prefix_cache()
    cold, block_ids = held(default_engine, second, "cold")
    kv = default_engine.pool.kv[:, :, list(block_ids[:6])].clone()
    default_engine.release("cold")
    default_engine.reset_prefix_cache()
    return first, second, cold, kv


def held(engine: Engine, prompt: list[int], rid: str) -> tuple[list[int], tuple[int, ...]]:
    """Run `prompt` as a prefill worker does (its blocks held for sending until `release(rid)`):
    its greedy tokens and the blocks holding its KV."""
    engine.add_request(prompt, GREEDY, request_id=rid, hold_kv=True)
    tokens: list[int] = []
    while True:
        for delta in engine.step():
            tokens += delta.token_ids
            if delta.finished:
                return tokens, delta.held_block_ids


def push_out(engine: Engine, tokenizer, prompt: list[int]) -> None:
    """Run other prompts until no block of `prompt` is in the pool, then let the copies land."""
    for variant in (3, 4, 5):
        engine.generate([prompt_ids(tokenizer, 150, variant=variant)], GREEDY)
    assert not set(prefix_block_hashes(prompt, 16)) & set(engine.block_manager.cached_hashes())
    assert engine.kv_tiers.wait_idle(30)


def second_turn(engine: Engine, prompt: list[int]) -> tuple[list[int], int, int]:
    """(tokens, cached tokens, prompt tokens computed) of one greedy request."""
    before = engine.load().prompt_tokens_computed
    out = engine.generate([prompt], GREEDY)[0]
    return out.token_ids, out.num_cached_tokens, engine.load().prompt_tokens_computed - before


def test_second_turn_from_host_then_from_disk_after_a_restart(tmp_path, tokenizer, turns):
    first, second, cold, cold_kv = turns
    engine = tiered(tmp_path, HOST_BYTES)
    engine.generate([first], GREEDY)
    push_out(engine, tokenizer, first)
    before = engine.load().prompt_tokens_computed
    tokens, block_ids = held(engine, second, "warm")  # as a prefill worker runs it, its KV held to send
    assert tokens == cold
    # The first turn's 6 full blocks came from host: in the blocks it sends, their cold KV.
    assert engine.load().prompt_tokens_computed - before == len(second) - 96
    assert engine.load().kv_tiers.hit_tokens[HOST_TIER] == 96
    torch.testing.assert_close(engine.pool.kv[:, :, list(block_ids[:6])], cold_kv, rtol=1e-4, atol=1e-4)
    engine.release("warm")
    engine.close()

    # A restart without a host tier: the first turn's blocks were never on disk (host held
    # them), so it runs once more and is pushed out, straight to disk this time.
    engine = tiered(tmp_path, host_bytes=0)
    engine.generate([first], GREEDY)
    push_out(engine, tokenizer, first)
    engine.close()
    engine = tiered(tmp_path, host_bytes=0)  # restarted: finds its slot's files
    tokens, cached, computed = second_turn(engine, second)
    assert tokens == cold
    assert cached == 96 and computed == len(second) - 96
    assert engine.load().kv_tiers.hit_tokens[DISK_TIER] == 96

    # Bad files on disk are recomputed, never served: same tokens, counted.
    assert engine.reset_prefix_cache()  # the pool forgets the turn; its files stay
    path = block_path(tmp_path / "prefill-0", prefix_block_hashes(second, 16)[1])
    path.write_bytes(path.read_bytes()[:-3])
    tokens, cached, computed = second_turn(engine, second)
    assert tokens == cold
    assert cached == 16 and computed == len(second) - 16  # the first block, then the truncated one
    assert engine.load().kv_tiers.num_rejected == {"truncated": 1}
    engine.close()


def test_aborts_during_offload_and_onboarding_leave_nothing_held(tmp_path, tokenizer, turns):
    first, second, _, _ = turns
    engine = tiered(tmp_path, HOST_BYTES, max_num_batched_tokens=32)
    engine.generate([first], GREEDY)
    # Offloads queued while requests are cancelled mid-prefill.
    for variant in (3, 4, 5, 6):
        rid = engine.add_request(prompt_ids(tokenizer, 150, variant=variant), GREEDY)
        for _ in range(3):
            engine.step()
        engine.abort(rid)
    assert engine.kv_tiers.wait_idle(30)
    # Onboarded from host, then cancelled while the rest of the prompt is computed in chunks.
    rid = engine.add_request(second, GREEDY)
    engine.step()
    assert engine.kv_tiers.stats().hit_tokens[HOST_TIER] > 0
    engine.abort(rid)
    while engine.has_unfinished:
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.kv_tiers.wait_idle(30)
    stats = engine.kv_tiers.stats()
    assert stats.num_in_flight == 0
    engine.wipe_kv_tiers()
    assert engine.kv_tiers.stats().num_blocks == {HOST_TIER: 0, DISK_TIER: 0}
    assert engine.kv_tiers.stats().num_bytes == {HOST_TIER: 0, DISK_TIER: 0}
    engine.close()


def test_cache_salts_keep_prefixes_apart(default_engine, tokenizer):
    prompt = prompt_ids(tokenizer, 40, variant=6)

    def cached(salt: str | None) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=1, cache_salt=salt)
        return default_engine.generate([prompt], params)[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another tenant's identical prompt finds nothing
    assert cached(None) == 0  # nor does an unsalted one
    assert cached("tenant-a") == 32  # the same tenant shares its own

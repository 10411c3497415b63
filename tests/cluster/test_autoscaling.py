"""Pools that ask for more than the Ray cluster's nodes hold: the actor waits, within
`health.start_timeout_s`, for a node (Ray's autoscaler adds one for the pending actor's
resources), and past it the add fails with a line that says what it waited for.

The bound runs on the tests' local Ray. The autoscaler itself (Ray's `fake_multinode` provider,
through `ray.cluster_utils.AutoscalingCluster`) is opt-in, PDSERVE_TEST_FAKE_MULTINODE=1, run
alone: its start and stop run `ray stop --force`, which ends every Ray process on the machine,
other users' and other test runs' included, so it cannot run beside anything in CI."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
import ray
from ray import cloudpickle

from pdserve.cluster.config import HealthConfig
from pdserve.cluster.pools import ActorSpec, Pool, WorkerStartTimeout

# Ray's workers do not have the tests on their path (they start outside the checkout:
# cluster/ray_driver.py), so this module's actor class travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _Idle:
    """A worker actor that loads nothing: the pool's start, ping and stop calls."""

    def __init__(self, worker_id: str, slot: str | None = None) -> None:
        self.worker_id, self.slot = worker_id, slot

    async def start(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


def test_a_worker_no_node_can_hold_fails_its_add_within_the_bound(ray_cluster):
    async def run() -> None:
        pool = Pool("decode", 0, ActorSpec(_Idle, (), 0.1, 0, "pdserve_test_no_such_label"),
                    HealthConfig(start_timeout_s=2))
        with pytest.raises(WorkerStartTimeout, match="pdserve_test_no_such_label.*no autoscaler adds one"):
            await pool.add()
        assert pool.workers == []
        placed = Pool("decode", 0, ActorSpec(_Idle, (), 0.1, 0, ""), HealthConfig(start_timeout_s=60))
        worker = await placed.add()
        await placed.remove(worker)
        assert placed.workers == [] and placed.gone[-1] is worker

    asyncio.run(run())


def _nodes_with(resource: str) -> int:
    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource))


@pytest.mark.skipif(not os.environ.get("PDSERVE_TEST_FAKE_MULTINODE"),
                    reason="opt-in (PDSERVE_TEST_FAKE_MULTINODE=1, alone): AutoscalingCluster runs `ray stop --force`; "
                           "Ray 2.60's wheel lacks the fake_multi_node/example.yaml it reads")
def test_fake_multinode_autoscaler_adds_a_node_for_a_pool_and_removes_it_idle():
    from ray.cluster_utils import AutoscalingCluster

    if ray.is_initialized():
        pytest.skip("run alone: this test starts a Ray cluster of its own")
    cluster = AutoscalingCluster(
        head_resources={"CPU": 1},
        worker_node_types={"decode_node": {"resources": {"CPU": 1, "decode": 1}, "node_config": {},
                                           "min_workers": 0, "max_workers": 2}},
        idle_timeout_minutes=0.1)
    cluster.start()
    try:
        ray.init("auto")

        async def run() -> None:
            pool = Pool("decode", 0, ActorSpec(_Idle, (), 0.5, 0, "decode"), HealthConfig(start_timeout_s=180))
            assert _nodes_with("decode") == 0
            worker = await pool.add()  # pending until the autoscaler adds a decode node
            assert _nodes_with("decode") == 1
            await pool.remove(worker)
            end = time.monotonic() + 180
            while _nodes_with("decode") and time.monotonic() < end:
                await asyncio.sleep(2)
            assert _nodes_with("decode") == 0  # the idle node went

        asyncio.run(run())
    finally:
        ray.shutdown()
        cluster.shutdown()

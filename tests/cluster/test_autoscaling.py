"""Pools that ask for more than the Ray cluster's nodes hold: the actor waits, within
`health.start_timeout_s`, for a node (Ray's autoscaler adds one for the pending actor's
resources), and past it the add fails with a line that says what it waited for.

The bound runs on the tests' local Ray. The autoscaler itself runs in a process of its own
(tests/cluster/fake_multinode.py): a head whose autoscaler is Ray's `fake_multinode` provider,
which adds a `decode` node for the pool's pending worker and removes it once idle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from pdserve.cluster.serving.pools import ActorSpec, Pool, WorkerStartTimeout
from pdserve.cluster.settings.config import HealthConfig
from tests.cluster.fake_multinode import IdleWorker


def test_a_worker_no_node_can_hold_fails_its_add_within_the_bound(ray_cluster, caplog):
    """...saying while it waits, and in its error, what it needs and what the cluster has."""
    async def run() -> None:
        pool = Pool("decode", 0, ActorSpec(IdleWorker, (), 0.1, 0, "pdserve_test_no_such_label"),
                    HealthConfig(start_timeout_s=2, start_report_s=0.5))
        with caplog.at_level("WARNING", logger="pdserve.cluster.serving.pools"):
            with pytest.raises(WorkerStartTimeout, match="waiting for room: it needs 0.1 CPU, 1 "
                                                         "pdserve_test_no_such_label; the cluster has .* CPU"):
                await pool.add()
        reports = [r.getMessage() for r in caplog.records if "not started after" in r.getMessage()]
        assert len(reports) >= 2 and all("0 pdserve_test_no_such_label (0 free)" in r for r in reports), reports
        assert pool.workers == []
        placed = Pool("decode", 0, ActorSpec(IdleWorker, (), 0.1, 0, ""), HealthConfig(start_timeout_s=60))
        worker = await placed.add()
        await placed.remove(worker)
        assert placed.workers == [] and placed.gone[-1] is worker

    asyncio.run(run())


@pytest.mark.timeout(400)
def test_fake_multinode_autoscaler_adds_a_node_for_a_pool_and_removes_it_idle():
    """In its own process and process group (tests/cluster/fake_multinode.py): whatever Ray
    process outlives it is killed with the group, and nothing else on the machine is touched."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.cluster.fake_multinode"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=360)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, err[-3000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    assert report["decode_nodes_before"] == []
    assert report["decode_nodes_with_worker"] == [report["worker_node"]]  # the node added for the worker
    assert report["pool_after_remove"] == []
    assert report["decode_nodes_after_idle"] == []  # the idle node went

"""A role change's steps (cluster/scaling/elastic.py) without Ray, over pools whose actors are stand-ins:
the worker drains, leaves, and a worker of the other role starts in its place; the last worker
of a role is not moved while requests need it. And the planner's loop: what it observes from
/metrics and the loads, and that it acts through Elastic."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pdserve.cluster.scaling.elastic import AdminRefused, Elastic
from pdserve.cluster.scaling.planner import Action, Planner
from pdserve.cluster.scaling.planner_loop import PlannerLoop
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.pools import Phase, Pool, Worker
from pdserve.cluster.serving.router import WorkerState
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.cluster.settings.pool_config import DrainConfig, PlannerConfig
from pdserve.cluster.sim.step_costs import Curve, StepCosts
from pdserve.engine.outputs import EngineLoad


class _Pool(Pool):
    """A pool whose actors are stand-ins: starting and stopping one records it."""

    def __init__(self, role: str, num_workers: int) -> None:
        super().__init__(role, num_workers, None)  # type: ignore[arg-type]
        self._ids = itertools.count(num_workers)
        self.workers = [Worker(role, None, WorkerState(f"{role}-{i}"), None) for i in range(num_workers)]
        self.events: list[str] = []

    async def _spawn(self, slot: str | None = None) -> Worker:
        worker_id = f"{self.role}-{next(self._ids)}"
        self.events.append(f"start {worker_id}")
        return Worker(self.role, None, WorkerState(worker_id), None)

    async def _stop_actor(self, worker: Worker) -> None:
        self.events.append(f"stop {worker.worker_id}")


class _Streams:
    """Records the workers whose streams moved (past a drain's deadline); they let go at once."""

    def __init__(self) -> None:
        self.moved: list[str] = []

    def follow(self, worker: Worker) -> None: ...
    def leave(self, worker: Worker, error: Exception) -> None: ...

    def move(self, worker: Worker, error: Exception) -> None:
        self.moved.append(worker.worker_id)
        worker.state.inflight = 0


def _elastic(num_prefill: int, num_decode: int) -> tuple[Elastic, WorkerSet]:
    """A worker set over the stand-in pools, not started, its streams `_Streams`."""
    worker_set = WorkerSet(_Pool("prefill", num_prefill), _Pool("decode", num_decode), "least_load", 16, Metrics(),
                           4, 2)
    worker_set.streams = _Streams()  # type: ignore[assignment]
    return Elastic(worker_set, DrainConfig(check_s=0.01, stop_timeout_s=5)), worker_set


def test_a_role_change_drains_stops_and_starts_the_other_role():
    async def run() -> None:
        elastic, worker_set = _elastic(1, 2)
        busy, idle = worker_set.decode.workers
        busy.state.inflight = 1
        drained, started = await asyncio.wait_for(elastic.change_role("", "prefill", None), 5)
        assert drained.worker_id == idle.worker_id and drained.phase is Phase.GONE  # the least loaded decode worker
        assert started.role == "prefill" and started.phase is Phase.SERVING
        assert worker_set.decode.events == [f"stop {idle.worker_id}"] and worker_set.prefill.events == [
            f"start {started.worker_id}"]  # stopped before the other starts: its resources are free
        assert [w.worker_id for w in worker_set.prefill.serving()] == ["prefill-0", started.worker_id]
        with pytest.raises(AdminRefused, match="last serving decode worker"):
            await elastic.change_role(busy.worker_id, "prefill", None)  # its request needs it
        with pytest.raises(AdminRefused, match="a prefill worker already"):
            await elastic.change_role("prefill-0", "prefill", None)
        busy.state.inflight = 0
        drained, started = await asyncio.wait_for(elastic.change_role("prefill-0", "decode", None), 5)
        assert drained.role == "prefill" and started.role == "decode"
        await elastic.stop()

    asyncio.run(run())


def test_the_planner_loop_observes_the_interval_and_acts_through_elastic():
    async def run() -> None:
        elastic, worker_set = _elastic(1, 2)
        metrics = Metrics()
        config = PlannerConfig(ttft_target_ms=500, itl_target_ms=50)
        costs = StepCosts(Curve.of([(0, 0.01), (1000, 0.11)]), Curve.of([(1, 0.02), (64, 0.05)]))
        loop = PlannerLoop(Planner(config, costs, 3), config, worker_set, elastic, metrics)  # type: ignore[arg-type]
        for _ in range(10):
            metrics.arrived.inc()
            metrics.prompt_tokens.inc(300)
            metrics.ttft.observe(0.2)
        metrics.ttft.observe(3.0)
        metrics.e2e.observe(1.0)
        metrics.tokens.inc(40)
        worker_set.prefill.workers[0].state.load = EngineLoad(0, 3, 0, 0, 1200, 10, 100, 10, 0, 0, 0)
        for w in worker_set.decode.workers:
            w.state.load = EngineLoad(2, 0, 0, 0, 0, 25, 100, 20, 0, 0, 0)
        obs = loop.observe(7.0)
        assert (obs.now, obs.num_prefill, obs.num_decode) == (7.0, 1, 2)
        assert (obs.num_arrived, obs.num_prompt_tokens, obs.num_finished, obs.num_output_tokens) == (10, 3000, 1, 40)
        assert obs.queued_prefill_tokens == 1200 and obs.kv_usage == pytest.approx(0.75)
        # p90 of 11: rank 9.9, within the bucket 0.2 s falls in (0.1-0.25 s, 10 samples); no token gaps yet
        assert obs.ttft_ms == pytest.approx(100 + 150 * 9.9 / 10) and obs.itl_ms is None
        assert loop.observe(8.0).num_arrived == 0  # the next interval starts from here
        assert await loop._act(Action("move", "prefill"))
        assert len(worker_set.prefill.serving()) == 2 and len(worker_set.decode.serving()) == 1
        worker_set.decode.serving()[0].state.inflight = 1
        assert not await loop._act(Action("remove", "decode"))  # refused (the last one), logged, not raised
        worker_set.decode.serving()[0].state.inflight = 0
        assert await loop._act(Action("add", "decode"))
        assert len(worker_set.decode.serving()) == 2
        await elastic.stop()

    asyncio.run(run())


def test_the_planners_moves_drain_within_its_own_bound():
    """A worker the planner moves holds streams that would run for minutes: past the planner's
    `drain_deadline_s` (not the admin API's default of minutes) they move on and the change goes
    through."""
    async def run() -> None:
        elastic, worker_set = _elastic(1, 2)
        assert elastic.config.deadline_s >= 60
        for w in worker_set.decode.workers:
            w.state.inflight = 1  # neither ends by itself
        config = PlannerConfig(drain_deadline_s=0.05)
        costs = StepCosts(Curve.of([(0, 0.01), (1000, 0.11)]), Curve.of([(1, 0.02), (64, 0.05)]))
        loop = PlannerLoop(Planner(config, costs, 3), config, worker_set, elastic, Metrics())  # type: ignore[arg-type]
        assert await asyncio.wait_for(loop._act(Action("move", "prefill")), 10)
        assert len(worker_set.streams.moved) == 1 and len(worker_set.prefill.serving()) == 2
        await elastic.stop()

    asyncio.run(run())

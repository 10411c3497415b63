"""The planner on made-up load reports with a fake clock (no Ray): it follows a traffic shift and
back, holds on steady traffic, reports unmeetable targets without flapping, and dry-run changes
nothing."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cluster.planner import Action, Observation, Planner, actions_between
from pdserve.cluster.pool_config import PlannerConfig
from pdserve.cluster.simulator import Lengths, Split, Traffic, simulate
from pdserve.cluster.step_costs import Curve, StepCosts

# Prefill 10k tokens/s; decode 20 ms a step at batch 1, 50 ms at 64.
COSTS = StepCosts(Curve.of([(0, 0.010), (1000, 0.110)]), Curve.of([(1, 0.020), (64, 0.050)]),
                  kv_bytes_per_token=1000, kv_latency_s=0.001, kv_bytes_per_s=1e9)
CONFIG = PlannerConfig(ttft_target_ms=800, itl_target_ms=60, interval_s=30, window_s=60, min_change_interval_s=60,
                       hysteresis=2, sim_requests=200)
CHAT = (20.0, 100, 200)  # requests/s, prompt tokens, output tokens: decode-bound
LONG_PROMPTS = (15.0, 1500, 10)  # prefill-bound
INTERVAL = CONFIG.interval_s


class FakeCluster:
    """Applies the planner's actions to a split; reports each interval's traffic as the load reports would."""

    def __init__(self, planner: Planner, split: Split) -> None:
        self.planner = planner
        self.split = split
        self.now = 0.0
        self.decisions = []

    def run(self, traffic: tuple[float, int, int], intervals: int) -> list[Split]:
        rate, prompt, output = traffic
        seen = []
        for _ in range(intervals):
            self.now += INTERVAL
            n = round(rate * INTERVAL)
            d = self.planner.observe(Observation(self.now, self.split.num_prefill, self.split.num_decode, n,
                                                 n * prompt, n, n * output))
            self.decisions.append(d)
            for a in d.actions:
                self.split = _apply(self.split, a)
            seen.append(self.split)
        return seen


def _apply(split: Split, action: Action) -> Split:
    p, d = split.num_prefill, split.num_decode
    step = {"add": 1, "remove": -1}.get(action.kind, 0)
    if action.kind == "move":
        p, d = (p + 1, d - 1) if action.role == "prefill" else (p - 1, d + 1)
    elif action.role == "prefill":
        p += step
    else:
        d += step
    return Split(p, d)


def _cluster(config: PlannerConfig = CONFIG, split: Split = Split(1, 3), budget: int = 4) -> FakeCluster:
    return FakeCluster(Planner(config, COSTS, budget), split)


def test_long_prompts_move_capacity_to_prefill_and_back():
    cluster = _cluster()
    assert cluster.run(CHAT, 4) == [Split(1, 3)] * 4  # the chat split meets the targets
    to_prefill = cluster.run(LONG_PROMPTS, 6)
    assert to_prefill[-1].num_prefill >= 3, to_prefill
    # Within a bounded number of intervals: the window fills, then the hysteresis.
    assert to_prefill.index(to_prefill[-1]) <= 3, to_prefill
    assert all(s.num_prefill + s.num_decode <= 4 for s in to_prefill)
    changes = [d for d in cluster.decisions if d.actions]
    assert changes and "misses the targets" in changes[-1].reason
    assert {a.kind for a in changes[-1].actions} == {"move"}  # a fixed budget: role changes
    back = cluster.run(CHAT, 6)
    assert back[-1].num_prefill == 1 and back[-1].num_decode >= 2 and back.index(back[-1]) <= 3, back


def test_a_split_that_misses_as_observed_is_not_shrunk():
    """Long prompts on 2P/1D of a budget of 4: the prediction says one prefill worker would do,
    but the server observes TTFTs past the target. Fewer workers would miss by more: the
    planner keeps (or grows) what it has, never removes a worker."""
    planner = Planner(dataclasses.replace(CONFIG, hysteresis=1, min_change_interval_s=0), COSTS, 4)
    rate, prompt, output = 2.0, 1500, 10  # 1P/1D predicted within the targets
    assert planner._score(planner._predict(Split(1, 1), Traffic(rate, Lengths(prompt, 0.5), Lengths(output, 0.5),
                                                                CONFIG.sim_requests))) <= 1 - CONFIG.min_gain
    n = round(rate * INTERVAL)
    for i in range(1, 5):
        d = planner.observe(Observation(i * INTERVAL, 2, 1, n, n * prompt, n, n * output,
                                        ttft_ms=3 * CONFIG.ttft_target_ms))
        assert d.target.num_prefill + d.target.num_decode >= 3, d.reason
        assert all(a.kind != "remove" for a in d.actions), d.reason
    # Observed within the targets, the idle worker goes as before.
    d = planner.observe(Observation(5 * INTERVAL, 2, 1, n, n * prompt, n, n * output, ttft_ms=100))
    assert d.target.num_prefill + d.target.num_decode < 3 and "fewer workers" in d.reason


def test_steady_traffic_changes_nothing():
    for traffic, split in ((CHAT, Split(1, 3)), (LONG_PROMPTS, Split(3, 1))):
        cluster = _cluster(split=split)
        assert cluster.run(traffic, 10) == [split] * 10
        assert all(d.outcome == "hold" for d in cluster.decisions[2:]), [d.reason for d in cluster.decisions]


def test_unmeetable_targets_are_reported_without_flapping():
    config = dataclasses.replace(CONFIG, ttft_target_ms=5, itl_target_ms=5)  # below a single step's cost
    cluster = _cluster(config)
    seen = cluster.run(LONG_PROMPTS, 8) + cluster.run(CHAT, 8)
    assert all(d.unmeetable for d in cluster.decisions[1:])
    changes = [d for d in cluster.decisions if d.actions]
    assert len(changes) <= 2, [(d.current, d.target) for d in changes]  # at most one move per traffic phase
    assert len(set(seen[-4:])) == 1 and len(set(seen[4:8])) == 1


def test_dry_run_decides_and_changes_nothing():
    cluster = _cluster(dataclasses.replace(CONFIG, dry_run=True))
    seen = cluster.run(LONG_PROMPTS, 6)
    assert seen == [Split(1, 3)] * 6
    wanted = [d for d in cluster.decisions if d.outcome == "dry_run"]
    assert wanted and wanted[-1].target.num_prefill >= 3 and not any(d.actions for d in cluster.decisions)


def test_too_little_traffic_holds():
    cluster = _cluster()
    assert cluster.run((0.1, 100, 10), 3) == [Split(1, 3)] * 3
    assert "too little traffic" in cluster.decisions[-1].reason


def test_idle_workers_go_within_the_budget():
    cluster = _cluster(budget=8, split=Split(4, 4))
    seen = cluster.run((2.0, 100, 50), 6)
    assert seen[-1].num_prefill + seen[-1].num_decode < 8
    assert "fewer workers" in next(d.reason for d in cluster.decisions if d.actions)


@pytest.mark.parametrize(("current", "target", "expected"), [
    (Split(1, 3), Split(3, 1), ["move prefill", "move prefill"]),
    (Split(3, 1), Split(1, 2), ["move decode", "remove prefill"]),
    (Split(1, 1), Split(2, 3), ["add prefill", "add decode", "add decode"]),
])
def test_actions_move_roles_first(current, target, expected):
    assert [f"{a.kind} {a.role}" for a in actions_between(current, target)] == expected


def test_config_needs_a_profile_when_on():
    with pytest.raises(ValueError, match="profile"):
        PlannerConfig(enabled=True)


def test_a_large_budget_is_searched_and_finds_the_best_split():
    """Above EXHAUSTIVE_SPLITS a split's size is searched, not walked: the same best as every split."""
    config = dataclasses.replace(CONFIG, sim_requests=300)
    planner = Planner(config, COSTS, 40)
    traffic = Traffic(200.0, Lengths(1000, 0.5), Lengths(40, 0.5), 300)
    obs = Observation(0.0, 20, 20, 0, 0, 0, 0)
    split, pred = planner._best_of(40, traffic, obs)
    walked = min(planner._score(simulate(COSTS, Split(p, 40 - p), traffic, planner.slo)) for p in range(1, 40))
    assert planner._score(pred) == pytest.approx(walked) and 1 < split.num_prefill < 39

"""WorkerHealth: busy is alive, silence too long is dead, no progress too long is stuck."""

from __future__ import annotations

import pytest

from pdserve.cluster.serving.health import WorkerHealth
from pdserve.cluster.settings.config import HealthConfig, config_from_dict
from pdserve.engine.loop import Heartbeat

CONFIG = HealthConfig(interval_s=1, ping_timeout_s=1, unresponsive_after_s=10, stuck_after_s=100)


def beat(turns: int, alive: bool = True) -> Heartbeat:
    return Heartbeat("w", turns, alive)


def test_a_worker_in_one_long_step_is_alive_until_the_stuck_bound():
    health = WorkerHealth(CONFIG, now=0)
    assert health.observe(beat(5), now=1) is None
    for t in range(2, 101):  # answering, but its loop does not turn: one long step
        assert health.observe(beat(5), now=t) is None
    assert "no progress for 101 s" in health.observe(beat(5), now=102)


def test_progress_resets_the_stuck_clock():
    health = WorkerHealth(CONFIG, now=0)
    for t in range(0, 1000, 50):
        assert health.observe(beat(t), now=t) is None


def test_unanswered_pings_are_death_only_after_the_bound():
    health = WorkerHealth(CONFIG, now=0)
    assert health.observe(beat(1), now=1) is None
    assert health.observe(None, now=5) is None
    assert health.observe(None, now=11) is None
    assert "answered no ping for 12 s" in health.observe(None, now=13)


def test_an_ended_engine_thread_is_death():
    assert "engine thread has ended" in WorkerHealth(CONFIG, now=0).observe(beat(1, alive=False), now=1)


def test_health_comes_from_yaml_and_is_validated():
    assert config_from_dict({"health": {"stuck_after_s": 5}}).health.stuck_after_s == 5
    with pytest.raises(ValueError, match="HealthConfig.ping_timeout_s must be > 0"):
        config_from_dict({"health": {"ping_timeout_s": 0}})


def test_coordinator_and_admission_sections_come_from_yaml():
    config = config_from_dict({"coordinator": {"poll_wait_s": 0.1}, "admission": {"max_waiting_per_worker": 0}})
    assert config.coordinator.poll_wait_s == 0.1 and config.admission.max_waiting_per_worker == 0
    with pytest.raises(ValueError, match="CoordinatorConfig.abort_timeout_s must be > 0"):
        config_from_dict({"coordinator": {"abort_timeout_s": -1}})

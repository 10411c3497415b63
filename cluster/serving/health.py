"""Verdicts on one worker from its heartbeats: alive, dead (no answers) or stuck (no progress).

Liveness and progress are separate questions. A worker that answers its pings is
alive however long its engine's current step runs; it is stuck only when its engine
loop has not turned for `HealthConfig.stuck_after_s`. Pure bookkeeping: the pool
pings, this decides, so it is tested without Ray.
"""

from __future__ import annotations

from pdserve.cluster.settings.config import HealthConfig
from pdserve.engine.loop import Heartbeat


class WorkerHealth:
    def __init__(self, config: HealthConfig, now: float) -> None:
        self.config = config
        self.last_answer = now  # a fresh worker counts as answered when it started
        self.last_progress = now
        self.num_turns = -1

    def observe(self, beat: Heartbeat | None, now: float) -> str | None:
        """Record one ping's answer (None: unanswered within the ping timeout); returns
        why the worker must be replaced, or None while it is alive and progressing."""
        if beat is None:
            silent = now - self.last_answer
            if silent > self.config.unresponsive_after_s:
                return f"it answered no ping for {silent:.0f} s"
            return None
        self.last_answer = now
        if not beat.engine_alive:
            return "its engine thread has ended"
        if beat.num_turns != self.num_turns:
            self.num_turns = beat.num_turns
            self.last_progress = now
            return None
        still = now - self.last_progress
        if still > self.config.stuck_after_s:
            return f"its engine has made no progress for {still:.0f} s"
        return None

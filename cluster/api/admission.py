"""Who goes first at the frontend when the server is full: request priorities (vLLM's
`priority`, lower first; `SamplingParams.priority`).

The frontend admits requests up to the pools' capacity (running seats plus bounded queues).
A request admitted that has no token yet is queued, wherever it waits (a decode seat, a
worker's scheduler). When the server is full, an arrival of higher priority than some queued
requests takes their places: the lowest-priority of them (the latest among equals) is refused
(RESOURCE_EXHAUSTED, with the retry hint, as a full server refuses) and the arrival admitted;
an arrival that outranks none is refused itself. Inside the pools the seats and the engines'
schedulers order the queued ones by priority too (`SeatLine`, `engine/scheduler.py`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class Queued:
    """One admitted request without a token yet: its priority and the task that runs it."""

    priority: int
    task: asyncio.Task | None
    started: bool = False  # its first token came: no longer queued
    displaced: bool = False  # refused to make room for a higher-priority arrival


class AdmissionQueue:
    """The frontend's queued requests, in arrival order."""

    def __init__(self) -> None:
        self._queued: list[Queued] = []

    def add(self, priority: int) -> Queued:
        """A request admitted now, run by the current task."""
        queued = Queued(priority, asyncio.current_task())
        self._queued.append(queued)
        return queued

    def started(self, queued: Queued) -> None:
        """`queued` has its first token (or has ended): nobody displaces it any more."""
        if not queued.started:
            queued.started = True
            if not queued.displaced:
                self._queued.remove(queued)

    def displace(self, priority: int, num_requests: int) -> int | None:
        """Make room for `num_requests` of `priority`: refuse as many queued requests of lower
        priority (the lowest first, the latest among equals), cancelling their tasks (the
        frontend turns that into RESOURCE_EXHAUSTED). Returns how many, or None (and refuses
        nobody) when too few are of lower priority."""
        lower = sorted((q for q in reversed(self._queued) if q.priority > priority), key=lambda q: -q.priority)
        if len(lower) < num_requests:
            return None
        for queued in lower[:num_requests]:
            queued.displaced = True
            self._queued.remove(queued)
            if queued.task is not None:
                queued.task.cancel()
        return num_requests

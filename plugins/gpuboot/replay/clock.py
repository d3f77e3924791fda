"""A discrete-event clock: the simulation jumps from event to event, never sleeps."""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class Kind(IntEnum):
    """Event kinds; at the same instant the lower value is handled first.

    Capacity is freed (job ends, boots complete, stops complete) before new jobs
    arrive, and arrivals come before idle checks, so a node that gets work at the
    very moment its idle timer expires stays on.
    """

    JOB_END = 0
    NODE_READY = 1
    NODE_STOPPED = 2
    ARRIVAL = 3
    IDLE_CHECK = 4
    QUEUE_PASS = 5     # the waiting jobs' next poll (gpuboot.core.queue.run_pass)


@dataclass(order=True, frozen=True)
class Event:
    at: float
    kind: Kind
    seq: int
    payload: Any = field(compare=False, default=None)


class EventClock:
    """A heap of future events; `pop()` advances `now` to the next one."""

    def __init__(self, now: float = 0.0):
        self.now = float(now)
        self._heap: list[Event] = []
        self._seq = itertools.count()  # FIFO among events of the same time and kind

    def schedule(self, at: float, kind: Kind, payload: Any = None) -> Event:
        if at < self.now:
            raise ValueError(f"event {kind.name} at {at} is before now ({self.now}); time never goes back")
        event = Event(float(at), kind, next(self._seq), payload)
        heapq.heappush(self._heap, event)
        return event

    def pop(self) -> Event | None:
        """The next event (advancing `now` to it), or None when nothing is left."""
        if not self._heap:
            return None
        event = heapq.heappop(self._heap)
        self.now = event.at
        return event

    def peek_time(self) -> float | None:
        return self._heap[0].at if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

"""One node's wait for GPU readiness, whoever feeds it: the trigger (a watch in the triggerer)
or the poking sensor (reads from a worker). Pure: the caller brings Node states and the clock.

It holds the readiness rule (`ReadinessTracker`), the boot's phases (`BootClock`), the history
of what changed (for the task log), and the deadline with its one stretch: when the boot
timeout comes while everything but a missed reset holds, the wait runs on (once) to the end of
the fallback window rather than give up a node that is most likely healthy.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from gpuboot.core.inventory import node_condition, parse_time
from gpuboot.core.readiness import FALLBACK, BootBaseline, Readiness, ReadinessTracker
from gpuboot.core.steplog import BootClock
from gpuboot.core.timefmt import utc

MAX_HISTORY = 50      # changes kept for the task log (the trigger returns them in its event)


class GpuWait:
    """The wait of one node, until `deadline` (epoch seconds); `observe` every state, `expired` at every tick."""

    def __init__(self, baseline: BootBaseline, tracker: ReadinessTracker, deadline: float) -> None:
        self.baseline, self.tracker, self.deadline = baseline, tracker, float(deadline)
        self.clock = BootClock(baseline.start_requested_at)
        self.history: list[str] = []
        self.last: Readiness | None = None
        self.stretched_by: float | None = None     # seconds the deadline was stretched for a fallback window

    @classmethod
    def of(cls, baseline: BootBaseline, deadline: float, *, settle_seconds: float, fallback_seconds: float,
           continuous: bool, make_tracker: Callable[..., ReadinessTracker] = ReadinessTracker) -> GpuWait:
        return cls(baseline, make_tracker(baseline, settle_seconds=settle_seconds,
                                          fallback_seconds=fallback_seconds, continuous=continuous), deadline)

    @property
    def node(self) -> str:
        return self.baseline.node

    def observe(self, node: Mapping | None, now: float) -> Readiness:
        """Judge one Node state; keep the boot's phases and each change of finding."""
        readiness = self.tracker.observe(node, now)
        self.clock.observe(readiness, now, written_at=self.written_at(node, now))
        if self.last is None or readiness.reasons != self.last.reasons:
            self.note(readiness.reason, now)
        self.last = readiness
        return readiness

    def written_at(self, node: Mapping | None, now: float) -> float:
        """When the kubelet wrote this state of a node we started (its Ready heartbeat, which every
        status write renews), never after `now` nor before the start: a watch replayed late (the
        trigger started after the boot) dates each phase by the node's own write, not by the
        moment the trigger read it. A node up when the job chose it: `now` (no boot to date)."""
        start = self.baseline.start_requested_at
        heartbeat = parse_time(node_condition(node).get("lastHeartbeatTime")) if node else None
        if start is None or heartbeat is None:
            return now
        return max(start, min(now, heartbeat))

    def note(self, message: str, now: float) -> None:
        self.history = [*self.history, f"{utc(now)} {message}"][-MAX_HISTORY:]

    def lost_continuity(self, why: str) -> None:
        self.tracker.lost_continuity(why)

    def holding_in_fallback(self, now: float) -> bool:
        """True while the count holds in the fallback window (the reset was missed, all else ready)."""
        return (self.last is not None and self.last.code == FALLBACK
                and self.tracker.next_check_in(now) is not None)

    def expired(self, now: float) -> bool:
        """Past the deadline, after stretching it once to let a running fallback window finish."""
        if now >= self.deadline and self.stretched_by is None and self.holding_in_fallback(now):
            self.stretched_by = self.tracker.next_check_in(now) or 0.0
            self.deadline = now + self.stretched_by
        return now >= self.deadline

    def next_check_in(self, now: float) -> float:
        """Seconds until something could change without a new Node state: the window or the deadline."""
        window = self.tracker.next_check_in(now)
        left = max(0.0, self.deadline - now)
        return left if window is None else min(window, left)

"""ECS API flow control as a per-API quota per window (a minute), beside the random fault.

The real service limits each API per account and region (its API reference states the rate,
e.g. DescribePrice "500/60(s)") and keeps answering Throttling.User until the window is
over: retrying sooner does not help. `Faults.ecs_api_quota` maps an action (or "*" for every
action without its own entry) to the calls allowed per `ecs_api_quota_window_seconds`;
windows are fixed, counted from the first call after the last one ended, and refused calls
count too. No entry: no limit.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from simcloud.config import Faults
from simcloud.ecs.model import EcsError

THROTTLED = ("Throttling.User", "Request was denied due to user flow control.", 400)


class ApiQuota:
    def __init__(self, faults: Faults, clock: Callable[[], float] = time.monotonic) -> None:
        self.faults, self.clock = faults, clock
        self._windows: dict[str, tuple[float, int]] = {}     # action -> (window start, calls in it)

    def claim(self, action: str) -> None:
        """Count one call of `action`; Throttling.User once it is over its quota in this window."""
        quotas = self.faults.ecs_api_quota
        limit = quotas.get(action, quotas.get("*"))
        if limit is None:
            return
        now, window = self.clock(), self.faults.ecs_api_quota_window_seconds
        started, calls = self._windows.get(action, (now, 0))
        if now - started >= window:
            started, calls = now, 0
        self._windows[action] = (started, calls + 1)
        if calls + 1 > limit:
            raise EcsError(*THROTTLED)

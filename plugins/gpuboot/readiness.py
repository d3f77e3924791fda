"""When a (re)booted node may take a GPU pod: the rule the seed got wrong.

After a restart a Node's allocatable nvidia.com/gpu reads stale -> 0 -> real, and
Ready=True with GPU > 0 can be read during the stale first value; binding then
fails in the kubelet with UnexpectedAdmissionError. So a node is ready only when
what we read was written by the new boot, NodeReady is True, the node is
schedulable, the GPU count covers the request, and all of that has held without
a break for a settle window. Pure: the trigger feeds Node dicts and the clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .inventory import node_condition, parse_time
from .resources import GPU, QuantityError, parse_quantity


@dataclass(frozen=True)
class BootBaseline:
    """What we knew before starting the node; start_requested_at None = we did not start it."""

    node: str
    start_requested_at: float | None
    boot_id_before: str | None
    gpus_needed: int

    def to_json(self) -> dict:
        return {"node": self.node, "start_requested_at": self.start_requested_at,
                "boot_id_before": self.boot_id_before, "gpus_needed": self.gpus_needed}

    @classmethod
    def from_json(cls, data: dict) -> "BootBaseline":
        return cls(node=data["node"], start_requested_at=data.get("start_requested_at"),
                   boot_id_before=data.get("boot_id_before"), gpus_needed=int(data.get("gpus_needed", 0)))


@dataclass(frozen=True)
class Verdict:
    ready: bool
    reason: str
    evidence: dict = field(default_factory=dict)


def _allocatable_gpus(node: dict) -> int | None:
    raw = ((node.get("status") or {}).get("allocatable") or {}).get(GPU)
    if raw is None:
        return None
    try:
        return int(parse_quantity(raw, f"status.allocatable.{GPU}"))
    except QuantityError:
        return None


class ReadinessTracker:
    """Feed it every Node event and timer tick; it says when the GPU pod may be committed."""

    def __init__(self, baseline: BootBaseline, settle_seconds: float = 5.0):
        if settle_seconds < 0:
            raise ValueError(f"settle_seconds: must be >= 0, got {settle_seconds}")
        self.baseline = baseline
        self.settle_seconds = float(settle_seconds)
        self._held_since: float | None = None
        self._held_boot_id: str | None = None

    def _fresh(self, boot_id: str | None, transition: float | None, heartbeat: float | None) -> tuple[bool, str]:
        """Was this status written by the boot we asked for?"""
        b = self.baseline
        if b.start_requested_at is None:
            return True, "node was not started by this run"
        if boot_id and b.boot_id_before and boot_id != b.boot_id_before:
            return True, "bootID changed"
        if transition is not None and transition > b.start_requested_at:
            return True, "Ready transition after the start"
        if heartbeat is not None and heartbeat > b.start_requested_at:
            return True, "heartbeat after the start"
        return False, "status predates the start (bootID unchanged, no Ready transition or heartbeat since)"

    def observe(self, node: dict | None, now: float) -> Verdict:
        """Judge the latest Node object at time `now` (epoch seconds); any break resets the settle clock."""
        b = self.baseline
        if not node:
            self._held_since = None
            return Verdict(False, f"node {b.node} not found", {"node": b.node, "held_seconds": 0.0})
        status = node.get("status") or {}
        ready_condition = node_condition(node)
        ready_status = ready_condition.get("status", "Unknown")
        transition = parse_time(ready_condition.get("lastTransitionTime"))
        heartbeat = parse_time(ready_condition.get("lastHeartbeatTime"))
        boot_id = (status.get("nodeInfo") or {}).get("bootID") or None
        gpus = _allocatable_gpus(node)
        unschedulable = bool((node.get("spec") or {}).get("unschedulable"))
        fresh, fresh_by = self._fresh(boot_id, transition, heartbeat)

        problems = []
        if not fresh:
            problems.append(fresh_by)
        if ready_status != "True":
            detail = ready_condition.get("reason") or ready_condition.get("message")
            problems.append(f"NodeReady is {ready_status}" + (f" ({detail})" if detail else ""))
        if unschedulable:
            problems.append("node is cordoned (spec.unschedulable)")
        if b.gpus_needed > 0 and (gpus or 0) < b.gpus_needed:
            problems.append(f"allocatable {GPU} is {gpus or 0}, {b.gpus_needed} needed")

        if problems:
            self._held_since = None
        elif self._held_since is None or boot_id != self._held_boot_id:
            self._held_since, self._held_boot_id = now, boot_id   # a new boot restarts the clock
        held = 0.0 if self._held_since is None else max(0.0, now - self._held_since)

        evidence = {
            "node": b.node,
            "ready": ready_status,
            "ready_since": ready_condition.get("lastTransitionTime"),
            "gpus_allocatable": gpus,
            "gpus_needed": b.gpus_needed,
            "boot_id": boot_id,
            "boot_id_before": b.boot_id_before,
            "boot_id_changed": bool(boot_id and b.boot_id_before and boot_id != b.boot_id_before),
            "heartbeat_age_seconds": None if heartbeat is None else round(now - heartbeat, 3),
            "start_requested_at": b.start_requested_at,
            "fresh": fresh,
            "fresh_by": fresh_by if fresh else None,
            "unschedulable": unschedulable,
            "held_seconds": round(held, 3),
            "settle_seconds": self.settle_seconds,
        }
        if problems:
            return Verdict(False, "waiting: " + "; ".join(problems), evidence)
        gpu_text = f", {gpus} {GPU} allocatable" if b.gpus_needed > 0 else " (CPU-only: no GPU count needed)"
        if held < self.settle_seconds:
            return Verdict(False, f"settling: Ready{gpu_text}, held {held:.1f}s of {self.settle_seconds:g}s",
                           evidence)
        return Verdict(True, f"ready: {fresh_by}, Ready{gpu_text}, held {held:.1f}s", evidence)

    def next_check_in(self, now: float) -> float | None:
        """Seconds until the settle window could complete; None while waiting for a Node change."""
        if self._held_since is None:
            return None
        return max(0.0, self._held_since + self.settle_seconds - now)

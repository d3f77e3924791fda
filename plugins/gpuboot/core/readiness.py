"""When a (re)booted node may take a GPU pod: Ready=True with GPUs is not enough.

After a restart a Node's allocatable nvidia.com/gpu reads stale -> 0 -> real, and
Ready=True with GPU > 0 can be read during the stale first value; binding then
fails in the kubelet with UnexpectedAdmissionError. Pure: the trigger (or the poking
sensor) feeds Node dicts and the clock.

Why the count can be trusted, and when (the facts, with sources, are in docs/design.md,
GPU readiness):

* A restarted kubelet, finding its Node already registered, patches every extended
  resource's capacity and allocatable to 0 (`reconcileExtendedResource` in the
  kubelet's node registration) before its device plugins register again; only a
  device plugin's registration makes the count non-zero again. When we asked ECS to
  start the instance it was Stopped, so the old kubelet was gone: a zero seen after the
  start request, followed by a count that covers the request, can only be this boot's
  device plugin registering. That is the **fast path**: once every needed resource was
  seen at 0 and now covers the request, and the status is the new boot's (below), the
  verdict is ready at once, with no time window. No window is needed because none could
  help: the stale value is told from the real one by the zero between them, not by how
  long either lasts, so a kubelet whose reset comes late (a slow node, API latency, a
  reconnecting watch) can delay readiness but never fake it. Each resource needs its own
  zero: device plugins register one by one (GPU, `aliyun.com/gpu-mem`, RDMA...).
* The zero is seen only if every write to the Node since before the start is seen.
  The trigger watches from the resourceVersion of a read of the Node just before the
  start request (`BootBaseline.resource_version_before`: the collection's, which is
  watchable, not the Node's own, long compacted on a stopped node), so the API server
  replays every write since; the tracker is then `continuous` and, until it sees the zero, it waits
  (the count it shows is the one from before the stop) however long that takes, up to
  the boot timeout. A zero read without that continuity (a poll, a re-list) counts just
  the same: it was the Node's state after the start.
* When continuity is lost (a watch that expired with 410 Gone and was re-listed, a
  poking sensor that reads the Node now and then, a baseline without a resourceVersion,
  a start made by an earlier try) and the zero was not seen, it may have passed unseen.
  Then the count is trusted only after it held, with everything else in order, for the
  longer **fallback** window (`fallback_seconds`, at least `settle_seconds`), and the
  verdict says so as a warning: never a silent early fire, and a node whose reset was
  missed still comes up (late) rather than being given up.

Besides the counts: the status must be written by the new boot (bootID changed, or a
Ready transition / heartbeat after the start), NodeReady True, the node schedulable and
free of the not-ready / unreachable taints (the pod would wait Pending). A second reboot
seen during the wait needs its own reset. A node this run did not start (up when the job
chose it) has no reset to wait for: its state must hold for `settle_seconds`. The rule
covers every extended resource the job asks for (`needs`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuboot.core.inventory import node_condition, parse_time
from gpuboot.core.model import NOT_READY_TAINTS
from gpuboot.core.resources import GPU, QuantityError, parse_quantity
from gpuboot.core.timefmt import duration

DEFAULT_FALLBACK_SECONDS = 60.0
FAST_PATH = "reset seen"      # evidence["path"] when every needed resource's zero after the start was seen
FAST_PATH_SECONDS = 0.0       # ... and then no window: ready at the first state that passes


@dataclass(frozen=True)
class BootBaseline:
    """What we knew before starting the node; start_requested_at None = we did not start it.

    `resource_version_before` is the Node's resourceVersion read before the start request
    (None when the read came after it): watching from it shows every write of the boot."""

    node: str
    start_requested_at: float | None
    boot_id_before: str | None
    gpus_needed: int
    resource_version_before: str | None = None
    extended_needed: Mapping[str, int] = field(default_factory=dict)   # other extended resources
    start_window_seconds: float = 0.0   # the start came this long after start_requested_at at most: ECS's
                                        # StartTime (a start by someone else) is to the minute, floored

    @property
    def needs(self) -> dict[str, int]:
        """Every extended resource whose registration the pod depends on, with the count needed."""
        needs = {GPU: int(self.gpus_needed)} if self.gpus_needed > 0 else {}
        needs.update({k: int(v) for k, v in self.extended_needed.items() if int(v) > 0})
        return needs

    def to_json(self) -> dict:
        return {"node": self.node, "start_requested_at": self.start_requested_at,
                "boot_id_before": self.boot_id_before, "gpus_needed": self.gpus_needed,
                "resource_version_before": self.resource_version_before,
                "extended_needed": dict(self.extended_needed),
                **({"start_window_seconds": self.start_window_seconds} if self.start_window_seconds else {})}

    @classmethod
    def from_json(cls, data: Mapping) -> BootBaseline:
        return cls(node=data["node"], start_requested_at=data.get("start_requested_at"),
                   boot_id_before=data.get("boot_id_before"), gpus_needed=int(data.get("gpus_needed", 0)),
                   resource_version_before=data.get("resource_version_before"),
                   extended_needed={k: int(v) for k, v in (data.get("extended_needed") or {}).items()},
                   start_window_seconds=float(data.get("start_window_seconds") or 0.0))


@dataclass(frozen=True)
class Reason:
    """One finding of the rule: a stable `code` for programs (and tests), a `message` for people."""

    code: str
    message: str


# The codes: why a node is not ready yet ...
NODE_NOT_FOUND = "NodeNotFound"
STATUS_BEFORE_START = "StatusBeforeStart"     # nothing shows the status was written by the new boot
NODE_NOT_READY = "NodeNotReady"
CORDONED = "Cordoned"
NOT_READY_TAINT = "NotReadyTaint"
NOT_REGISTERED = "NotRegistered"               # an extended resource's allocatable is below the need
RESET_NOT_SEEN = "ResetNotSeen"                # watching, and the kubelet's zero has not come yet
SETTLING = "Settling"                          # all holds; the settle window is not over
FALLBACK = "Fallback"                          # all holds but the reset was missed; the longer window runs
# ... and why it is.
READY = "Ready"
READY_BY_FALLBACK = "ReadyByFallback"


@dataclass(frozen=True)
class Readiness:
    """The rule's answer for one Node state: ready or not, every finding, and the evidence read."""

    ready: bool
    reasons: tuple[Reason, ...]
    evidence: dict = field(default_factory=dict)

    @property
    def code(self) -> str:
        """The first finding's code: what blocks the node first (or how it passed)."""
        return self.reasons[0].code

    @property
    def reason(self) -> str:
        """The findings in one line, as the task log shows them."""
        if len(self.reasons) == 1 and self.reasons[0].code not in _BLOCKING:
            return self.reasons[0].message
        return "waiting: " + "; ".join(r.message for r in self.reasons)


@dataclass(frozen=True)
class Observation:
    """What the rule's predicates read: one Node state, against the baseline and what was seen before."""

    baseline: BootBaseline
    ready_status: str
    ready_detail: str | None
    fresh_by: str | None          # what shows this status is the new boot's (None: nothing does)
    unschedulable: bool
    taints: list[str]
    counts: dict[str, int | None]
    unreset: list[str]            # needed resources whose zero after the start was not seen
    continuous: bool


def written_by_this_boot(o: Observation) -> Iterable[Reason]:
    if o.fresh_by is None:
        yield Reason(STATUS_BEFORE_START, "status predates the start (bootID unchanged, no Ready transition or "
                                          "heartbeat since)")


def node_ready(o: Observation) -> Iterable[Reason]:
    if o.ready_status != "True":
        yield Reason(NODE_NOT_READY, f"NodeReady is {o.ready_status}" + (f" ({o.ready_detail})" if o.ready_detail else ""))


def schedulable(o: Observation) -> Iterable[Reason]:
    if o.unschedulable:
        yield Reason(CORDONED, "node is cordoned (spec.unschedulable)")


def untainted(o: Observation) -> Iterable[Reason]:
    if o.taints:
        yield Reason(NOT_READY_TAINT, f"node still tainted {', '.join(o.taints)}")


def resources_registered(o: Observation) -> Iterable[Reason]:
    for resource, needed in o.baseline.needs.items():
        if (o.counts[resource] or 0) < needed:
            yield Reason(NOT_REGISTERED, f"allocatable {resource} is {o.counts[resource] or 0}, {needed} needed")


def reset_seen(o: Observation) -> Iterable[Reason]:
    """Only while every write is seen: then the count shown before the zero is the stale one."""
    if o.unreset and o.continuous:
        yield Reason(RESET_NOT_SEEN, f"the kubelet has not reset {', '.join(o.unreset)} since the start yet "
                                     "(the count shown is the one from before the stop)")


# The rule, in the order its findings are reported: every predicate must find nothing.
RULE = (written_by_this_boot, node_ready, schedulable, untainted, resources_registered, reset_seen)
_BLOCKING = {STATUS_BEFORE_START, NODE_NOT_READY, CORDONED, NOT_READY_TAINT, NOT_REGISTERED, RESET_NOT_SEEN}


def is_extended_resource(name: str) -> bool:
    """Kubernetes' IsExtendedResourceName: a domain-prefixed name outside kubernetes.io (what a
    device plugin registers, and what a restarted kubelet zeroes)."""
    domain, slash, _ = name.partition("/")
    return bool(slash) and not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io")) \
        and not name.startswith("requests.")


def extended_needs(requests: Mapping[str, int]) -> dict[str, int]:
    """The extended resources besides nvidia.com/gpu in `requests` (a baseline's `extended_needed`)."""
    return {name: int(v) for name, v in requests.items() if name != GPU and is_extended_resource(name) and v}


def allocatable(node: Mapping, resource: str) -> int | None:
    raw = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
    if raw is None:
        return None
    try:
        return int(parse_quantity(raw, f"status.allocatable.{resource}"))
    except QuantityError:
        return None


def _blocking_taints(node: Mapping) -> list[str]:
    return sorted({t.get("key") for t in (node.get("spec") or {}).get("taints") or ()
                   if t.get("key") in NOT_READY_TAINTS and t.get("effect") in ("NoSchedule", "NoExecute")})


class ReadinessTracker:
    """Feed it every Node event and timer tick; it says when the GPU pod may be committed.

    `continuous=True` promises that the caller feeds every write to the Node since the
    baseline's resourceVersion (a watch from it); `lost_continuity` withdraws the promise."""

    def __init__(self, baseline: BootBaseline, settle_seconds: float = 5.0,
                 fallback_seconds: float = DEFAULT_FALLBACK_SECONDS, continuous: bool = False):
        if settle_seconds < 0:
            raise ValueError(f"settle_seconds: must be >= 0, got {settle_seconds}")
        if fallback_seconds < 0:
            raise ValueError(f"fallback_seconds: must be >= 0, got {fallback_seconds}")
        self.baseline = baseline
        self.settle_seconds = float(settle_seconds)
        self.fallback_seconds = max(float(fallback_seconds), self.settle_seconds)
        started_with_version = baseline.start_requested_at is not None and bool(baseline.resource_version_before)
        self.continuous = continuous and started_with_version
        self.gap: str | None = None if self.continuous else (
            "the Node is read without a watch from before the start" if started_with_version
            else "no resourceVersion from before the start to watch from")
        self._reset_seen: set[str] = set()
        self._new_boot_id: str | None = None    # the first bootID of a boot after the start
        self._held_since: float | None = None
        self._held_boot_id: str | None = None
        self._window = self.settle_seconds

    def lost_continuity(self, why: str) -> None:
        """Writes to the Node may have been missed (e.g. a re-list after 410 Gone)."""
        self.continuous, self.gap = False, why

    def _fresh_by(self, boot_id: str | None, transition: float | None, heartbeat: float | None) -> str | None:
        """What shows this status was written by the boot we asked for (None: nothing does)."""
        b = self.baseline
        if b.start_requested_at is None:
            return "node was not started by this run"
        if boot_id and b.boot_id_before and boot_id != b.boot_id_before:
            return "bootID changed"
        if transition is not None and transition > b.start_requested_at:
            return "Ready transition after the start"
        if heartbeat is not None and heartbeat > b.start_requested_at:
            return "heartbeat after the start"
        return None

    def _note_resets(self, boot_id: str | None, counts: Mapping[str, int | None]) -> None:
        """Record the kubelet's zeroing of each needed resource; a second new boot needs its own."""
        b = self.baseline
        if b.start_requested_at is None:
            return
        if boot_id and boot_id != b.boot_id_before:
            if self._new_boot_id is None:
                self._new_boot_id = boot_id
            elif boot_id != self._new_boot_id:      # rebooted again while we waited
                self._new_boot_id = boot_id
                self._reset_seen.clear()
        self._reset_seen.update(r for r, count in counts.items() if not count)

    def observe(self, node: Mapping | None, now: float) -> Readiness:
        """Judge the latest Node object at time `now` (epoch seconds); any break resets the settle clock."""
        b = self.baseline
        needs = b.needs
        if not node:
            self._held_since = None
            return Readiness(False, (Reason(NODE_NOT_FOUND, f"node {b.node} not found"),),
                             {"node": b.node, "held_seconds": 0.0})
        status = node.get("status") or {}
        ready_condition = node_condition(node)
        transition = parse_time(ready_condition.get("lastTransitionTime"))
        heartbeat = parse_time(ready_condition.get("lastHeartbeatTime"))
        boot_id = (status.get("nodeInfo") or {}).get("bootID") or None
        counts = {r: allocatable(node, r) for r in needs}
        self._note_resets(boot_id, counts)
        started = b.start_requested_at is not None
        seen = Observation(
            baseline=b, ready_status=ready_condition.get("status", "Unknown"),
            ready_detail=ready_condition.get("reason") or ready_condition.get("message"),
            fresh_by=self._fresh_by(boot_id, transition, heartbeat),
            unschedulable=bool((node.get("spec") or {}).get("unschedulable")), taints=_blocking_taints(node),
            counts=counts, unreset=[r for r in needs if started and r not in self._reset_seen],
            continuous=self.continuous)
        problems = tuple(reason for predicate in RULE for reason in predicate(seen))

        fallback = bool(seen.unreset)
        window = self.fallback_seconds if fallback else FAST_PATH_SECONDS if started else self.settle_seconds
        if problems or window != self._window:
            self._held_since = None
        self._window = window
        if not problems and (self._held_since is None or boot_id != self._held_boot_id):
            self._held_since, self._held_boot_id = now, boot_id   # a new boot restarts the clock
        held = 0.0 if self._held_since is None else max(0.0, now - self._held_since)

        fresh_by = seen.fresh_by
        gpus = counts.get(GPU, allocatable(node, GPU))
        evidence = {
            "node": b.node,
            "ready": seen.ready_status,
            "ready_since": ready_condition.get("lastTransitionTime"),
            "gpus_allocatable": gpus,
            "gpus_needed": b.gpus_needed,
            "allocatable": counts,
            "reset_seen": sorted(self._reset_seen),
            "boot_id": boot_id,
            "boot_id_before": b.boot_id_before,
            "boot_id_changed": bool(boot_id and b.boot_id_before and boot_id != b.boot_id_before),
            "heartbeat_age_seconds": None if heartbeat is None else round(now - heartbeat, 3),
            "start_requested_at": b.start_requested_at,
            "fresh": fresh_by is not None,
            "fresh_by": fresh_by,
            "unschedulable": seen.unschedulable,
            "taints": seen.taints,
            "continuous": self.continuous,
            "path": ("waiting for the reset" if fallback and self.continuous else "fallback" if fallback
                     else FAST_PATH if started else "not started by this run"),
            "held_seconds": round(held, 3),
            "settle_seconds": window,
        }
        if problems:
            return Readiness(False, problems, evidence)
        counted = ", ".join(f"{counts[r]} {r}" for r in needs)
        what = f"Ready, {counted} allocatable" if needs else "Ready (CPU-only: no GPU count needed)"
        if fallback:
            evidence["warning"] = (f"the kubelet's reset of {', '.join(seen.unreset)} after this boot was not "
                                   f"observed ({self.gap}); the count is trusted only after holding {duration(window)}")
        if held < window:
            code, kind = (FALLBACK, "fallback, reset not observed") if fallback else (SETTLING, "settling")
            return Readiness(False, (Reason(code, f"{kind}: {what}, held {duration(held)} of {duration(window)}"),),
                             evidence)
        if fallback:
            return Readiness(True, (Reason(READY_BY_FALLBACK, f"ready (fallback: {evidence['warning']}): {fresh_by}, "
                                                              f"{what}, held {duration(held)}"),), evidence)
        if started:
            how = f"{fresh_by}, reset after the start seen (fast path)" if needs else fresh_by
            return Readiness(True, (Reason(READY, f"ready: {how}, {what}"),), evidence)
        return Readiness(True, (Reason(READY, f"ready: {fresh_by}, {what}, held {duration(held)}"),), evidence)

    def next_check_in(self, now: float) -> float | None:
        """Seconds until the settle (or fallback) window could complete; None while waiting for a Node change."""
        if self._held_since is None:
            return None
        return max(0.0, self._held_since + self._window - now)

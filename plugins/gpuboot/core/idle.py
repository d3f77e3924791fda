"""The idle decision behind scale-down, pure: which managed nodes to stop, and the books to keep.

Rules. Only managed nodes are considered (label gpuboot.io/managed=true or ECS tag
gpuboot:managed=true, the inventory's rule); others are never touched. A node is idle when
it has no workload pod (bound or pinned to it by nodeSelector, not terminated, not owned by
a DaemonSet, not a static/mirror pod) and no live reservation in the ledger. When a node is
first seen idle, annotation gpuboot.io/idle-since is set to that moment (we cannot know
what ran between two runs, so we never guess earlier); an annotation older than the
instance's StartTime belongs to an earlier boot and counts as "first seen now". The
annotation is removed as soon as the node is busy or stopped. A node idle for at least
`idle_seconds` is stopped with StoppedMode=StopCharging, unless it is the fleet's spare
(`IdleRule`): the other running nodes have fewer free GPUs than it has, so stopping it would
make the next job wait a boot. A spare is kept for up to `spare_seconds` more, then stopped
all the same. Placement fills the nodes of the oldest work first, so the nodes of young work
drain; without a spare that is cheaper but boots about twice as often and makes jobs wait
longer. With the spare, the openb replay boots less than half as often and waits less, and is
still cheaper than keeping no spare with a stable node order (docs/performance.md, Trace replay).

`plan_scaledown` decides, `recheck` repeats the decision for the nodes about to stop (with the
ledger state the fence write returned and a fresh pod listing), `find_work` says what keeps a
node busy (also used by boot fall-back to see whether another job claims a node).
gpuboot.operators.scaledown runs it: the cordon, fence, re-check and stop, and why that order is safe.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from gpuboot.core.inventory import build_inventory, is_workload_pod, parse_provider_id, parse_time, stopped_reason
from gpuboot.core.model import (
    ANNOTATION_CORDONED_BY,
    ANNOTATION_IDLE_SINCE,
    LABEL_HOSTNAME,
    NodeState,
    NodeView,
    Reservation,
    ledger_of,
)
from gpuboot.core.resources import Resources
from gpuboot.core.timefmt import duration, rfc3339

CORDONED_BY = "idle-scaledown"
FENCE_JOB = "gpuboot-idle-scaledown"
STOPPED_MODE = "StopCharging"
MAX_IDLE_SECONDS = 30 * 24 * 3600
DEFAULT_SPARE_SECONDS = 4 * 3600.0     # how long the fleet's last spare is kept past the idle time
UNCORDONING = "; un-cordoning (gpuboot cordoned it)"   # what a reason adds when a kept node is un-cordoned


class IdleVerdict(str, Enum):
    STOP = "stop"            # idle long enough: cordon, re-check, stop
    IDLE = "idle"            # idle, not yet for long enough
    BUSY = "busy"            # workload pods
    RESERVED = "reserved"    # a live reservation
    STOPPING = "stopping"
    STOPPED = "stopped"
    STARTING = "starting"
    KEPT = "kept"            # left alone for another reason (cordoned by someone else, no instance, ...)
    SPARE = "spare"          # idle long enough, but the fleet's spare GPUs: kept for up to spare_seconds more


@dataclass(frozen=True)
class IdleRule:
    """When an idle node is stopped: once idle for `idle_seconds`, unless it is the fleet's spare,
    i.e. the other running (or booting) nodes have fewer free GPUs than it has; a spare is stopped
    once idle for `idle_seconds + spare_seconds`. The scale-down DAG and the trace replay both
    decide with it (module doc)."""

    idle_seconds: float = 600.0
    spare_seconds: float = DEFAULT_SPARE_SECONDS

    def __post_init__(self):
        if not 0 < self.idle_seconds <= MAX_IDLE_SECONDS:
            raise ValueError(f"idle_seconds must be in (0, {MAX_IDLE_SECONDS}], got {self.idle_seconds!r}; e.g. 600")
        if not 0 <= self.spare_seconds <= MAX_IDLE_SECONDS:
            raise ValueError(f"spare_seconds must be in [0, {MAX_IDLE_SECONDS}], got {self.spare_seconds!r}; "
                             f"e.g. {DEFAULT_SPARE_SECONDS:.0f}, or 0 to keep no spare")

    def verdict(self, idle_for: float, gpus: int, free_elsewhere: int) -> tuple[IdleVerdict, str]:
        """STOP, SPARE or IDLE for a node idle for `idle_for` seconds with `gpus` GPUs, while the
        other running nodes have `free_elsewhere` free GPUs; and why, in words."""
        idle = f"idle for {duration(idle_for)}"
        if idle_for < self.idle_seconds:
            return IdleVerdict.IDLE, f"{idle} < {duration(self.idle_seconds)}"
        held = idle_for < self.idle_seconds + self.spare_seconds
        if gpus and free_elsewhere < gpus and held:
            return IdleVerdict.SPARE, (f"{idle}, kept as the spare: the other running nodes have {free_elsewhere} "
                                       f"free GPU(s), fewer than its {gpus}; stopped at "
                                       f"{duration(self.idle_seconds + self.spare_seconds)} idle at the latest")
        if gpus and free_elsewhere < gpus and self.spare_seconds:
            return IdleVerdict.STOP, f"{idle} >= {duration(self.idle_seconds + self.spare_seconds)} (kept as the spare)"
        return IdleVerdict.STOP, f"{idle} >= {duration(self.idle_seconds)}"


@dataclass(frozen=True)
class NodeDecision:
    """What this run decides for one managed node, and the books to keep on it."""

    node: str
    instance_id: str | None
    verdict: IdleVerdict
    reason: str
    idle_since: str | None = None           # gpuboot.io/idle-since after this run (None: absent)
    idle_since_before: str | None = None    # as read
    uncordon: bool = False                  # cordoned by gpuboot and no longer being stopped
    idle_for: float | None = None           # seconds idle, for an idle node
    ours: bool = False                      # cordoned by gpuboot (un-cordoned unless stopped)

    @property
    def annotation_changes(self) -> bool:
        return self.idle_since != self.idle_since_before

    def line(self) -> str:
        return f"{self.node:<24} {self.instance_id or '-':<24} {self.verdict.value:<9} {self.reason}"


@dataclass(frozen=True)
class ScaledownPlan:
    now: float
    idle_seconds: float
    decisions: tuple[NodeDecision, ...]
    unmanaged: tuple[str, ...]
    spare_seconds: float = 0.0

    @property
    def to_stop(self) -> tuple[NodeDecision, ...]:
        return tuple(d for d in self.decisions if d.verdict == IdleVerdict.STOP)

    def lines(self) -> list[str]:
        """One line per managed node (the task log), and one for the nodes never touched."""
        head = f"{'NODE':<24} {'INSTANCE':<24} {'VERDICT':<9} REASON"
        tail = f"unmanaged, never touched: {', '.join(self.unmanaged) or 'none'}"
        return [head, *(d.line() for d in self.decisions), tail]

    def to_json(self) -> dict:
        return {"now": self.now, "idle_seconds": self.idle_seconds, "spare_seconds": self.spare_seconds,
                "unmanaged": list(self.unmanaged),
                "decisions": {d.node: {"verdict": d.verdict.value, "reason": d.reason} for d in self.decisions}}


# --- small helpers -------------------------------------------------------------------

def _pod_node(pod: Mapping, node_by_hostname: Mapping[str, str]) -> str | None:
    """The node a pod runs on, or is pinned to by nodeSelector hostname while still Pending."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return spec["nodeName"]
    return node_by_hostname.get((spec.get("nodeSelector") or {}).get(LABEL_HOSTNAME) or "")


def _hostnames(nodes: Iterable[Mapping]) -> dict[str, str]:
    out = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        out[(meta.get("labels") or {}).get(LABEL_HOSTNAME) or meta["name"]] = meta["name"]
    return out


def find_work(nodes: Iterable[Mapping], pods: Iterable[Mapping], reservations: Iterable[Reservation],
              now: float) -> dict[str, tuple[IdleVerdict, str]]:
    """Nodes that have work, with why: BUSY (workload pods) before RESERVED (live reservations).
    Nodes without work are absent. Scale-down's own fence entries are not work."""
    node_by_hostname = _hostnames(nodes)
    pods_on: dict[str, list[str]] = defaultdict(list)
    for pod in pods:
        node = _pod_node(pod, node_by_hostname)
        if node and is_workload_pod(pod):
            meta = pod.get("metadata") or {}
            pods_on[node].append(f"{meta.get('namespace', 'default')}/{meta.get('name')}")
    work: dict[str, tuple[IdleVerdict, str]] = {}
    for r in sorted(reservations, key=lambda r: r.expires_at):
        if r.expires_at > now and r.job_id != FENCE_JOB:
            work.setdefault(r.node, (IdleVerdict.RESERVED, (f"reserved by job {r.job_id} (task {r.task}) "
                                                       f"until {rfc3339(r.expires_at)}")))
    for node, names in pods_on.items():
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        work[node] = (IdleVerdict.BUSY, f"busy: {len(names)} pod{'s' if len(names) != 1 else ''} ({shown})")
    return work


# --- the decision ------------------------------------------------------------------------

def plan_scaledown(nodes: Sequence[dict], pods: Sequence[dict], instances: Sequence[dict],
                   reservations: Sequence[Reservation], now: float, idle_seconds: float,
                   spare_seconds: float, ledger: str | None = None) -> ScaledownPlan:
    """Decide, for every managed node, whether to stop it, and the idle-since books to keep.

    `nodes`/`pods` in API form, `instances` in DescribeInstances form, `reservations` from
    the ledger (expired ones are ignored), `now` in epoch seconds; `idle_seconds` and
    `spare_seconds` make the `IdleRule`. `ledger`: the identity of the ledger `reservations` come from; a
    node booked through another (ANNOTATION_LEDGER) is kept: its bookings are not among them."""
    rule = IdleRule(idle_seconds, spare_seconds)
    by_id = {i["InstanceId"]: i for i in instances if i.get("InstanceId")}
    # The inventory owns the "managed" rule (label or tag) and what is free where (pods and reservations).
    views = {v.name: v for v in build_inventory(list(nodes), list(pods), list(instances), {}, list(reservations),
                                                now)}
    work = find_work(nodes, pods, reservations, now)
    decisions, unmanaged = [], []
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        name = node["metadata"]["name"]
        if not views[name].managed:
            unmanaged.append(name)
            continue
        owner = ledger_of(node)
        if ledger is not None and owner not in (None, ledger):
            books = (node["metadata"].get("annotations") or {}).get(ANNOTATION_IDLE_SINCE)   # the other's: untouched
            decisions.append(NodeDecision(
                verdict=IdleVerdict.KEPT, node=name, instance_id=None, idle_since_before=books, idle_since=books,
                reason=f"booked through ledger {owner}, not this deployment's {ledger}: its bookings are not in this "
                       "ledger, so it is never stopped from here"))
            continue
        decisions.append(_decide(node, by_id, work.get(name), now, rule))
    return ScaledownPlan(now=now, idle_seconds=idle_seconds, decisions=_keep_spare(decisions, views, rule),
                         unmanaged=tuple(unmanaged), spare_seconds=spare_seconds)


def _keep_spare(decisions: list[NodeDecision], views: Mapping[str, NodeView], rule: IdleRule
                ) -> tuple[NodeDecision, ...]:
    """The idle time's STOP verdicts judged again by the spare rule, longest idle first: each node
    sees the free GPUs of the running and booting nodes this plan does not stop, so of several idle
    nodes the last ones to be judged stay as the spare (one decision at a time, as the replay's
    idle checks come)."""
    stops = sorted((d for d in decisions if d.verdict == IdleVerdict.STOP), key=lambda d: (-(d.idle_for or 0.0), d.node))
    if not stops or not rule.spare_seconds:
        return tuple(decisions)
    up = {name: max(0, v.free.gpus) for name, v in views.items() if v.state in (NodeState.READY, NodeState.BOOTING)}
    free_up = sum(up.values())
    judged = {}
    for d in stops:
        own = up.get(d.node, 0)
        verdict, reason = rule.verdict(d.idle_for or 0.0, views[d.node].allocatable.gpus, free_up - own)
        if verdict == IdleVerdict.STOP:
            free_up -= own
            judged[d.node] = replace(d, reason=reason)
        else:
            judged[d.node] = replace(d, verdict=verdict, uncordon=d.ours,
                                     reason=reason + (UNCORDONING if d.ours else ""))
    return tuple(judged.get(d.node, d) for d in decisions)


def _decide(node: Mapping, by_id: Mapping[str, dict], work: tuple[IdleVerdict, str] | None,
            now: float, rule: IdleRule) -> NodeDecision:
    meta, spec = node["metadata"], node.get("spec") or {}
    annotations = meta.get("annotations") or {}
    ours = annotations.get(ANNOTATION_CORDONED_BY) == CORDONED_BY
    before = annotations.get(ANNOTATION_IDLE_SINCE)
    parsed = parse_provider_id(spec.get("providerID"))
    instance = by_id.get(parsed[1]) if parsed else None
    decision = {"node": meta["name"], "instance_id": parsed[1] if parsed else None, "idle_since_before": before}

    def decide(verdict: IdleVerdict, reason: str, idle_since: str | None = None, uncordon: bool = False):
        if uncordon:
            reason += UNCORDONING
        return NodeDecision(verdict=verdict, reason=reason, idle_since=idle_since, uncordon=uncordon, **decision)

    status = (instance or {}).get("Status")
    if instance is None:
        return decide(IdleVerdict.KEPT, "no ECS instance for its providerID", before, uncordon=ours)
    if status == "Stopping":
        return decide(IdleVerdict.STOPPING, "instance Stopping; un-cordoned once Stopped" if ours
                      else "instance Stopping")
    if status == "Stopped":
        return decide(IdleVerdict.STOPPED, stopped_reason(instance), uncordon=ours)
    if status in ("Pending", "Starting"):
        return decide(IdleVerdict.STARTING, f"instance {status}", uncordon=ours)
    if status != "Running":
        return decide(IdleVerdict.KEPT, f"instance status {status!r}", before)
    if spec.get("unschedulable") and not ours:
        return decide(IdleVerdict.KEPT, "cordoned by someone else; left alone", before)
    if work is not None:
        return decide(*work, uncordon=ours)

    started = parse_time(instance.get("StartTime"))
    since, stamp = parse_time(before), before
    if since is None or since > now or (started is not None and since < started):
        since, stamp = now, rfc3339(now)      # first seen idle in this boot
    idle_for = now - since
    verdict, reason = rule.verdict(idle_for, 0, 0)      # the idle time alone: _keep_spare judges the spare
    return replace(decide(verdict, reason, stamp, uncordon=ours and verdict != IdleVerdict.STOP), idle_for=idle_for,
                   ours=ours)


def recheck(nodes: Sequence[dict], names: Iterable[str], pods: Sequence[dict],
            reservations: Sequence[Reservation], now: float) -> dict[str, str]:
    """After the cordon and the fence: which of `names` have work after all, with why."""
    work = find_work(nodes, pods, reservations, now)
    return {name: work[name][1] for name in names if name in work}


def fence_entries(names: Iterable[str], now: float, ttl: float) -> list[Reservation]:
    """Zero-resource ledger entries: writing them moves the ledger's version (see the module doc)."""
    return [Reservation(job_id=FENCE_JOB, task=name, node=name, resources=Resources(), expires_at=now + ttl)
            for name in sorted(set(names))]

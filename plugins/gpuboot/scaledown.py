"""Idle scale-down: power off managed GPU instances whose nodes have been idle too long.

The decision (`plan_scaledown`, `recheck`) is pure and unit-tested; `IdleScaleDownOperator`
gathers its inputs, keeps the books on the Nodes and does the stop.

Rules. Only managed nodes are considered (label gpuboot.io/managed=true or ECS tag
gpuboot:managed=true, the inventory's rule); others are never touched. A node is idle when
it has no workload pod (bound or pinned to it by nodeSelector, not terminated, not owned by
a DaemonSet, not a static/mirror pod) and no live reservation in the ledger. When a node is
first seen idle, annotation gpuboot.io/idle-since is set to that moment (we cannot know
what ran between two runs, so we never guess earlier); an annotation older than the
instance's StartTime belongs to an earlier boot and counts as "first seen now". The
annotation is removed as soon as the node is busy or stopped. A node idle for at least
`idle_seconds` is stopped with StoppedMode=StopCharging.

Why the stop can never hit a node that a placement has just chosen. The placement
operator reads the ledger (version V), then the Nodes, places, and commits its
reservations with compare-and-swap on V. The inventory makes a cordoned node
UNAVAILABLE, so placement never chooses it. Scale-down, per node to stop:

1. cordon: spec.unschedulable=true + annotation gpuboot.io/cordoned-by (guarded by the
   Node's resourceVersion, so a node cordoned by someone else is left alone);
2. fence: a compare-and-swap *write* to the ledger (a zero-resource marker entry per
   node, job FENCE_JOB), which also returns exactly what the ledger held at that write;
3. re-check: reservations from step 2, then a fresh listing of pods;
4. stop only nodes the re-check found idle; un-cordon the others and back off.

Take any placement P. If P committed before the fence write, its reservation is in what
the fence read (CAS: nothing was written in between), so the node is kept; if P's job
already released it, that was after its pod was created, and the pod listing of step 3,
made later, shows the pod (the same "ledger first, then pods" order placement uses). If P
commits after the fence write, its CAS succeeds only if P read the ledger after the fence
(any earlier read carries an older version and gets a conflict, so P re-reads and
re-places); P reads the Nodes after the ledger, hence after the cordon, sees the node
UNAVAILABLE and does not choose it. A plain re-read of the ledger would not be enough:
a placement that read before the cordon could still commit after the re-read. The
scheduler binds no new pod to a cordoned node (DaemonSet pods tolerate it, and do not
count). Once the instance is Stopped the node is un-cordoned, so its next boot comes up
schedulable; a run that dies midway leaves marks the next run finishes: a node it
cordoned is un-cordoned once Stopped (or at once if it turned out busy or not due),
and the fence entries carry no resources and expire.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from gpuboot.ecs import EcsHook
from gpuboot.inventory import (LABEL_HOSTNAME, Reservation, build_inventory, parse_provider_id,
                               parse_time)
from gpuboot.kube import Conflict, KubeClient
from gpuboot.ledger import LedgerConflict, ReservationLedger
from gpuboot.resources import Resources

ANNOTATION_IDLE_SINCE = "gpuboot.io/idle-since"
ANNOTATION_CORDONED_BY = "gpuboot.io/cordoned-by"
CORDONED_BY = "idle-scaledown"
FENCE_JOB = "gpuboot-idle-scaledown"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
STOPPED_MODE = "StopCharging"
MAX_IDLE_SECONDS = 30 * 24 * 3600
_TERMINATED = ("Succeeded", "Failed")


class IdleVerdict(str, Enum):
    STOP = "stop"            # idle long enough: cordon, re-check, stop
    IDLE = "idle"            # idle, not yet for long enough
    BUSY = "busy"            # workload pods
    RESERVED = "reserved"    # a live reservation
    STOPPING = "stopping"
    STOPPED = "stopped"
    STARTING = "starting"
    KEPT = "kept"            # left alone for another reason (cordoned by someone else, no instance, ...)


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

    @property
    def to_stop(self) -> tuple[NodeDecision, ...]:
        return tuple(d for d in self.decisions if d.verdict == IdleVerdict.STOP)

    def lines(self) -> list[str]:
        """One line per managed node (the task log), and one for the nodes never touched."""
        head = f"{'NODE':<24} {'INSTANCE':<24} {'VERDICT':<9} REASON"
        tail = f"unmanaged, never touched: {', '.join(self.unmanaged) or 'none'}"
        return [head, *(d.line() for d in self.decisions), tail]

    def to_json(self) -> dict:
        return {"now": self.now, "idle_seconds": self.idle_seconds, "unmanaged": list(self.unmanaged),
                "decisions": {d.node: {"verdict": d.verdict.value, "reason": d.reason} for d in self.decisions}}


# --- small helpers -------------------------------------------------------------------

def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def duration(seconds: float) -> str:
    """90 -> '90s', 600 -> '10m', 4500 -> '1h15m': short, for log lines."""
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def is_workload_pod(pod: Mapping) -> bool:
    """Counts toward "busy": not terminated, not a DaemonSet pod, not a static (mirror) pod."""
    meta = pod.get("metadata") or {}
    if (pod.get("status") or {}).get("phase") in _TERMINATED:
        return False
    if MIRROR_ANNOTATION in (meta.get("annotations") or {}):
        return False
    return not any(ref.get("kind") == "DaemonSet" for ref in meta.get("ownerReferences") or ())


def _pod_node(pod: Mapping, node_by_hostname: Mapping[str, str]) -> str | None:
    """The node a pod runs on, or is pinned to by nodeSelector hostname while still Pending."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return spec["nodeName"]
    return node_by_hostname.get((spec.get("nodeSelector") or {}).get(LABEL_HOSTNAME))


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
            work.setdefault(r.node, (IdleVerdict.RESERVED, f"reserved by job {r.job_id} (task {r.task}) "
                                                       f"until {rfc3339(r.expires_at)}"))
    for node, names in pods_on.items():
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        work[node] = (IdleVerdict.BUSY, f"busy: {len(names)} pod{'s' if len(names) != 1 else ''} ({shown})")
    return work


# --- the decision ------------------------------------------------------------------------

def plan_scaledown(nodes: Sequence[dict], pods: Sequence[dict], instances: Sequence[dict],
                   reservations: Sequence[Reservation], now: float, idle_seconds: float) -> ScaledownPlan:
    """Decide, for every managed node, whether to stop it, and the idle-since books to keep.

    `nodes`/`pods` in API form, `instances` in DescribeInstances form, `reservations` from
    the ledger (expired ones are ignored), `now` in epoch seconds."""
    if not 0 < idle_seconds <= MAX_IDLE_SECONDS:
        raise ValueError(f"idle_seconds must be in (0, {MAX_IDLE_SECONDS}], got {idle_seconds!r}; e.g. 600")
    by_id = {i.get("InstanceId"): i for i in instances}
    # The inventory owns the "managed" rule (label or tag); pods and reservations are not needed for it.
    managed = {v.name for v in build_inventory(list(nodes), [], list(instances), {}, [], now) if v.managed}
    work = find_work(nodes, pods, reservations, now)
    decisions, unmanaged = [], []
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        name = node["metadata"]["name"]
        if name not in managed:
            unmanaged.append(name)
            continue
        decisions.append(_decide(node, by_id, work.get(name), now, idle_seconds))
    return ScaledownPlan(now=now, idle_seconds=idle_seconds, decisions=tuple(decisions),
                         unmanaged=tuple(unmanaged))


def _decide(node: Mapping, by_id: Mapping[str, dict], work: tuple[IdleVerdict, str] | None,
            now: float, idle_seconds: float) -> NodeDecision:
    meta, spec = node["metadata"], node.get("spec") or {}
    annotations = meta.get("annotations") or {}
    ours = annotations.get(ANNOTATION_CORDONED_BY) == CORDONED_BY
    before = annotations.get(ANNOTATION_IDLE_SINCE)
    parsed = parse_provider_id(spec.get("providerID"))
    instance = by_id.get(parsed[1]) if parsed else None
    decision = dict(node=meta["name"], instance_id=parsed[1] if parsed else None, idle_since_before=before)

    def decide(verdict: IdleVerdict, reason: str, idle_since: str | None = None, uncordon: bool = False):
        if uncordon:
            reason += "; un-cordoning (gpuboot cordoned it)"
        return NodeDecision(verdict=verdict, reason=reason, idle_since=idle_since, uncordon=uncordon, **decision)

    status = (instance or {}).get("Status")
    if instance is None:
        return decide(IdleVerdict.KEPT, "no ECS instance for its providerID", before, uncordon=ours)
    if status == "Stopping":
        return decide(IdleVerdict.STOPPING, "instance Stopping; un-cordoned once Stopped" if ours
                      else "instance Stopping")
    if status == "Stopped":
        return decide(IdleVerdict.STOPPED, f"instance Stopped ({instance.get('StoppedMode') or 'mode unknown'})",
                      uncordon=ours)
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
    if idle_for >= idle_seconds:
        return decide(IdleVerdict.STOP, f"idle for {duration(idle_for)} >= {duration(idle_seconds)}", stamp)
    return decide(IdleVerdict.IDLE, f"idle for {duration(idle_for)} < {duration(idle_seconds)}", stamp, uncordon=ours)


def recheck(nodes: Sequence[dict], names: Iterable[str], pods: Sequence[dict],
            reservations: Sequence[Reservation], now: float) -> dict[str, str]:
    """After the cordon and the fence: which of `names` have work after all, with why."""
    work = find_work(nodes, pods, reservations, now)
    return {name: work[name][1] for name in names if name in work}


def fence_entries(names: Iterable[str], now: float, ttl: float) -> list[Reservation]:
    """Zero-resource ledger entries: writing them moves the ledger's version (see the module doc)."""
    return [Reservation(job_id=FENCE_JOB, task=name, node=name, resources=Resources(), expires_at=now + ttl)
            for name in sorted(set(names))]


# --- the operator ------------------------------------------------------------------------

def _as_bool(value, field: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", "", "none"):
        return False
    raise ValueError(f"{field}: {value!r} is not a boolean; use true or false")


def _as_seconds(value, field: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 0 < seconds <= MAX_IDLE_SECONDS:
        raise ValueError(f"{field}: {value!r} must be a number of seconds in (0, {MAX_IDLE_SECONDS}]; e.g. 600")
    return seconds


class IdleScaleDownOperator(BaseOperator):
    """Stop managed ECS instances whose nodes were idle for `idle_seconds` (StopCharging),
    with cordon -> fence -> re-check -> stop (see the module doc). `dry_run` logs the
    decisions and changes nothing. Returns a JSON summary (XCom)."""

    template_fields = ("idle_seconds", "dry_run")
    ui_color = "#eef7ee"

    def __init__(self, *, idle_seconds: float | str = 600, dry_run: bool | str = False,
                 kubernetes_conn_id: str = "kubernetes_default", ecs_conn_id: str = "alibaba_ecs_default",
                 ledger_namespace: str = "default", stop_timeout_seconds: float = 300,
                 stop_poll_seconds: float = 5.0, fence_attempts: int = 10, fence_ttl_seconds: float = 900,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.idle_seconds, self.dry_run = idle_seconds, dry_run
        self.kubernetes_conn_id, self.ecs_conn_id = kubernetes_conn_id, ecs_conn_id
        self.ledger_namespace = ledger_namespace
        self.stop_timeout_seconds, self.stop_poll_seconds = stop_timeout_seconds, stop_poll_seconds
        self.fence_attempts, self.fence_ttl_seconds = fence_attempts, fence_ttl_seconds

    # Seams: tests override them to set the clock and to act inside the cordon window.
    def now(self) -> float:
        return time.time()

    def on_cordoned(self, nodes: list[str]) -> None:
        """Called after the cordon, before the fence and the re-check."""

    def execute(self, context) -> dict:
        try:
            idle_seconds = _as_seconds(self.idle_seconds, "idle_seconds")
            dry_run = _as_bool(self.dry_run, "dry_run")
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from None
        kube, ecs = KubeClient(self.kubernetes_conn_id), EcsHook(self.ecs_conn_id)
        ledger = ReservationLedger(kube, self.ledger_namespace)
        plan, nodes = self.survey(kube, ecs, ledger, idle_seconds)
        self.log.info("idle scale-down%s: %d managed node(s), idle time %s", " (DRY RUN)" if dry_run else "",
                      len(plan.decisions), duration(idle_seconds))
        for line in plan.lines():
            self.log.info("%s", line)
        summary = {**plan.to_json(), "dry_run": dry_run, "stopped": [], "stopping": [], "backed_off": {},
                   "failed": {}}
        if dry_run:
            self.log.info("dry run: would stop %s; changed nothing", [d.node for d in plan.to_stop] or "nothing")
            return summary
        self.keep_books(kube, plan)
        if plan.to_stop:
            summary.update(self.stop_idle(kube, ecs, ledger, nodes, plan.to_stop))
        if summary["failed"]:
            raise AirflowException(f"could not stop: {summary['failed']}")
        return summary

    def survey(self, kube: KubeClient, ecs: EcsHook, ledger: ReservationLedger,
               idle_seconds: float) -> tuple[ScaledownPlan, list[dict]]:
        """Ledger first, then Nodes and pods (the placement's order), then their instances."""
        reservations, _ = ledger.read()
        nodes = kube.list_nodes()
        pods = kube.list_active_pods()
        ids = sorted({p[1] for p in (parse_provider_id((n.get("spec") or {}).get("providerID")) for n in nodes)
                      if p})
        instances = ecs.describe_instances(ids) if ids else []
        return plan_scaledown(nodes, pods, instances, reservations, self.now(), idle_seconds), nodes

    def keep_books(self, kube: KubeClient, plan: ScaledownPlan) -> None:
        """Write idle-since changes and release cordons that are no longer needed."""
        for d in plan.decisions:
            if d.annotation_changes or d.uncordon:
                patch_node(kube, d.node, annotations={ANNOTATION_IDLE_SINCE: d.idle_since}, uncordon=d.uncordon)

    def stop_idle(self, kube: KubeClient, ecs: EcsHook, ledger: ReservationLedger, nodes: list[dict],
                  due: Sequence[NodeDecision]) -> dict:
        """Cordon, fence, re-check, stop; un-cordon what backs off, fails, or has stopped."""
        result: dict = {"stopped": [], "stopping": [], "backed_off": {}, "failed": {}}
        cordoned = [d for d in due if cordon(kube, d.node, self.log)]
        if not cordoned:
            return result
        names = [d.node for d in cordoned]
        try:
            self.on_cordoned(names)
            reservations = self.fence(ledger, names)
            busy = recheck(nodes, names, kube.list_active_pods(), reservations, self.now())
            for name, why in busy.items():
                self.log.info("%s: re-check after the cordon found work (%s); un-cordoning, backing off", name, why)
                patch_node(kube, name, annotations={ANNOTATION_IDLE_SINCE: None}, uncordon=True)
                result["backed_off"][name] = why
            go = {d.instance_id: d.node for d in cordoned if d.node not in busy and d.instance_id}
            outcomes = ecs.stop_instances(sorted(go), stopped_mode=STOPPED_MODE) if go else {}
        except BaseException:
            for name in names:      # nothing is known to be stopping: leave every node schedulable
                patch_node(kube, name, uncordon=True)
            raise
        finally:
            ledger.release(FENCE_JOB)
        for iid, outcome in outcomes.items():
            if not outcome.ok:
                self.log.warning("%s: StopInstances failed (%s); un-cordoning", go[iid], outcome.error)
                patch_node(kube, go[iid], uncordon=True)
                result["failed"][go[iid]] = str(outcome.error)
        ok = sorted(iid for iid, o in outcomes.items() if o.ok)
        statuses = ecs.wait_for_status(ok, {"Stopped"}, self.stop_timeout_seconds,
                                       poll=self.stop_poll_seconds) if ok else {}
        for iid in ok:
            if statuses.get(iid) == "Stopped":
                patch_node(kube, go[iid], annotations={ANNOTATION_IDLE_SINCE: None}, uncordon=True)
                self.log.info("%s (%s): Stopped (%s); un-cordoned", go[iid], iid, STOPPED_MODE)
                result["stopped"].append(go[iid])
            else:
                self.log.info("%s (%s): %s after %.0fs; stays cordoned until a later run sees it Stopped",
                              go[iid], iid, statuses.get(iid), self.stop_timeout_seconds)
                result["stopping"].append(go[iid])
        return result

    def fence(self, ledger: ReservationLedger, names: list[str]) -> list[Reservation]:
        """Compare-and-swap write of fence entries; returns the entries the ledger held at that write."""
        for attempt in range(1, self.fence_attempts + 1):
            entries, version = ledger.read()
            try:
                ledger.commit(FENCE_JOB, fence_entries(names, self.now(), self.fence_ttl_seconds), version)
                return entries
            except LedgerConflict:
                self.log.info("ledger changed while fencing (attempt %d); re-reading", attempt)
        raise AirflowException(f"ledger stayed contended for {self.fence_attempts} attempts; nothing stopped")


# --- node writes ------------------------------------------------------------------------------

def patch_node(kube, name: str, *, annotations: Mapping[str, str | None] | None = None,
               uncordon: bool = False, cordon: bool = False, resource_version: str | None = None) -> None:
    """JSON merge patch of a Node's annotations and spec.unschedulable (None removes)."""
    meta: dict = dict(annotations or {})
    body: dict = {"metadata": {"annotations": meta}}
    if uncordon:
        meta[ANNOTATION_CORDONED_BY] = None
        body["spec"] = {"unschedulable": None}
    if cordon:
        meta[ANNOTATION_CORDONED_BY] = CORDONED_BY
        body["spec"] = {"unschedulable": True}
    if resource_version:
        body["metadata"]["resourceVersion"] = resource_version
    kube.merge_patch_node(name, body)


def cordon(kube, name: str, log, attempts: int = 5) -> bool:
    """Cordon `name` for scale-down unless someone else has cordoned it; True when cordoned by us."""
    for _ in range(attempts):
        node = kube.get_node(name)
        annotations = node["metadata"].get("annotations") or {}
        if (node.get("spec") or {}).get("unschedulable") and annotations.get(ANNOTATION_CORDONED_BY) != CORDONED_BY:
            log.info("%s: cordoned by someone else meanwhile; left alone", name)
            return False
        try:
            patch_node(kube, name, cordon=True, resource_version=node["metadata"]["resourceVersion"])
            return True
        except Conflict:
            pass
    log.info("%s: node kept changing while cordoning; trying again next run", name)
    return False

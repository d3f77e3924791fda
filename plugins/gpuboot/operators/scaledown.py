"""Idle scale-down: power off managed GPU instances whose nodes have been idle too long.

The decision (`plan_scaledown`, `recheck`) is pure and unit-tested; `IdleScaleDownOperator`
gathers its inputs, keeps the books on the Nodes and does the stop.

The decision is gpuboot.core.idle (pure, unit-tested): see its rules there.

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
from collections.abc import Mapping, Sequence

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from gpuboot.core.idle import (
    ANNOTATION_CORDONED_BY,
    ANNOTATION_IDLE_SINCE,
    CORDONED_BY,
    DEFAULT_SPARE_SECONDS,
    FENCE_JOB,
    MAX_IDLE_SECONDS,
    STOPPED_MODE,
    NodeDecision,
    ScaledownPlan,
    fence_entries,
    plan_scaledown,
    recheck,
)
from gpuboot.core.inventory import parse_provider_id
from gpuboot.core.model import Reservation, ledger_of
from gpuboot.core.timefmt import duration
from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import Conflict, KubeClient
from gpuboot.lifecycle.ledger import LedgerConflict, ReservationLedger
from gpuboot.operators.base import GpuJobStep

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


def _as_seconds(value, field: str, zero: bool = False) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (seconds >= 0 if zero else seconds > 0) or not seconds <= MAX_IDLE_SECONDS:
        raise ValueError(f"{field}: {value!r} must be a number of seconds in {'[' if zero else '('}0, "
                         f"{MAX_IDLE_SECONDS}]; e.g. 600" + (", or 0 for none" if zero else ""))
    return seconds


class IdleScaleDownOperator(GpuJobStep, BaseOperator):
    """Stop managed ECS instances whose nodes were idle for `idle_seconds` (StopCharging),
    with cordon -> fence -> re-check -> stop (see the module doc); the fleet's spare is kept up
    to `spare_seconds` longer (gpuboot.core.idle.IdleRule; 0 keeps none). `dry_run` logs the
    decisions and changes nothing. Returns a JSON summary (XCom)."""

    template_fields = ("idle_seconds", "spare_seconds", "dry_run")
    ui_color = "#eef7ee"

    def __init__(self, *, idle_seconds: float | str = 600, spare_seconds: float | str = DEFAULT_SPARE_SECONDS,
                 dry_run: bool | str = False,
                 kubernetes_conn_id: str = "kubernetes_default", ecs_conn_id: str = "alibaba_ecs_default",
                 ledger_namespace: str = "default", stop_timeout_seconds: float = 300,
                 stop_poll_seconds: float = 5.0, fence_attempts: int = 10, fence_ttl_seconds: float = 900,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.idle_seconds, self.spare_seconds, self.dry_run = idle_seconds, spare_seconds, dry_run
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
            spare_seconds = _as_seconds(self.spare_seconds, "spare_seconds", zero=True)
            dry_run = _as_bool(self.dry_run, "dry_run")
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from None
        kube, ecs = self.kube(), self.ecs()
        ledger = self.ledger(kube)
        plan, nodes = self.survey(kube, ecs, ledger, idle_seconds, spare_seconds)
        self.log.info("idle scale-down%s: %d managed node(s), idle time %s, spare kept up to %s more",
                      " (DRY RUN)" if dry_run else "", len(plan.decisions), duration(idle_seconds),
                      duration(spare_seconds))
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
               idle_seconds: float, spare_seconds: float) -> tuple[ScaledownPlan, list[dict]]:
        """Ledger first, then Nodes and pods (the placement's order), then their instances."""
        reservations, _ = ledger.read()
        nodes = kube.list_nodes()
        pods = kube.list_active_pods()
        ids = sorted({p[1] for p in (parse_provider_id((n.get("spec") or {}).get("providerID")) for n in nodes)
                      if p})
        instances = ecs.describe_instances(ids) if ids else []
        return plan_scaledown(nodes, pods, instances, reservations, self.now(), idle_seconds, spare_seconds,
                              ledger=ledger.identity), nodes

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
            for name in names:      # booked through another deployment's ledger since the survey: not ours to stop
                owner = ledger_of(kube.get_node(name))
                if name not in busy and owner not in (None, ledger.identity):
                    busy[name] = f"booked through ledger {owner} meanwhile"
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

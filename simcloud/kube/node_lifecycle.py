"""The node-lifecycle controller and taint-based eviction of kube-controller-manager.

Every `node_monitor_period_seconds` it looks at every Node, as the real controller's
monitorNodeHealth does:

* A node whose kubelet has neither written a new Ready heartbeat nor renewed its Lease for
  `node_monitor_grace_seconds` (measured on the controller's own clock, from when it last
  saw either change) gets all its conditions set to Unknown ("Kubelet stopped posting node
  status.") and a NodeNotReady event. Until then a stopped node keeps showing Ready=True,
  its old bootID and its old GPU count.
* Taints follow the Ready condition: Unknown -> node.kubernetes.io/unreachable, False ->
  node.kubernetes.io/not-ready, NoSchedule written first, then NoExecute (two writes, as the
  condition-taint pass and the NoExecute tainter are separate loops). Once Ready=True has
  held for a whole period they are removed, so they outlive Ready=True by one to two periods.
* Pods bound to a node with a NoExecute taint are evicted (a graceful delete with a
  DisruptionTarget condition and a TaintManagerEviction event) when they do not tolerate it,
  or `tolerationSeconds` after the taint manager first saw the pod on the tainted node (the
  apiserver gives every pod 300 s for not-ready/unreachable unless it says otherwise). A pod on a node whose kubelet
  is gone then stays Terminating until the node comes back or it is force-deleted.

* A cordoned node (spec.unschedulable) carries node.kubernetes.io/unschedulable:NoSchedule, written and
  removed by the same pass (doNoScheduleTaintingPass): it outlives an uncordon by up to one period.

The controller owns only those three taint keys; taints from the fleet file or users stay.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from simcloud.config import Timings
from simcloud.kube.errors import ApiError
from simcloud.kube.scheduler import tolerates
from simcloud.kube.store import Store, now_rfc3339

log = logging.getLogger("simcloud.kube.node_lifecycle")

UNREACHABLE = "node.kubernetes.io/unreachable"
NOT_READY = "node.kubernetes.io/not-ready"
UNSCHEDULABLE = "node.kubernetes.io/unschedulable"
LEASE_NAMESPACE = "kube-node-lease"
CONDITION_TYPES = ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
_TAINT_FOR = {"Unknown": UNREACHABLE, "False": NOT_READY, "True": None}
EVICTION_MESSAGE = "Taint manager: deleting due to NoExecute taint"


def set_unknown(obj: dict, now: str) -> None:
    """Every condition Unknown, heartbeats kept: what the controller writes for a silent kubelet."""
    status = obj["status"]
    old = {c["type"]: c for c in status.get("conditions") or []}
    status["conditions"] = [{"type": t, "status": "Unknown",
                             "lastHeartbeatTime": (old.get(t) or {}).get("lastHeartbeatTime", now),
                             "lastTransitionTime": now, "reason": "NodeStatusUnknown",
                             "message": "Kubelet stopped posting node status."} for t in CONDITION_TYPES]


def set_lifecycle_taint(obj: dict, key: str | None, effect: str, now: str) -> None:
    """Make the controller's taint of `effect` be `key` (None: neither), keeping every other taint."""
    spec = obj["spec"]
    kept = [t for t in spec.get("taints") or []
            if not (t.get("key") in (UNREACHABLE, NOT_READY) and t.get("effect") == effect)]
    if key:
        kept.append({"key": key, "effect": effect, "timeAdded": now})
    if kept:
        spec["taints"] = kept
    else:
        spec.pop("taints", None)


def set_cordon_taint(obj: dict, now: str) -> None:
    """node.kubernetes.io/unschedulable:NoSchedule present exactly while spec.unschedulable is true."""
    spec = obj["spec"]
    kept = [t for t in spec.get("taints") or [] if t.get("key") != UNSCHEDULABLE]
    if spec.get("unschedulable"):
        kept.append({"key": UNSCHEDULABLE, "effect": "NoSchedule", "timeAdded": now})
    if kept:
        spec["taints"] = kept
    else:
        spec.pop("taints", None)


def _cordon_taint_wrong(node: dict) -> bool:
    spec = node.get("spec") or {}
    return bool(spec.get("unschedulable")) != any(t.get("key") == UNSCHEDULABLE for t in spec.get("taints") or ())


def ready_status(node: dict) -> str:
    return next((c.get("status", "Unknown") for c in (node.get("status") or {}).get("conditions") or []
                 if c.get("type") == "Ready"), "Unknown")


def _lifecycle_taint(node: dict, effect: str) -> str | None:
    return next((t["key"] for t in (node.get("spec") or {}).get("taints") or []
                 if t.get("key") in (UNREACHABLE, NOT_READY) and t.get("effect") == effect), None)


def toleration_seconds(pod: dict, taints: list[dict]) -> float | None:
    """How long `pod` may stay on a node with these NoExecute `taints` (None: forever), as the taint
    manager's getMinTolerationTime: 0 when a taint is not tolerated, else the smallest
    tolerationSeconds of the tolerations used (a toleration without one tolerates forever)."""
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    least = None
    for taint in taints:
        matching = [t for t in tolerations if tolerates(t, taint)]
        if not matching:
            return 0.0
        limits = [t["tolerationSeconds"] for t in matching if t.get("tolerationSeconds") is not None]
        if limits:
            least = max(0, min(limits)) if least is None else min(least, max(0, min(limits)))
    return least


@dataclass
class _Health:
    probed: float                      # controller clock when a status or Lease renewal was last seen
    heartbeat: str | None
    renewed: str | None
    ready_since: float | None = None   # controller clock when Ready=True was first seen (this streak)
    no_execute: list[dict] = field(default_factory=list)   # the node's NoExecute taints, last pass


class NodeLifecycleController:
    """One loop for the whole fleet; reads through the store and writes like a controller would."""

    def __init__(self, store: Store, timings: Timings, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.timings, self.clock = store, timings, clock
        self._health: dict[str, _Health] = {}
        self._pods_seen: dict[str, float] = {}    # pod uid -> when first seen on a NoExecute-tainted node
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(self.timings.node_monitor_period_seconds, 0.05))
            try:
                self.monitor()
            except Exception:   # one odd node must not stop the controller
                log.exception("node-lifecycle pass failed")

    # ------------------------------------------------------------------ one pass
    def monitor(self) -> None:
        """One monitorNodeHealth pass over every node, then the taint manager's evictions."""
        now = self.clock()
        names = [n["metadata"]["name"] for n in self.store.peek("nodes")]
        for gone in set(self._health) - set(names):
            del self._health[gone]
        for name in names:
            self._check(name, now)
        self._evict(now)

    def _check(self, name: str, now: float) -> None:
        node = self.store.read("nodes", None, name)
        if _cordon_taint_wrong(node):
            stamp = now_rfc3339()
            self._write(name, lambda obj: set_cordon_taint(obj, stamp))
        heartbeat = next((c.get("lastHeartbeatTime") for c in node["status"].get("conditions") or []
                          if c.get("type") == "Ready"), None)
        renewed = self._renew_time(name)
        health = self._health.get(name)
        if health is None:
            health = self._health[name] = _Health(now, heartbeat, renewed)
        elif (heartbeat, renewed) != (health.heartbeat, health.renewed):
            health.probed, health.heartbeat, health.renewed = now, heartbeat, renewed
        ready = ready_status(node)
        if ready != "Unknown" and now - health.probed > self.timings.node_monitor_grace_seconds:
            stamp = now_rfc3339()
            self._write(name, lambda obj: set_unknown(obj, stamp))
            self._event(node, "NodeNotReady", f"Node {name} status is now: NodeNotReady")
            ready = "Unknown"
        if ready == "True":
            health.ready_since = health.ready_since if health.ready_since is not None else now
            if now - health.ready_since < self.timings.node_monitor_period_seconds:
                return      # the taints go on a later pass
        else:
            health.ready_since = None
        wanted = _TAINT_FOR.get(ready, UNREACHABLE)
        for effect in ("NoSchedule", "NoExecute"):
            if _lifecycle_taint(self.store.read("nodes", None, name), effect) != wanted:
                stamp = now_rfc3339()
                self._write(name, lambda obj, e=effect: set_lifecycle_taint(obj, wanted, e, stamp))
        health.no_execute = [t for t in self.store.read("nodes", None, name)["spec"].get("taints") or []
                             if t.get("effect") == "NoExecute"]

    def _renew_time(self, name: str) -> str | None:
        try:
            return self.store.read("leases", LEASE_NAMESPACE, name)["spec"].get("renewTime")
        except ApiError:
            return None

    def _evict(self, now: float) -> None:
        tainted = {name: health.no_execute for name, health in self._health.items() if health.no_execute}
        seen, due = {}, []
        if tainted:
            for pod in self.store.peek("pods"):
                node_name = (pod.get("spec") or {}).get("nodeName")
                if node_name not in tainted or pod["metadata"].get("deletionTimestamp") \
                        or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                uid = pod["metadata"]["uid"]
                seen[uid] = self._pods_seen.get(uid, now)
                allowed = toleration_seconds(pod, tainted[node_name])
                if allowed is not None and now >= seen[uid] + allowed:
                    due.append((pod["metadata"]["namespace"], pod["metadata"]["name"]))
        self._pods_seen = seen      # a pod off a tainted node starts afresh next time
        for namespace, name in due:
            self._evict_pod(namespace, name)

    def _evict_pod(self, namespace: str, name: str) -> None:
        stamp = now_rfc3339()

        def mark(pod: dict) -> None:
            conditions = [c for c in pod.setdefault("status", {}).get("conditions") or []
                          if c.get("type") != "DisruptionTarget"]
            pod["status"]["conditions"] = [*conditions, {"type": "DisruptionTarget", "status": "True", "lastProbeTime": None, "lastTransitionTime": stamp, "reason": "DeletionByTaintManager", "message": EVICTION_MESSAGE}]
        try:
            pod = self.store.mutate("pods", namespace, name, mark)
            self.store.delete("pods", namespace, name)
        except ApiError as exc:
            log.debug("eviction of %s/%s: %s", namespace, name, exc)
            return
        self._event(pod, "TaintManagerEviction", f"Marking for deletion Pod {namespace}/{name}",
                    component="taint-eviction-controller")

    # ------------------------------------------------------------------ writes
    def _write(self, name: str, fn) -> None:
        try:
            self.store.mutate("nodes", None, name, fn)
        except ApiError as exc:
            log.warning("node-lifecycle: cannot update node %s: %s", name, exc)

    def _event(self, involved: dict, reason: str, message: str, component: str = "node-controller") -> None:
        ref = {"apiVersion": involved.get("apiVersion", "v1"), "kind": involved.get("kind", "Node"),
               "metadata": {k: v for k, v in involved["metadata"].items() if k in ("name", "namespace", "uid")}}
        try:
            self.store.record_event(ref, reason, message, type="Normal", component=component)
        except ApiError as exc:
            log.debug("event %s not recorded: %s", reason, exc)

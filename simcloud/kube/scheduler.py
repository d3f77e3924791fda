"""The local cloud's kube-scheduler: binds pending pods to nodes that can hold them.

Filters in the real scheduler's order (NodeUnschedulable, TaintToleration,
NodeAffinity, NodeResourcesFit), scores survivors by least allocation, binds
through the store (spec.nodeName + PodScheduled + a Scheduled event), or leaves the
pod Pending with PodScheduled=False/Unschedulable and a FailedScheduling event
carrying the real "0/N nodes are available: ..." message. It retries whenever
nodes change or pods come, go or finish.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from decimal import Decimal

from simcloud.kube.admission import parse_quantity
from simcloud.kube.errors import ApiError
from simcloud.kube.store import Store, now_rfc3339

log = logging.getLogger("simcloud.kube.scheduler")

SCHEDULER_NAME = "default-scheduler"
_FILTERED_EFFECTS = ("NoSchedule", "NoExecute")


# --------------------------------------------------------------------------- pure rules
def pod_requests(pod: dict) -> dict[str, Decimal]:
    """max(sum of containers, max of init containers) + overhead, per resource, plus one pod slot."""
    spec = pod.get("spec") or {}
    total: Counter = Counter()
    for c in spec.get("containers") or []:
        for res, qty in ((c.get("resources") or {}).get("requests") or {}).items():
            total[res] += parse_quantity(qty)
    for c in spec.get("initContainers") or []:
        for res, qty in ((c.get("resources") or {}).get("requests") or {}).items():
            total[res] = max(total[res], parse_quantity(qty))
    for res, qty in (spec.get("overhead") or {}).items():
        total[res] += parse_quantity(qty)
    result = {res: qty for res, qty in total.items() if qty > 0}
    result["pods"] = Decimal(1)
    return result


def tolerates(toleration: dict, taint: dict) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return toleration.get("key") == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")


def _expression_matches(expr: dict, values_of: dict) -> bool:
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
    present, value = key in values_of, values_of.get(key)
    if op == "In":
        return present and value in values
    if op == "NotIn":
        return not present or value not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and values:
        try:
            return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
        except ValueError:
            return False
    return False


def node_affinity_matches(pod: dict, node: dict) -> bool:
    """nodeSelector AND required node affinity (terms OR'ed; expressions and fields AND'ed)."""
    spec = pod.get("spec") or {}
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if not required:
        return True
    fields = {"metadata.name": node["metadata"]["name"]}
    for term in required.get("nodeSelectorTerms") or []:
        exprs, field_exprs = term.get("matchExpressions") or [], term.get("matchFields") or []
        if not exprs and not field_exprs:
            continue   # an empty term matches nothing
        if all(_expression_matches(e, labels) for e in exprs) and \
                all(_expression_matches(e, fields) for e in field_exprs):
            return True
    return False


def _taint_text(taint: dict) -> str:
    return f"{{{taint.get('key')}: {taint.get('value') or ''}}}"


def filter_node(pod: dict, requests: dict[str, Decimal], node: dict, used: dict[str, Decimal]) -> list[str]:
    """Why `pod` cannot go to `node` (empty when it fits), in the real scheduler's words."""
    spec = pod.get("spec") or {}
    tolerations = spec.get("tolerations") or []
    if (node.get("spec") or {}).get("unschedulable") and not any(
            tolerates(t, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}) for t in tolerations):
        return ["node(s) were unschedulable"]
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in _FILTERED_EFFECTS and not any(tolerates(t, taint) for t in tolerations):
            return [f"node(s) had untolerated taint {_taint_text(taint)}"]
    if not node_affinity_matches(pod, node):
        return ["node(s) didn't match Pod's node affinity/selector"]
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    reasons = []
    for res, qty in requests.items():
        if res == "pods" and "pods" not in allocatable:
            continue
        free = parse_quantity(allocatable.get(res, 0)) - used.get(res, Decimal(0))
        if free < qty:
            reasons.append("Too many pods" if res == "pods" else f"Insufficient {res}")
    return sorted(reasons)


def unschedulable_message(total_nodes: int, reasons: Counter) -> str:
    if total_nodes == 0:
        return "no nodes available to schedule pods"
    detail = ", ".join(sorted(f"{count} {reason}" for reason, count in reasons.items()))   # as the real FitError
    return (f"0/{total_nodes} nodes are available: {detail}. preemption: 0/{total_nodes} nodes are available: "
            f"{total_nodes} Preemption is not helpful for scheduling.")


def _least_allocated(node: dict, used: dict[str, Decimal], requests: dict[str, Decimal]) -> Decimal:
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    scores = []
    for res in ("cpu", "memory"):
        cap = parse_quantity(allocatable.get(res, 0))
        if cap > 0:
            scores.append((cap - used.get(res, Decimal(0)) - requests.get(res, Decimal(0))) / cap)
    return sum(scores) / len(scores) if scores else Decimal(0)


def _is_pending(pod: dict) -> bool:
    spec, meta = pod.get("spec") or {}, pod["metadata"]
    return (not spec.get("nodeName") and not meta.get("deletionTimestamp")
            and spec.get("schedulerName", SCHEDULER_NAME) == SCHEDULER_NAME
            and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))


def _occupies(pod: dict) -> bool:
    return bool((pod.get("spec") or {}).get("nodeName")) and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def _ref(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta['namespace']}/{meta.get('name')}" if meta.get("namespace") else str(meta.get("name"))


@contextlib.contextmanager
def _isolated(what: str):
    """Log and skip one malformed object instead of failing the whole scheduling pass."""
    try:
        yield
    except Exception:
        log.exception("skipping malformed %s in this scheduling pass", what)


# --------------------------------------------------------------------------- the controller
class Scheduler:
    """Runs in the server's event loop; `start()` from inside it, `await stop()` to end."""

    def __init__(self, store: Store):
        self.store = store
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._queues: list[tuple[str, asyncio.Queue]] = []
        self._requests: dict[str, dict[str, Decimal]] = {}   # pod uid -> requests (pod specs are immutable)
        # the pods waiting for a node, as the real scheduler's queue holds them: a pass reads these, not every
        # pod (Node events are frequent on a 10,000-node fleet: a scan of 80,000 pods for each took a third of
        # the local cloud's core during a burst's Node claims)
        self._pending: set[tuple[str, str]] = set()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for resource in ("pods", "nodes"):
            _, queue = self.store.watch(resource, None)
            self._queues.append((resource, queue))
            self._tasks.append(loop.create_task(self._pump(resource, queue)))
        # after the watch opened: an event queued meanwhile may re-add a pod bound since, which a pass drops
        self._pending = {self.store.key_of(p) for p in self.store.peek("pods") if _is_pending(p)}
        self._tasks.append(loop.create_task(self._run()))
        self._dirty.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for resource, queue in self._queues:
            self.store.unsubscribe(resource, queue)
        self._tasks, self._queues = [], []

    async def _pump(self, resource: str, queue: asyncio.Queue) -> None:
        while True:
            event = await queue.get()
            if resource == "pods":
                key = self.store.key_of(event.obj)
                if event.type != "DELETED" and _is_pending(event.obj):
                    self._pending.add(key)
                else:
                    self._pending.discard(key)
            if resource == "nodes" or self._frees_or_needs_room(event):
                self._dirty.set()

    @staticmethod
    def _frees_or_needs_room(event) -> bool:
        if event.type == "DELETED":
            return _occupies(event.old or event.obj)
        if _is_pending(event.obj):
            return event.old is None or not _is_pending(event.old) or \
                event.obj.get("spec") != event.old.get("spec")
        return event.old is not None and _occupies(event.old) and not _occupies(event.obj)

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(0.01)      # batch a burst of changes into one pass
            self._dirty.clear()
            try:
                self.schedule_pending()
            except Exception:
                log.exception("scheduling pass failed")

    def _pod_requests(self, pod: dict) -> dict[str, Decimal]:
        uid = pod["metadata"]["uid"]
        if uid not in self._requests:
            self._requests[uid] = pod_requests(pod)
        return self._requests[uid]

    def schedule_pending(self) -> None:
        """One pass: try every pending pod, oldest first (as they are now: the queue is only who to look at)."""
        pending = []
        for key in list(self._pending):
            try:
                pod = self.store.read("pods", key[0], key[1])
            except ApiError:            # deleted; its DELETED event is on its way
                pod = None
            if pod is not None and _is_pending(pod):
                pending.append(pod)
            else:
                self._pending.discard(key)
        if not pending:
            return
        pending.sort(key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]))
        nodes = sorted(self.store.peek("nodes"), key=lambda n: n["metadata"]["name"])
        used: dict[str, Counter] = {n["metadata"]["name"]: Counter() for n in nodes}
        for pod in self.store.peek("pods"):
            if _occupies(pod) and pod["spec"]["nodeName"] in used:
                with _isolated(f"pod {_ref(pod)}"):
                    used[pod["spec"]["nodeName"]].update(self._pod_requests(pod))
        for pod in pending:
            with _isolated(f"pod {_ref(pod)}"):     # one object the API should have refused never stalls the rest
                self._schedule_one(pod, nodes, used)

    def _schedule_one(self, pod: dict, nodes: list[dict], used: dict[str, Counter]) -> None:
        requests = self._pod_requests(pod)
        reasons: Counter = Counter()
        fitting = []
        for node in nodes:
            why = ["node(s) could not be evaluated"]
            with _isolated(f"pod {_ref(pod)} or node {_ref(node)}"):
                why = filter_node(pod, requests, node, used[node["metadata"]["name"]])
            if why:
                reasons.update(why)
            else:
                fitting.append(node)
        meta = pod["metadata"]
        if fitting:
            # nodes come sorted by name, and max keeps the first best: ties go to the first name
            best = max(fitting, key=lambda n: _least_allocated(n, used[n["metadata"]["name"]], requests))
            node_name = best["metadata"]["name"]
            try:
                bound = self.store.bind(meta["namespace"], meta["name"], node_name)
            except ApiError as err:   # deleted or bound meanwhile: nothing to do
                log.debug("binding %s/%s skipped: %s", meta["namespace"], meta["name"], err.message)
                return
            used[node_name].update(requests)
            self.store.record_event(bound, "Scheduled", f"Successfully assigned {meta['namespace']}/{meta['name']} "
                                                        f"to {node_name}", component=SCHEDULER_NAME)
            return
        message = unschedulable_message(len(nodes), reasons)
        current = next((c for c in (pod.get("status") or {}).get("conditions") or []
                        if c.get("type") == "PodScheduled"), None)
        if current and current.get("status") == "False" and current.get("message") == message:
            return   # nothing changed since the last attempt

        def mark(p: dict) -> None:
            conditions = [c for c in p.setdefault("status", {}).get("conditions") or [] if c.get("type") != "PodScheduled"]
            p["status"]["conditions"] = [*conditions, {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message, "lastProbeTime": None, "lastTransitionTime": now_rfc3339()}]
        updated = self.store.mutate("pods", meta["namespace"], meta["name"], mark)
        self.store.record_event(updated, "FailedScheduling", message, "Warning", component=SCHEDULER_NAME)

"""What the GPU-fleet page shows, assembled from what placement reads (pure: no I/O, no Airflow).

The Airflow side (gpuboot.ui.fleet_api) reads one survey (gpuboot.lifecycle.booking.survey: Nodes, active pods,
their ECS instances and types, joined by gpuboot.core.inventory) and the ledger; this module turns them
into the page's JSON: every node with its state and GPU counts, boots in progress with their
timeline, live reservations, marks (offerings out of stock, nodes that failed to boot) and, for one
DAG run, its placement table and boot timeline from the steps' XComs.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence

from gpuboot.core.inventory import node_condition, parse_time
from gpuboot.core.model import ANNOTATION_IDLE_SINCE, NodeState, NodeView, Reservation, Unavailable
from gpuboot.core.placement import Plan
from gpuboot.ui.run_timeline import run_timeline

BOOT_STEPS = ("start requested", "Running", "Ready", "GPUs registered")


def price_of(view: NodeView) -> float | None:
    """The node's price per hour as the inventory knows it today (node label/annotation or the instance
    type's PricePerHour): the one place the page reads a price, to swap when placement gets its own."""
    return view.price_per_hour


def _gpu_counts(view: NodeView, reserved: int) -> dict:
    total, allocated = view.allocatable.gpus, view.allocated.gpus
    reserved = min(reserved, allocated)
    return {"total": total, "used": allocated - reserved, "reserved": reserved, "free": max(0, total - allocated)}


def _unbacked(reservations: Iterable[Reservation], backed: Iterable[tuple[str, str, str]],
              now: float) -> list[Reservation]:
    """Live reservations whose pod is not bound yet (a bound pod counts as used, not reserved)."""
    backed = set(backed)
    return [r for r in reservations if r.expires_at > now and (r.node, r.job_id, r.task) not in backed]


def observe_gpus(seen: Mapping[str, float], views: Sequence[NodeView], now: float) -> dict[str, float]:
    """When each node was first seen READY with its GPUs registered (the Node object keeps no time for the
    device plugin's registration, so the page's own first sighting stands in); forgotten once it is not."""
    return {v.name: seen.get(v.name, now) for v in views if v.state == NodeState.READY and v.allocatable.gpus}


def boot_timeline(requested_at: float | None, instance: Mapping | None, node: Mapping | None,
                  gpus_seen_at: float | None) -> list[dict]:
    """The four moments of a boot, each with its time (None: not yet): start requested, ECS Running,
    kubelet Ready after this start, GPUs registered (first seen)."""
    instance, node = instance or {}, node or {}
    running = parse_time(instance.get("StartTime")) if instance.get("Status") == "Running" else None
    ready_condition = node_condition(node)
    ready = parse_time(ready_condition.get("lastTransitionTime")) if ready_condition.get("status") == "True" else None
    if requested_at is not None:
        # a Ready or a StartTime from before this start belongs to the previous boot; ECS StartTime has
        # minute precision, so one up to a minute early is this start's, shown no earlier than the request
        running = max(running, requested_at) if running is not None and running >= requested_at - 60 else None
        ready = ready if ready is not None and ready >= requested_at and running is not None else None
    gpus = gpus_seen_at if ready is not None else None
    return [{"step": step, "at": at} for step, at in zip(BOOT_STEPS, (requested_at, running, ready, gpus))]


# GPUs of a node by what its state makes of them (a READY node's split into running / reserved / free)
_GPU_BUCKET = {NodeState.BOOTING: "booting", NodeState.STOPPED: "stopped", NodeState.STOPPING: "stopped",
               NodeState.UNAVAILABLE: "unavailable"}
SPENDING = (NodeState.READY, NodeState.BOOTING)     # states whose instance is up and billed
COUNTDOWNS = ("expires_in_seconds", "left_seconds")   # fields that change every second: not a change


def fleet_totals(rows: Sequence[Mapping]) -> dict:
    """The page's header: GPUs per model (total = running + reserved + free + stopped + booting +
    unavailable) and the money: USD per hour of the instances up now, and of it what pays for GPUs
    nobody uses or holds (a running node's price x its free share of GPUs)."""
    models: dict[str, dict[str, int]] = {}
    spending = idle = 0.0
    unpriced = 0
    for n in rows:
        gpus, state = n["gpus"], NodeState(n["state"])
        if gpus["total"]:
            t = models.setdefault(n["gpu_model"] or "unknown", dict.fromkeys(
                ("total", "running", "reserved", "free", "stopped", "booting", "unavailable"), 0))
            t["total"] += gpus["total"]
            if state == NodeState.READY:
                t["running"] += gpus["used"]
                t["reserved"] += gpus["reserved"]
                t["free"] += gpus["free"]
            else:
                t[_GPU_BUCKET[state]] += gpus["total"]
        if state in SPENDING:
            price = n["price_per_hour"]
            if price is None:
                unpriced += 1
                continue
            spending += price
            if state == NodeState.READY and gpus["total"]:
                idle += price * gpus["free"] / gpus["total"]
    return {"gpus": dict(sorted(models.items())), "usd_per_hour": round(spending, 4),
            "idle_usd_per_hour": round(idle, 4), "unpriced_nodes_up": unpriced}


def etag_of(data: Mapping) -> str:
    """A weak ETag of the page's JSON: equal whenever nothing but the clock moved (the read time, the
    survey count and the countdowns the page computes from their deadlines), so a poll of an
    unchanged fleet is answered 304 with no body."""
    def stable(value):
        if isinstance(value, Mapping):
            return {k: stable(v) for k, v in value.items() if k not in COUNTDOWNS}
        if isinstance(value, list):
            return [stable(v) for v in value]
        return value

    body = {k: stable(v) for k, v in data.items() if k not in ("generated_at", "surveys")}
    digest = hashlib.blake2b(json.dumps(body, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()
    return f'W/"{digest}"'


def fleet_view(views: Sequence[NodeView], nodes: Sequence[Mapping], *, reservations: Sequence[Reservation],
               backed: Iterable[tuple[str, str, str]], marks: Sequence[Unavailable],
               starts: Mapping[str, tuple[str, float]], instances: Mapping[str, Mapping],
               gpus_seen: Mapping[str, float], now: float, recent_seconds: float = 600) -> dict:
    """The page's JSON. Every live reservation is listed (`pod_bound`: its pod runs, so its GPUs count as
    used, not reserved). `starts`: node -> (job id, start requested at) from the ledger's job records;
    `instances`: instance id -> DescribeInstances entry (for StartTime); a boot stays listed while the node
    is booting, or for `recent_seconds` after a job's start request until its timeline is complete."""
    raw = {(n.get("metadata") or {}).get("name"): n for n in nodes}
    backed = set(backed)
    live = [r for r in reservations if r.expires_at > now]
    reserved_gpus: dict[str, int] = {}
    for r in _unbacked(live, backed, now):
        reserved_gpus[r.node] = reserved_gpus.get(r.node, 0) + r.resources.gpus

    rows, boots = [], []
    for v in sorted(views, key=lambda v: v.name):
        node = raw.get(v.name) or {}
        annotations = (node.get("metadata") or {}).get("annotations") or {}
        rows.append({
            "name": v.name, "state": v.state.value, "reason": v.reason, "gpus": _gpu_counts(v, reserved_gpus.get(v.name, 0)),
            "gpu_model": v.gpu_model, "instance_type": v.instance_type, "instance_id": v.instance_id, "zone": v.zone,
            "price_per_hour": price_of(v), "managed": v.managed, "idle_since": parse_time(annotations.get(ANNOTATION_IDLE_SINCE)),
            "holders": list(v.holders),
        })
        job_id, requested_at = starts.get(v.name, (None, None))
        recent = requested_at is not None and now - requested_at <= recent_seconds
        if v.state != NodeState.BOOTING and not recent:
            continue
        timeline = boot_timeline(requested_at, instances.get(v.instance_id or ""), node, gpus_seen.get(v.name))
        done = all(step["at"] is not None for step in timeline)
        if v.state == NodeState.BOOTING or not done or now - (timeline[-1]["at"] or now) <= 60:
            boots.append({"node": v.name, "job_id": job_id, "state": v.state.value, "reason": v.reason,
                          "timeline": timeline, "done": done})

    return {
        "generated_at": now,
        "totals": fleet_totals(rows),
        "nodes": rows,
        "boots": boots,
        "reservations": [{"job_id": r.job_id, "task": r.task, "node": r.node, "gpus": r.resources.gpus,
                          "pod_bound": (r.node, r.job_id, r.task) in backed,
                          "requests": r.resources.to_json(), "expires_at": r.expires_at,
                          "expires_in_seconds": round(r.expires_at - now)}
                         for r in sorted(live, key=lambda r: (r.node, r.job_id, r.task))],
        "out_of_stock": [{"instance_type": m.instance_type, "zone": m.zone, "reason": m.reason,
                          "expires_at": m.expires_at, "left_seconds": round(m.expires_at - now)}
                         for m in marks if m.node is None and m.expires_at > now],
        "node_marks": [{"node": m.node, "reason": m.reason, "expires_at": m.expires_at,
                        "left_seconds": round(m.expires_at - now)}
                       for m in marks if m.node is not None and m.expires_at > now],
    }


def _evidence_of(evidence: Mapping, node: str | None) -> Mapping | None:
    """The readiness evidence of `node` in the sensor's XCom "evidence": node -> its evidence (one
    entry per node of the plan)."""
    seen = evidence.get(node) if node else None
    return seen if isinstance(seen, Mapping) else None


def run_view(xcoms: Mapping[str, Mapping[str, object]], tasks: Sequence[Mapping]) -> dict:
    """One DAG run's placement table and boot timeline from its steps' XComs (task id -> key -> value):
    the plan `place` returned, the boots `start` recorded, the readiness evidence `wait_gpu_ready` kept."""
    def find(short: str, key: str):
        for task_id, values in sorted(xcoms.items()):
            if task_id.rsplit(".", 1)[-1] == short and values.get(key) is not None:
                return values[key]
        return None

    plan_json = find("place", "return_value")
    plan = Plan.from_json(plan_json) if isinstance(plan_json, Mapping) else None
    final = find("wait_gpu_ready", "plan") or find("start", "plan") or plan_json
    evidence = find("wait_gpu_ready", "evidence") or {}
    boots = []
    for boot in find("start", "baselines") or find("start", "boots") or ():   # "boots": runs of gpuboot 0.1
        seen = _evidence_of(evidence, boot.get("node"))
        boots.append({"node": boot.get("node"), "start_requested_at": boot.get("start_requested_at"),
                      "gpus_needed": boot.get("gpus_needed"),
                      "ready_since": parse_time(seen.get("ready_since")) if seen else None,
                      "evidence": dict(seen) if seen else None})
    return {
        "timeline": run_timeline(tasks, plan_json if isinstance(plan_json, Mapping) else None,
                                 find("start", "baselines") or find("start", "boots") or (), evidence,
                                 find("launch", "pods") or ()),
        "placement": None if plan is None else {
            "outcome": plan.outcome.value, "message": plan.message, "table": plan.table(),
            "candidates": plan_json.get("candidates", []), "candidates_omitted": plan_json.get("candidates_omitted", 0),
            "nodes_to_start": list(plan.nodes_to_start)},
        "assignments": (final or {}).get("assignments", []) if isinstance(final, Mapping) else [],
        "boots": boots,
        "tasks": [{"task_id": t.get("task_id"), "state": t.get("state"), "start_date": t.get("start_date"),
                   "end_date": t.get("end_date")} for t in tasks],
    }

"""The run page's timeline: each node's path through one DAG run, its waits and what it cost (pure).

Read from what the steps already keep (their XComs and task instances), so any finished or running
run can be drawn: the place step's end (placed), the readiness wait's evidence per node with the
trigger's boot clock (start requested, instance up, kubelet Ready, the GPU count's steps, GPU-ready;
and the nodes the job left), the launch step's pod times (bound, running, finished), and the node's
price from the plan's candidate facts. The page draws it (fleet.html, SVG); this module only says
what happened when, so every figure is tested here.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from gpuboot.core.inventory import parse_time

HOUR = 3600.0
# the waits a person asks about, in the order they happen, each from one moment to the next
WAITS = (("queue", "run started", "placed"), ("boot", "start requested", "NodeReady"),
         ("device plugin", "NodeReady", "GPUs registered"), ("detection", "GPUs registered", "GPUs seen"),
         ("settle", "GPUs seen", "GPU-ready"), ("launch", "GPU-ready", "Running"), ("run", "Running", "finished"))
# "GPUs seen": when gpuboot's wait saw the registration, the verdict's time less what it held the count
# (the settle window). Later than the registration when the wait itself started or ran late (a busy
# triggerer replays the boot from its watch): that gap is "detection", not settle.
SEEN_LATE_SECONDS = 0.5


def iso_epoch(value: str | None) -> float | None:
    """An Airflow ISO 8601 date (task start/end) as epoch seconds."""
    return None if not value else datetime.fromisoformat(value).timestamp()


def _task(tasks: Sequence[Mapping], short: str) -> Mapping:
    return next((t for t in tasks if str(t.get("task_id", "")).rsplit(".", 1)[-1] == short), {})


def _price(candidates: Sequence[Mapping], node: str) -> float | None:
    """The node's USD per hour as placement saw it (the candidate's facts), None when unpriced."""
    for c in candidates:
        if c.get("node") == node and (c.get("facts") or {}).get("price_per_hour") is not None:
            return float(c["facts"]["price_per_hour"])
    return None


def gpu_steps(clock: Mapping, booted: bool) -> list[dict]:
    """The GPU count's changes as the watch saw them, each named: before the kubelet's reset a
    booted node's count is the previous boot's (stale), then 0, then the real count."""
    steps, reset = [], False
    for at, count in clock.get("gpus") or ():
        reset = reset or (booted and count == 0)
        label = "reset" if booted and count == 0 else "registered" if reset or not booted else "stale"
        steps.append({"at": at, "count": int(count), "label": label})
    return steps


def _node_path(node: str, evidence: Mapping, baseline: Mapping, pods: Sequence[Mapping], placed: float | None,
               run_started: float | None, wait_end: float | None, price: float | None) -> dict:
    clock = evidence.get("boot") or {}
    marks = clock.get("marks") or {}
    requested = evidence.get("start_requested_at", baseline.get("start_requested_at"))
    booted = requested is not None
    mine = [p for p in pods if p.get("node") == node]
    bound = min((p["bound_at"] for p in mine if p.get("bound_at") is not None), default=None)
    running = min((p["running_at"] for p in mine if p.get("running_at") is not None), default=None)
    finished = max((p["finished_at"] for p in mine if p.get("finished_at") is not None), default=None)
    ready = marks.get("ready") or (parse_time(evidence.get("ready_since")) if booted else None)
    moments = {"run started": run_started, "placed": placed, "start requested": requested,
               "instance Running": marks.get("up"), "NodeReady": ready,
               "GPUs registered": marks.get("registered"), "GPUs seen": None, "GPU-ready": marks.get("fired"),
               "left": evidence.get("left_at") if evidence.get("left") else None,
               "pod bound": bound, "Running": running, "finished": finished}
    fired, registered, held = marks.get("fired"), marks.get("registered"), evidence.get("held_seconds")
    seen = None if None in (fired, registered, held) else fired - held
    moments["GPUs seen"] = seen if seen is not None and seen - registered > SEEN_LATE_SECONDS else registered
    if not booted:          # up when the job chose it: no boot to tell
        for step in ("start requested", "instance Running", "NodeReady"):
            moments.pop(step)
    if evidence.get("left"):      # what it never reached is not pending: the job moved on
        moments = {step: at for step, at in moments.items() if at is not None or step == "run started"}
    else:
        moments.pop("left")
    waits = [{"wait": wait, "from": moments[a], "to": moments[b], "seconds": round(moments[b] - moments[a], 1)}
             for wait, a, b in WAITS if moments.get(a) is not None and moments.get(b) is not None
             and not (wait == "detection" and moments[a] == moments[b])]
    # the hours the run kept the node up: from the start request when it booted it (boot
    # included), else from its pod's binding; to the pod's end, the job leaving it, or the wait's end
    held_from = requested if booted else bound
    held_to = finished or moments.get("left") or (wait_end if not mine else None)
    hours = None if held_from is None or held_to is None else max(0.0, held_to - held_from) / HOUR
    return {
        "node": node, "booted": booted, "left": evidence.get("left"),
        "outcome": ("left" if evidence.get("left") else
                    next((p.get("phase") for p in mine if p.get("phase") == "Failed"), None) or
                    (mine[0].get("phase") if mine else "waiting")),
        "moments": [{"step": step, "at": at} for step, at in moments.items()
                    if step != "run started" and not (step == "GPUs seen" and at == moments.get("GPUs registered"))],
        "gpus": gpu_steps(clock, booted),
        "waits": waits,
        "price_per_hour": price, "hours": None if hours is None else round(hours, 4),
        "cost_usd": None if hours is None or price is None else round(hours * price, 4),
    }


def run_timeline(tasks: Sequence[Mapping], placement: Mapping | None, baselines: Sequence[Mapping],
                 evidence: Mapping[str, Mapping], pods: Sequence[Mapping]) -> dict:
    """Every node of the run (those it booted or used, those it left) with its moments, waits and
    cost; the run's span and total cost. `placement`: the place step's plan JSON."""
    place, wait = _task(tasks, "place"), _task(tasks, "wait_gpu_ready")
    placed, run_started = iso_epoch(place.get("end_date")), iso_epoch(place.get("start_date"))
    candidates = (placement or {}).get("candidates") or []
    by_node = {b.get("node"): b for b in baselines}
    first = set(by_node) | {a.get("node") for a in (placement or {}).get("assignments") or ()}
    names = list(dict.fromkeys([*by_node, *evidence, *(p.get("node") for p in pods)]))
    paths = []
    for node in names:
        if node is None:
            continue
        seen = evidence.get(node) or {}
        # a node the job moved to was placed when it left the one before
        placed_at = placed if node in first else max((e.get("left_at") or 0 for e in evidence.values()
                                                       if e.get("left")), default=None) or None
        paths.append(_node_path(node, seen, by_node.get(node) or {}, pods, placed_at,
                                run_started if node in first else None, iso_epoch(wait.get("end_date")),
                                _price(candidates, node)))
    times = [m["at"] for p in paths for m in p["moments"] if m["at"] is not None] + \
        ([run_started] if run_started is not None else [])
    costs = [p["cost_usd"] for p in paths]
    return {"nodes": paths, "from": min(times, default=None), "to": max(times, default=None),
            "cost_usd": None if not paths or None in costs else round(sum(costs), 4)}

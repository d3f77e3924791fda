"""What each step tells a person: one summary line, readable UTC times, the readiness evidence as
a short aligned block, and the phases of a boot. Pure (no I/O): the steps log these lines and push
them as XCom "summary" (Airflow 3.3's Task SDK gives a task no way to set its own note).

A boot's phases come from what the readiness trigger saw (`BootClock`, fed every verdict):

    start requested -> instance up (first status written by the new boot) -> kubelet Ready
    -> GPUs registered (the count covers the request after the kubelet's reset) -> settled (fired)

Times are when the node wrote each state (its kubelet's Ready heartbeat, renewed by every status
write) when the trigger watches a boot it replays from before the start (GpuWait.written_at), so a
trigger that started after the boot still dates each phase; otherwise when the trigger observed it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpuboot.core.inventory import parse_time
from gpuboot.core.timefmt import duration, utc

HOLDING = ("Settling", "Fallback")   # readiness codes of a node whose state holds, waiting out a window
PHASES = (("up", "instance up"), ("ready", "kubelet Ready"), ("registered", "GPUs registered"),
          ("fired", "settled"))
MAX_GPU_STEPS = 8    # changes of the GPU count kept per boot (stale -> 0 -> real is three)


class BootClock:
    """When each phase of one node's boot was first observed (see the module doc)."""

    def __init__(self, start_requested_at: float | None, marks: Mapping[str, float] | None = None,
                 gpus: Iterable[Iterable[float]] = ()) -> None:
        self.start_requested_at = start_requested_at
        self.marks: dict[str, float] = dict(marks or {})
        # [at, allocatable GPUs] at each change of the count: the run page draws stale -> 0 -> real
        self.gpus: list[list[float]] = [list(g) for g in gpus]

    def observe(self, verdict, now: float, written_at: float | None = None) -> None:
        """Note the phases a `Readiness` (gpuboot.core.readiness) read at time `now` shows reached;
        `written_at`: when the node wrote that state, if known (GpuWait.written_at), dates the
        node's phases; "fired" is gpuboot's own verdict, at `now`."""
        at = now if written_at is None else written_at
        evidence = verdict.evidence or {}
        count = evidence.get("gpus_allocatable")
        if count is not None and (not self.gpus or self.gpus[-1][1] != count) and len(self.gpus) < MAX_GPU_STEPS:
            self.gpus.append([at, int(count)])
        if evidence.get("fresh"):
            self.marks.setdefault("up", at)
            if evidence.get("ready") == "True":
                self.marks.setdefault("ready", at)
        holding = verdict.ready or verdict.code in HOLDING
        if holding and evidence.get("held_seconds") is not None:   # the rule holds: only the window is left
            self.marks.setdefault("registered", at - float(evidence["held_seconds"]))
        if verdict.ready:
            self.marks.setdefault("fired", now)

    def to_json(self) -> dict:
        return {"start_requested_at": self.start_requested_at, "marks": dict(self.marks), "gpus": list(self.gpus)}

    @classmethod
    def from_json(cls, data: Mapping | None) -> BootClock:
        data = data or {}
        return cls(data.get("start_requested_at"), data.get("marks"), data.get("gpus") or ())

    def phases(self) -> list[tuple[str, float]]:
        """(label, seconds) of each phase seen, in order, each from the end of the one before."""
        out, last = [], self.start_requested_at
        for key, label in PHASES:
            at = self.marks.get(key)
            if at is None:
                continue
            if last is not None:
                out.append((label, max(0.0, at - last)))
            last = at if last is None else max(last, at)
        return out


def boot_summary(node: str, clock: BootClock, fired_at: float | None = None) -> str:
    """`booted gpu-t4x2-1 in 17.2 s (instance up 3.1 s, kubelet Ready 4.0 s, GPUs registered 5.1 s,
    settled 5.0 s)`, or, for a node that was up when the job chose it, how long the check took."""
    fired = clock.marks.get("fired", fired_at)
    if clock.start_requested_at is None:
        return f"{node} was already up: GPU-ready" + (f" at {utc(fired)}" if fired is not None else "")
    total = None if fired is None else fired - clock.start_requested_at
    # the fast path fires as the GPUs register: no settle phase to tell (the fallback has one)
    phases = ", ".join(f"{label} {duration(s)}" for label, s in clock.phases() if not (label == "settled" and s < 0.05))
    return f"booted {node} in {duration(total)}" + (f" ({phases})" if phases else "")


def evidence_block(evidence: Mapping[str, Any], indent: str = "  ") -> str:
    """The readiness evidence as a few aligned lines: what a person checks, in their units."""
    if not evidence:
        return f"{indent}nothing was read"
    rows: list[tuple[str, str]] = []
    ready = evidence.get("ready", "?")
    since = evidence.get("ready_since")
    rows.append(("Ready", f"{ready}" + (f" since {utc(parse_time(since))}" if since else "")))
    needed = int(evidence.get("gpus_needed") or 0)
    counts = dict(evidence.get("allocatable") or {})
    if needed or evidence.get("gpus_allocatable") is not None:
        counts.setdefault("nvidia.com/gpu", evidence.get("gpus_allocatable"))
    reset = set(evidence.get("reset_seen") or ())
    for resource, count in counts.items():
        want = needed if resource == "nvidia.com/gpu" else None
        detail = f"{count if count is not None else 'none'} allocatable"
        if want:
            detail += f", {want} needed"
        if evidence.get("start_requested_at") is not None:
            detail += ", reset after the start seen" if resource in reset else ", reset not seen yet"
        rows.append((resource, detail))
    before, now = evidence.get("boot_id_before"), evidence.get("boot_id")
    if before or now:
        changed = "changed" if evidence.get("boot_id_changed") else "unchanged"
        rows.append(("bootID", f"{_short(before)} -> {_short(now)} ({changed})" if before else _short(now)))
    if evidence.get("start_requested_at") is not None:
        rows.append(("start requested", utc(evidence["start_requested_at"])))
    if evidence.get("fresh_by"):
        rows.append(("this boot's", str(evidence["fresh_by"])))
    if evidence.get("heartbeat_age_seconds") is not None:
        rows.append(("heartbeat", f"{duration(evidence['heartbeat_age_seconds'])} ago"))
    if evidence.get("taints") or evidence.get("unschedulable"):
        blocked = [*(evidence.get("taints") or ()), *(["cordoned"] if evidence.get("unschedulable") else [])]
        rows.append(("blocked by", ", ".join(blocked)))
    if evidence.get("held_seconds") is not None:
        window = evidence.get("settle_seconds")
        rows.append(("held", f"{duration(evidence['held_seconds'])}" + (f" of {duration(window)}" if window else "")
                     + (f" ({evidence['path']})" if evidence.get("path") else "")))
    if evidence.get("warning"):
        rows.append(("warning", str(evidence["warning"])))
    return table(rows, indent)


def table(rows: Iterable[tuple[str, str]], indent: str = "  ") -> str:
    rows = list(rows)
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{indent}{k.ljust(width)}  {v}" for k, v in rows)


def _short(boot_id: str | None) -> str:
    return "-" if not boot_id else (boot_id if len(boot_id) <= 12 else boot_id[:8] + "…")


def _where(assignments) -> str:
    return ", ".join(f"{a.task} on {a.node} ({a.state.value})" for a in assignments) or "nothing"


def place_summary(name: str, plan, elapsed: float) -> str:
    """`placed demo-train in 0.4 s: demo-train on gpu-t4x2-1 (stopped) with cpu=2 memory=8Gi
    nvidia.com/gpu=2; to start: gpu-t4x2-1` (a FITS Plan of gpuboot.core.placement)."""
    first = plan.assignments[0].requests if plan.assignments else None
    per_task = f" with {first}" if first is not None else ""
    start = f"; to start: {', '.join(plan.nodes_to_start)}" if plan.nodes_to_start else "; nothing to start"
    return f"placed {name} in {duration(elapsed)}: {_where(plan.assignments)}{per_task}{start}"


def start_summary(boots: Iterable[Mapping], started: Iterable[str], elapsed: float) -> str:
    """`start requested for gpu-t4x2-1 at 2026-12-01 16:40:03Z (i-0abc) in 0.3 s; gpu-run already up`."""
    boots = list(boots)
    asked = [b for b in boots if b.get("start_requested_at") is not None]
    up = [b["node"] for b in boots if b.get("start_requested_at") is None]
    parts = [f"start requested for {b['node']} at {utc(b['start_requested_at'])}" for b in asked]
    if not boots:
        parts = ["nothing to start"]
    line = "; ".join(parts + ([f"already up: {', '.join(up)}"] if up else []))
    started = list(started)
    return line + f" ({len(started)} StartInstances accepted in this try, {duration(elapsed)})"


def launch_summary(task: str, node: str, pod: str | None, phase: str | None, elapsed: float,
                   exit_code: int | None = None) -> str:
    """`ran demo-train on gpu-t4x2-1: pod demo-train-x1 Succeeded (exit code 0) in 12.3 s`."""
    how = f"pod {pod} {phase or 'finished'}" if pod else "pod not created"
    code = f" (exit code {exit_code})" if exit_code is not None else ""
    return f"ran {task} on {node}: {how}{code} in {duration(elapsed)}"

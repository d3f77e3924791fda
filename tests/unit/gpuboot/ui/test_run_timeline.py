"""The run page's timeline (gpuboot.ui.run_timeline through run_view): every moment, wait and cost
filled for a run that booted a node, one on a node already running, one whose pod failed, and one
re-placed after its first node never became GPU-ready."""
from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpuboot.core.inventory import build_inventory
from gpuboot.core.placement import JobRequest, TaskRequest, place
from gpuboot.core.resources import Resources
from gpuboot.ui.fleet_view import run_view
from tests.builders import TYPES, instance, iso, node

T = 1_800_000_000.0
PRICE = {"s": 4.2, "r": 1.5, "a": 2.0, "b": 3.0}


def when(epoch: float) -> str:
    """A task instance's date as the API hands it to run_view (ISO 8601 with microseconds)."""
    return datetime.fromtimestamp(epoch, UTC).isoformat()


def plan_for(name: str, state: str):
    """The place step's plan on one node of the given state, priced by its label."""
    labels = {"gpuboot.io/price-per-hour": str(PRICE[name])}
    if state == "stopped":
        nodes, insts = [node(name, gpus=2, ready="Unknown", labels=labels)], [instance(name, "Stopped", gpus=2)]
    else:
        nodes, insts = [node(name, gpus=2, heartbeat=T, labels=labels)], [instance(name, start=T - 3600, gpus=2)]
    views = build_inventory(nodes, [], insts, TYPES, [], T)
    return place(JobRequest("gb-1", (TaskRequest("train", Resources({"nvidia.com/gpu": 2})),), 1), views).to_json()


def tasks(place_end: float, wait_end: float) -> list[dict]:
    return [{"task_id": "gpu_job.place", "state": "success", "start_date": when(T), "end_date": when(place_end)},
            {"task_id": "gpu_job.wait_gpu_ready", "state": "success", "start_date": when(place_end + 1),
             "end_date": when(wait_end)}]


def boot(requested: float | None, marks: dict, gpus: list) -> dict:
    """The trigger's boot clock (BootClock.to_json) as the sensor keeps it in the evidence."""
    return {"start_requested_at": requested, "marks": marks, "gpus": gpus}


def pod(node_name: str, phase: str, bound: float, running: float, finished: float | None) -> dict:
    return {"pod": f"train-{node_name}", "node": node_name, "phase": phase, "bound_at": bound,
            "running_at": running, "finished_at": finished}


def timeline(plan: dict, baselines: list, evidence: dict, pods: list, wait_end: float) -> dict:
    xcoms = {"gpu_job.place": {"return_value": plan}, "gpu_job.start": {"baselines": baselines},
             "gpu_job.wait_gpu_ready": {"evidence": evidence}, "gpu_job.launch": {"pods": pods}}
    return run_view(xcoms, tasks(T + 0.5, wait_end))["timeline"]


def waits(path: dict) -> dict:
    return {w["wait"]: w["seconds"] for w in path["waits"]}


def booted_evidence(name: str, requested: float, left: str | None = None) -> dict:
    ready = {} if left else {"ready": requested + 18, "registered": requested + 23, "fired": requested + 28}
    seen = {"start_requested_at": requested, "ready_since": iso(requested + 18),
            "boot": boot(requested, {"up": requested + 6, **ready},
                         [[requested + 1, 2]] + ([] if left else [[requested + 18, 0], [requested + 23, 2]]))}
    return {**seen, "left": left, "left_at": requested + 598} if left else seen


def test_a_booted_run_has_every_moment_each_wait_and_its_cost_boot_included():
    data = timeline(plan_for("s", "stopped"), [{"node": "s", "start_requested_at": T + 2, "gpus_needed": 2}],
                    {"s": booted_evidence("s", T + 2)}, [pod("s", "Succeeded", T + 32, T + 35, T + 95)], T + 31)
    [path] = data["nodes"]
    assert path["booted"] and path["outcome"] == "Succeeded" and path["left"] is None
    assert [m["step"] for m in path["moments"]] == ["placed", "start requested", "instance Running", "NodeReady",
                                                    "GPUs registered", "GPU-ready", "pod bound", "Running", "finished"]
    assert all(m["at"] is not None for m in path["moments"])
    assert waits(path) == {"queue": 0.5, "boot": 18.0, "device plugin": 5.0, "settle": 5.0, "launch": 5.0,
                           "run": 60.0}
    # the GPU count as the watch saw it: the previous boot's 2, the kubelet's reset, the real 2
    assert [(g["count"], g["label"]) for g in path["gpus"]] == [(2, "stale"), (0, "reset"), (2, "registered")]
    # from the start request to the pod's end: 93 s of a 4.2 USD/h node
    assert path["price_per_hour"] == 4.2 and path["hours"] == pytest.approx(93 / 3600, abs=1e-4)
    assert data["cost_usd"] == path["cost_usd"] == pytest.approx(4.2 * 93 / 3600, abs=1e-4)
    assert (data["from"], data["to"]) == (T, T + 95)


def test_a_wait_that_saw_the_registration_late_shows_that_as_detection_not_settle():
    """The verdict fired 60 s after the GPUs registered, holding the count 2 s: 58 s went by before
    gpuboot's wait saw them (a triggerer busy elsewhere), only 2 s were the settle window."""
    evidence = booted_evidence("s", T + 2)
    evidence["boot"]["marks"]["fired"] = T + 2 + 23 + 60
    evidence["held_seconds"] = 2.0
    data = timeline(plan_for("s", "stopped"), [{"node": "s", "start_requested_at": T + 2, "gpus_needed": 2}],
                    {"s": evidence}, [pod("s", "Succeeded", T + 90, T + 91, T + 120)], T + 89)
    [path] = data["nodes"]
    assert waits(path)["detection"] == 58.0 and waits(path)["settle"] == 2.0
    steps = [m["step"] for m in path["moments"]]
    assert steps.index("GPUs registered") + 1 == steps.index("GPUs seen") == steps.index("GPU-ready") - 1


def test_a_run_on_a_running_node_has_no_boot_and_pays_from_its_pod_binding():
    evidence = {"r": {"start_requested_at": None, "boot": boot(None, {"registered": T + 3, "fired": T + 8}, [[T + 3, 2]])}}
    data = timeline(plan_for("r", "ready"), [{"node": "r", "start_requested_at": None, "gpus_needed": 2}], evidence,
                    [pod("r", "Succeeded", T + 10, T + 11, T + 41)], T + 9)
    [path] = data["nodes"]
    assert not path["booted"]
    assert [m["step"] for m in path["moments"]] == ["placed", "GPUs registered", "GPU-ready", "pod bound", "Running",
                                                    "finished"]
    assert waits(path) == {"queue": 0.5, "settle": 5.0, "launch": 3.0, "run": 30.0}
    assert [(g["count"], g["label"]) for g in path["gpus"]] == [(2, "registered")]
    assert path["cost_usd"] == pytest.approx(1.5 * 31 / 3600, abs=1e-4)


def test_a_failed_run_ends_where_its_pod_failed_and_still_has_its_cost():
    data = timeline(plan_for("s", "stopped"), [{"node": "s", "start_requested_at": T + 2, "gpus_needed": 2}],
                    {"s": booted_evidence("s", T + 2)}, [pod("s", "Failed", T + 32, T + 35, T + 40)], T + 31)
    [path] = data["nodes"]
    assert path["outcome"] == "Failed" and waits(path)["run"] == 5.0
    assert all(m["at"] is not None for m in path["moments"])
    assert data["cost_usd"] == pytest.approx(4.2 * 38 / 3600, abs=1e-4)


def test_a_replaced_run_shows_the_node_it_left_and_the_one_it_ran_on_both_paid():
    evidence = {"a": booted_evidence("a", T + 2, left="not GPU-ready within 10 min"),
                "b": booted_evidence("b", T + 601)}
    plan = plan_for("a", "stopped")
    plan["candidates"] += plan_for("b", "stopped")["candidates"]      # b was a candidate too
    data = timeline(plan, [{"node": "a", "start_requested_at": T + 2, "gpus_needed": 2}], evidence,
                    [pod("b", "Succeeded", T + 631, T + 634, T + 694)], T + 630)
    left, ran = data["nodes"]
    assert (left["node"], left["outcome"], left["left"]) == ("a", "left", "not GPU-ready within 10 min")
    assert [m["step"] for m in left["moments"]] == ["placed", "start requested", "instance Running", "NodeReady",
                                                    "left"]
    assert [(g["count"], g["label"]) for g in left["gpus"]] == [(2, "stale")]
    assert left["cost_usd"] == pytest.approx(2.0 * 598 / 3600, abs=1e-4)       # up to when the job left it
    assert (ran["node"], ran["outcome"]) == ("b", "Succeeded")
    assert ran["moments"][0] == {"step": "placed", "at": T + 600}               # placed again as it left a
    assert waits(ran) == {"boot": 18.0, "device plugin": 5.0, "settle": 5.0, "launch": 5.0, "run": 60.0}
    assert data["cost_usd"] == pytest.approx(left["cost_usd"] + ran["cost_usd"], abs=1e-3)

"""Capacity fallback and boot-timeout failover against the local cloud (real ECS SDK and
Kubernetes client; faults injected in simcloud; waits are on conditions, never fixed sleeps)."""
from __future__ import annotations

import logging
import time

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import Unavailable
from gpuboot.core.placement import Outcome
from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.booking import LAUNCH_MARGIN_SECONDS, Booker
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.operators.start import StartGpuNodesOperator
from gpuboot.sensors.gpu_ready import GpuReadySensor
from tests.integration.conftest import (
    T4,
    T4X2,
    SimCloud,
    expose_connections,
    small_fleet,
    wait_until,
    with_job_namespaces,
)
from tests.integration.test_operators import JOB, context, place, run_deferred

ZONE = "cn-hangzhou-h"
FAST_BOOT = {**JOB, "boot_timeout_seconds": 10, "settle_seconds": 1}  # a boot takes ~3s here; slack for a loaded CI


def ledger() -> ReservationLedger:
    return ReservationLedger(KubeClient())


def mark(*marks: Unavailable, job_id: str = "marker") -> None:
    """Write marks the way the product does: in the booking commit of a job that gives up
    (gpuboot.lifecycle.boot: a fail-over out of attempts), retried through conflicts like every booking."""
    Booker(KubeClient(), EcsHook(), ledger(), logging.getLogger("marks")).book(
        None, job_id, marks=marks, release_unplaced=True, place_job=False)


def held(job_id: str) -> list[str]:
    return sorted(r.node for r in ledger().live() if r.job_id == job_id)


def status(cloud, node: str) -> str:
    iid = cloud.instance_id(node)
    return EcsHook().statuses([iid])[iid]


def start(plan: dict, job: dict | None, **kwargs):
    ctx = context("start")
    out = StartGpuNodesOperator(task_id="start", plan=plan, job=job, **kwargs).execute(ctx)
    return out, ctx["ti"].pushed


def starts_of(cloud, node: str) -> int:
    """How many StartInstances took effect on the node's instance (simcloud logs each transition)."""
    return cloud.log_text().count(f"ecs {cloud.instance_id(node)}: Stopped -> Starting")


def logged(capfd) -> str:
    """What the operators logged (Airflow's task logger writes to the captured stdout)."""
    out, err = capfd.readouterr()
    return out + err


def hog_running_node() -> None:
    """Reserve the running 1-GPU node so that 1-GPU jobs must boot a stopped one."""
    plan, _ = place(JOB, job_id="hog")
    assert [a["node"] for a in plan["assignments"]] == ["gpu-run"]


# -- capacity fallback -------------------------------------------------------------------------
def test_no_stock_marks_the_offering_and_moves_the_job_within_the_same_try(cloud, capfd):
    hog_running_node()
    plan, pushed = place(JOB, job_id="job")
    assert plan["nodes_to_start"] == ["gpu-stop"]              # the 1-GPU T4 wastes least
    cloud.set_faults(no_stock=[T4])

    out, xcom = start(plan, pushed["job"])

    assert [a["node"] for a in out["plan"]["assignments"]] == ["gpu2-stop"]
    assert xcom["plan"] == out["plan"] and out["started"] == [cloud.instance_id("gpu2-stop")]
    assert [b["node"] for b in out["baselines"]] == ["gpu2-stop"]
    assert held("job") == ["gpu2-stop"]                        # the old reservation went with the move
    (mark,) = ledger().live_unavailable()
    assert (mark.instance_type, mark.zone) == (T4, ZONE) and "NoStock" in mark.reason
    assert 500 < mark.expires_at - time.time() <= 600
    assert status(cloud, "gpu-stop") == "Stopped"
    assert status(cloud, "gpu2-stop") in ("Starting", "Running")
    assert "re-placed job job (out of capacity" in logged(capfd)


def test_the_capacity_mark_is_shared_by_later_placements_until_it_expires(cloud):
    hog_running_node()
    plan, pushed = place(JOB, job_id="first")
    cloud.set_faults(no_stock=[T4])
    start(plan, pushed["job"])
    cloud.set_faults(no_stock=[])
    # another run, another worker: it reads the mark from the ledger and does not try the T4 offering
    later, _ = place({**JOB, "name": "second"}, job_id="second")
    row = next(c for c in later["candidates"] if c["node"] == "gpu-stop")
    assert row["verdict"] == "excluded" and f"offering {T4} in {ZONE} unavailable" in row["reason"]
    assert [a["node"] for a in later["assignments"]] == ["gpu2-stop"]


def test_when_no_offering_has_stock_start_waits_then_fails_naming_each_one_and_holds_nothing(cloud):
    """Stock may come back (the marks expire), so the job waits up to its queue timeout."""
    hog_running_node()
    plan, pushed = place({**JOB, "queue_timeout_seconds": 8}, job_id="job")   # place and two refused starts: ~1 s idle, 3+ loaded
    cloud.set_faults(no_stock=[T4, T4X2])
    ctx = context("start")
    operator = StartGpuNodesOperator(task_id="start", plan=plan, job=pushed["job"], busy_poll_seconds=0.5)
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(ctx)
    assert held("job") == []
    event = run_deferred(deferred.value)
    with pytest.raises(AirflowFailException) as err:
        while True:
            try:
                operator.resume(ctx, event)
            except TaskDeferred as again:
                event = run_deferred(again)
    text = str(err.value)
    assert "queue_timeout_seconds=8" in text
    assert f"offering {T4} in {ZONE}: OperationDenied.NoStock" in text
    assert f"offering {T4X2} in {ZONE}: OperationDenied.NoStock" in text
    assert held("job") == [] and held("hog") == ["gpu-run"]
    assert {(m.instance_type, m.zone) for m in ledger().live_unavailable()} == {(T4, ZONE), (T4X2, ZONE)}
    assert status(cloud, "gpu-stop") == status(cloud, "gpu2-stop") == "Stopped"


def test_out_of_stock_with_the_rest_busy_waits_holding_nothing_then_runs_when_capacity_frees(cloud):
    hog_running_node()
    plan, pushed = place(JOB, job_id="job")
    place({**JOB, "name": "big", "gpus": 2}, job_id="big")       # holds the 2-GPU node
    cloud.set_faults(no_stock=[T4])
    ctx = context("start")
    operator = StartGpuNodesOperator(task_id="start", plan=plan, job=pushed["job"], busy_poll_seconds=0.5)
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(ctx)
    assert held("job") == [] and held("big") == ["gpu2-stop"]   # waits without promising anything
    assert status(cloud, "gpu-stop") == "Stopped"

    with pytest.raises(TaskDeferred) as again:                   # still busy: waits again
        operator.resume(ctx, run_deferred(deferred.value))
    ledger().release("big")                                      # the 2-GPU node frees up
    out = operator.resume(ctx, run_deferred(again.value))
    assert [a["node"] for a in out["plan"]["assignments"]] == ["gpu2-stop"]
    assert out["started"] == [cloud.instance_id("gpu2-stop")] and held("job") == ["gpu2-stop"]
    assert ctx["ti"].pushed["plan"] == out["plan"]


def test_a_start_retry_whose_reservation_is_gone_waits_while_the_fleet_is_busy(cloud):
    """An earlier try's reservation expired and its node went to another job: the retry waits."""
    hog_running_node()
    plan, pushed = place(JOB, job_id="job")
    place({**JOB, "name": "big", "gpus": 2}, job_id="big")       # holds the 2-GPU node
    ledger().release("job")
    place({**JOB, "name": "other"}, job_id="other")               # takes the job's 1-GPU node
    operator = StartGpuNodesOperator(task_id="start", plan=plan, job=pushed["job"], busy_poll_seconds=0.5)
    with pytest.raises(TaskDeferred):
        operator.execute(context("start"))
    assert held("job") == [] and status(cloud, "gpu-stop") == "Stopped"


def test_capacity_attempts_are_bounded(cloud):
    hog_running_node()
    plan, pushed = place(JOB, job_id="job")
    cloud.set_faults(no_stock=[T4])
    with pytest.raises(AirflowFailException, match=r"gave up after 1 failure\(s\) \(max_attempts=1\)"):
        start(plan, pushed["job"], max_capacity_attempts=1)
    assert held("job") == [] and status(cloud, "gpu2-stop") == "Stopped"


def test_without_the_job_a_capacity_error_fails_and_releases(cloud):
    hog_running_node()
    plan, _ = place(JOB, job_id="job")
    cloud.set_faults(no_stock=[T4])
    with pytest.raises(AirflowFailException, match="no job spec given"):
        start(plan, None)
    assert held("job") == []


def test_a_start_retry_follows_the_ledger_not_the_stale_plan(cloud):
    """A try that fell back to gpu2-stop died before pushing its XCom; the retry gets the place
    step's plan (gpu-stop) again, finds the ledger holds gpu2-stop, and does not start anything twice."""
    hog_running_node()
    plan, pushed = place(JOB, job_id="job")
    cloud.set_faults(no_stock=[T4])
    first, _ = start(plan, pushed["job"])
    cloud.set_faults(no_stock=[])
    again, _ = start(plan, pushed["job"])
    assert [a["node"] for a in again["plan"]["assignments"]] == ["gpu2-stop"]
    assert again["started"] == [] and first["started"] == [cloud.instance_id("gpu2-stop")]
    assert starts_of(cloud, "gpu2-stop") == 1 and starts_of(cloud, "gpu-stop") == 0
    assert status(cloud, "gpu-stop") == "Stopped" and held("job") == ["gpu2-stop"]


def test_an_instance_caught_stopping_is_started_once_stopped(tmp_path, monkeypatch):
    fleet = small_fleet([{"name": "gpu-a", "instance_type": T4, "status": "Running"}],
                        timings={"stop_seconds": 2.0})
    with SimCloud.start(fleet, tmp_path / "sim") as sim:
        with_job_namespaces(sim)
        expose_connections(sim.connections_file, monkeypatch)
        iid = sim.instance_id("gpu-a")
        EcsHook().stop_instances([iid])
        plan, pushed = place(JOB, job_id="job")
        assert plan["assignments"][0]["state"] == "stopping" and plan["nodes_to_start"] == ["gpu-a"]
        out, _ = start(plan, pushed["job"])
        assert out["started"] == [iid]                              # waited for Stopped, then started
        assert EcsHook().statuses([iid])[iid] in ("Starting", "Running")


# -- boot timeout ------------------------------------------------------------------------------
def run_sensor(sensor: GpuReadySensor, ctx: dict) -> list[str]:
    """Drive a deferrable sensor like the triggerer does until it returns (or raises)."""
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(ctx)
    event = run_deferred(deferred.value)
    while True:
        try:
            return sensor.execute_complete(ctx, event)
        except TaskDeferred as again:
            event = run_deferred(again)


@pytest.mark.parametrize("fault", ["never_ready", "device_plugin_never"])
def test_a_node_not_ready_in_time_is_stopped_again_and_the_job_moves(cloud, capfd, fault):
    hog_running_node()
    cloud.set_faults(**{fault: ["gpu-stop"]})
    plan, pushed = place(FAST_BOOT, job_id="job")
    out, _ = start(plan, pushed["job"])
    assert [b["node"] for b in out["baselines"]] == ["gpu-stop"]

    ctx = context("wait")
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"])
    assert run_sensor(sensor, ctx) == ["train"]

    moved = ctx["ti"].pushed["plan"]
    assert [a["node"] for a in moved["assignments"]] == ["gpu2-stop"]
    assert int(ctx["ti"].pushed["evidence"]["gpu2-stop"]["gpus_allocatable"]) == 2
    assert held("job") == ["gpu2-stop"]
    wait_until(lambda: status(cloud, "gpu-stop") == "Stopped", timeout=10)
    (mark,) = ledger().live_unavailable()
    assert mark.node == "gpu-stop" and "not GPU-ready within 10.0 s" in mark.reason
    text = logged(capfd)
    assert "gpu-stop not GPU-ready before the boot timeout" in text
    assert "stopped again (StopCharging): this job started it and no other job claims it" in text


def test_poke_mode_fails_over_the_same_way(cloud):
    hog_running_node()
    cloud.set_faults(never_ready=["gpu-stop"])
    plan, pushed = place(FAST_BOOT, job_id="job")
    out, _ = start(plan, pushed["job"])
    ctx = context("wait")
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"],
                            deferrable=False, poke_interval=0.2)
    assert sensor.execute(ctx) == ["train"]
    assert [a["node"] for a in ctx["ti"].pushed["plan"]["assignments"]] == ["gpu2-stop"]
    assert ctx["ti"].pushed["summary"].startswith("booted gpu2-stop in "), ctx["ti"].pushed["summary"]
    wait_until(lambda: status(cloud, "gpu-stop") == "Stopped", timeout=10)


def test_boot_attempts_are_bounded_and_the_last_failure_leaves_nothing_behind(cloud):
    hog_running_node()
    cloud.set_faults(never_ready=["gpu-stop", "gpu2-stop"])
    plan, pushed = place(FAST_BOOT, job_id="job")
    out, _ = start(plan, pushed["job"])
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"])
    with pytest.raises(AirflowFailException) as err:
        run_sensor(sensor, context("wait"))
    text = str(err.value)
    assert "gpu2-stop not GPU-ready before the boot timeout" in text and "last seen: ready=" in text
    assert "gave up after 2 failure(s) (max_attempts=2)" in text
    assert "node gpu-stop: not GPU-ready" in text and "node gpu2-stop: not GPU-ready" in text
    assert held("job") == []
    wait_until(lambda: status(cloud, "gpu-stop") == status(cloud, "gpu2-stop") == "Stopped", timeout=10)


def test_a_job_only_its_failed_node_could_hold_fails_at_once_instead_of_waiting_for_capacity(cloud):
    """Issue 35 #2: the fleet's only 2-GPU node never became ready for this job. Before, the job then
    waited for capacity (re-placing every 30 s) until its one-hour queue timeout; now it fails at once,
    saying why, holding nothing."""
    cloud.set_faults(never_ready=["gpu2-stop"])
    plan, pushed = place({**FAST_BOOT, "gpus": 2}, job_id="job")
    out, _ = start(plan, pushed["job"])
    assert [b["node"] for b in out["baselines"]] == ["gpu2-stop"]
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"])
    with pytest.raises(AirflowFailException) as err:
        run_sensor(sensor, context("wait"))
    text = str(err.value)
    assert text.startswith("node gpu2-stop not GPU-ready before the boot timeout")
    assert "it fits this fleet only with node(s) that already failed for it: gpu2-stop (failed for this job: " \
        "not GPU-ready within 10.0 s" in text and "Waiting would not help" in text
    assert held("job") == []
    wait_until(lambda: status(cloud, "gpu2-stop") == "Stopped", timeout=10)


def test_a_node_another_job_claims_is_not_stopped(cloud, capfd):
    """Jobs A and B share the 2-GPU node; A gives up on it, B still holds it: it keeps running."""
    hog_running_node()
    place({**JOB, "name": "hog2"}, job_id="hog2")             # takes gpu-stop
    cloud.set_faults(never_ready=["gpu2-stop"])
    plan_a, pushed_a = place(FAST_BOOT, job_id="a")
    plan_b, _ = place({**FAST_BOOT, "name": "b"}, job_id="b")
    assert plan_a["nodes_to_start"] == plan_b["nodes_to_start"] == ["gpu2-stop"]
    out, _ = start(plan_a, pushed_a["job"])
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed_a["job"], plan=out["plan"],
                            max_boot_attempts=1)
    with pytest.raises(AirflowFailException, match="gave up"):
        run_sensor(sensor, context("wait"))
    assert "not stopping it, another job claims it: reserved by job b" in logged(capfd)
    assert status(cloud, "gpu2-stop") == "Running"
    assert held("a") == [] and held("b") == ["gpu2-stop"]


# -- reservations of a live run (issue 9, defect 2) ----------------------------------------------
def test_a_short_user_ttl_does_not_let_another_job_onto_gpus_a_waiting_run_holds(cloud):
    """Job A (reservation_ttl_seconds=1) booted the 2-GPU node and waits for it, deferred; job B,
    placed a minute later while A still waits, must not be promised the same GPUs."""
    job_a = {**JOB, "gpus": 2, "reservation_ttl_seconds": 1, "boot_timeout_seconds": 120}
    plan, pushed = place(job_a, job_id="a")
    out, _ = start(plan, pushed["job"])
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"])
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context("wait"))
    deadline = deferred.value.trigger.deadline
    assert all(r.expires_at >= deadline + LAUNCH_MARGIN_SECONDS for r in ledger().live() if r.job_id == "a")

    kube = KubeClient()
    a_minute_later = Booker(kube, EcsHook(), ReservationLedger(kube), logging.getLogger("b"),
                            clock=lambda: time.time() + 60)
    booking = a_minute_later.book(JobSpec.from_dict({**JOB, "name": "b", "gpus": 2}), "b")
    assert booking.plan.outcome == Outcome.BUSY, booking.plan.table()
    assert held("b") == [] and held("a") == ["gpu2-stop"]


def test_each_step_renews_what_the_job_holds_and_never_shortens_it(cloud):
    plan, pushed = place({**JOB, "reservation_ttl_seconds": 7200}, job_id="long")
    (placed,) = ledger().live()
    assert placed.expires_at >= time.time() + 7000            # a longer user TTL is kept
    ledger().renew("long", time.time() + 10)                   # a renewal never shortens
    assert ledger().live()[0].expires_at == placed.expires_at

    plan, pushed = place({**JOB, "name": "short", "boot_timeout_seconds": 30}, job_id="short")
    (before,) = [r for r in ledger().live() if r.job_id == "short"]
    out, _ = start(plan, pushed["job"], stopping_timeout_seconds=600)
    (after_start,) = [r for r in ledger().live() if r.job_id == "short"]
    assert after_start.expires_at > before.expires_at + 500    # the start step covers its stopping wait
    record = ledger().snapshot().record("short", time.time())
    assert record.expires_at >= after_start.expires_at and record.started_on(out["baselines"][0]["node"])

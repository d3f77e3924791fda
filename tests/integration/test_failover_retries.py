"""Retries and clears in the middle of a boot fail-over (issue 9, defect 3).

A 1-GPU job boots gpu-stop, which never becomes Ready; the sensor fails over to gpu2-stop
(whose device plugin never registers) and defers. Then a step is cleared and run again, as
Airflow does for a retry or a POST /clearTaskInstances (clearing `wait_gpu_ready` also
re-runs `place`, the setup of `release`), or the run just ends there (a task killed by the
executor). Whatever is re-run, no instance this job started is left running idle, the
retry never waits again on the node that already failed for it, and the ledger is clean."""
from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from gpuboot.sensors.gpu_ready import GpuReadySensor
from tests.integration.conftest import SETTLE_SECONDS, wait_until
from tests.integration.test_operators import context, place, release, run_deferred
from tests.integration.test_resilience import FAST_BOOT, held, hog_running_node, ledger, logged, start, status

# the settle window must outlast simcloud's stale phase (see conftest), or a node whose device
# plugin never registers could pass the rule on its stale GPU count
JOB = {**FAST_BOOT, "settle_seconds": int(SETTLE_SECONDS)}


def resume_until_done(sensor: GpuReadySensor, ctx: dict, deferred: TaskDeferred):
    event = run_deferred(deferred)
    while True:
        try:
            return getattr(sensor, deferred.method_name)(ctx, event)
        except TaskDeferred as again:
            deferred = again
            event = run_deferred(again)


def fail_over_then_defer(cloud):
    """Up to the second deferral of the first try: gpu-stop timed out, gpu2-stop started and watched."""
    hog_running_node()
    cloud.set_faults(never_ready=["gpu-stop"], device_plugin_never=["gpu2-stop"])
    plan, pushed = place(JOB, job_id="job")
    out, _ = start(plan, pushed["job"])
    assert [b["node"] for b in out["baselines"]] == ["gpu-stop"]
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"])
    ctx = context("wait")
    with pytest.raises(TaskDeferred) as first:
        sensor.execute(ctx)
    with pytest.raises(TaskDeferred) as second:
        sensor.execute_complete(ctx, run_deferred(first.value))
    assert second.value.trigger.node == "gpu2-stop"
    assert held("job") == ["gpu2-stop"] and status(cloud, "gpu2-stop") in ("Starting", "Running")
    return plan, pushed, out, second.value.trigger.baseline["start_requested_at"]


def assert_nothing_left_running(cloud):
    release("job")
    wait_until(lambda: status(cloud, "gpu-stop") == status(cloud, "gpu2-stop") == "Stopped", timeout=30,
               message=lambda: f"gpu-stop {status(cloud, 'gpu-stop')}, gpu2-stop {status(cloud, 'gpu2-stop')}")
    state = ledger().snapshot()
    assert [r.job_id for r in state.reservations] == ["hog"]
    assert [j.job_id for j in getattr(state, "jobs", ())] == []          # the job's record went too


@pytest.mark.parametrize("cleared", ["wait_gpu_ready", "start", "place"])
def test_a_step_cleared_mid_failover_resumes_from_the_ledger_and_leaves_nothing_running(cloud, capfd, cleared):
    plan, pushed, out, gpu2_started_at = fail_over_then_defer(cloud)

    # the cleared step(s) run again with the XComs Airflow hands them (the first try's)
    if cleared == "place":
        place(JOB, job_id="job")         # re-placed: never on gpu-stop, which failed for this job
        assert held("job") == ["gpu2-stop"]
    if cleared == "start":
        out, _ = start(plan, pushed["job"])     # the place step's plan (gpu-stop): the ledger says gpu2-stop
        assert [b["node"] for b in out["baselines"]] == ["gpu2-stop"] and out["started"] == []
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"])
    ctx = context("wait")
    with pytest.raises(TaskDeferred) as retry:
        sensor.execute(ctx)
    # not gpu-stop again, and gpu2-stop's boot clock is not restarted
    assert retry.value.trigger.node == "gpu2-stop"
    assert retry.value.trigger.deadline == pytest.approx(gpu2_started_at + JOB["boot_timeout_seconds"])
    with pytest.raises(AirflowFailException) as err:
        resume_until_done(sensor, ctx, retry.value)
    assert "gave up after 2 failure(s)" in str(err.value)
    assert "device plugin never registered the GPUs on gpu2-stop" in str(err.value)

    assert_nothing_left_running(cloud)
    text = logged(capfd)
    assert "left running" not in text and "not started by this job" not in text


def test_a_run_that_ends_mid_failover_has_its_started_nodes_stopped_by_release(cloud):
    """The try is killed while deferred (Airflow's executor-event race) and the run fails: release
    finds in the job's record the node it started, with no pod of the job on it, and stops it."""
    fail_over_then_defer(cloud)
    assert_nothing_left_running(cloud)

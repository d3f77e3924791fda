"""What a boot timeout may conclude, and the sensor waiting like the start step (issue 9,
defects 4 and 8): a node already up when the job chose it is not held to the boot timeout
and never marked; a boot-failure mark goes once the node is Ready or boots again; a
fail-over that finds the rest of the fleet busy (or only marked unavailable) waits."""
from __future__ import annotations

import re
import time

import pytest
from airflow.sdk.exceptions import TaskDeferred

from gpuboot.core.model import Unavailable
from gpuboot.lifecycle.ledger import PROVISIONAL_SECONDS
from gpuboot.sensors.gpu_ready import GpuReadySensor
from tests.integration.conftest import SETTLE_SECONDS, T4X2, wait_until
from tests.integration.test_failover_retries import resume_until_done
from tests.integration.test_operators import JOB, context, place, run_deferred
from tests.integration.test_resilience import (
    FAST_BOOT,
    ZONE,
    held,
    hog_running_node,
    ledger,
    logged,
    mark,
    start,
    status,
)

SETTLED = {**FAST_BOOT, "settle_seconds": int(SETTLE_SECONDS)}   # outlasts simcloud's stale phase


def test_a_node_already_up_is_not_held_to_the_boot_timeout_nor_marked(cloud, capfd):
    """A boot timeout shorter than the settle window, on the running node: nothing boots, so the
    job just waits out its settle window there; before, the node was marked bad for everyone."""
    plan, pushed = place(JOB, job_id="job")
    assert [a["node"] for a in plan["assignments"]] == ["gpu-run"] and plan["nodes_to_start"] == []
    out, _ = start(plan, pushed["job"])
    assert out["baselines"][0]["start_requested_at"] is None
    ctx = context("wait")
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"],
                            boot_timeout_seconds=1)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(ctx)
    assert deferred.value.trigger.deadline > time.time() + SETTLE_SECONDS
    assert resume_until_done(sensor, ctx, deferred.value) == ["train"]
    assert ledger().live_unavailable() == [] and held("job") == ["gpu-run"]
    assert "it was up when the job chose it: no boot timeout" in logged(capfd)


def test_a_boot_failure_mark_goes_once_the_node_is_ready_or_boots_again(cloud, capfd):
    boot_id = lambda node: cloud.core_v1().read_node(node).status.node_info.boot_id  # noqa: E731
    until = time.time() + 600
    mark(
        Unavailable(reason="not GPU-ready within 10s", expires_at=until, node="gpu-run", boot_id=boot_id("gpu-run")),
        Unavailable(reason="not GPU-ready within 10s", expires_at=until, node="gpu-stop", boot_id="an-older-boot"),
        Unavailable(reason="not GPU-ready within 10s", expires_at=until, node="gpu2-stop",
                    boot_id=boot_id("gpu2-stop")),
        Unavailable(reason="NoStock", expires_at=until, instance_type=T4X2, zone=ZONE),
    )
    plan, _ = place(JOB, job_id="job")
    # gpu-run is Ready with its GPUs: its mark is gone and the job runs there
    assert [a["node"] for a in plan["assignments"]] == ["gpu-run"]
    kept = {m.what for m in ledger().live_unavailable()}
    # gpu-stop reported another boot since its mark; gpu2-stop's evidence still stands (and the
    # offering mark is no boot evidence at all)
    assert kept == {"node gpu2-stop", f"offering {T4X2} in {ZONE}"}
    assert "dropped the mark on node gpu-run" in logged(capfd)


def boot_timed_out(cloud):
    """The job placed on gpu-stop, which never becomes Ready: the sensor, its context and the
    trigger's timeout event (what execute_complete gets when the boot timeout passes)."""
    cloud.set_faults(never_ready=["gpu-stop"])
    plan, pushed = place(SETTLED, job_id="job")
    out, _ = start(plan, pushed["job"])
    ctx = context("wait")
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"],
                            busy_poll_seconds=0.5)
    with pytest.raises(TaskDeferred) as first:
        sensor.execute(ctx)
    return sensor, ctx, run_deferred(first.value)


@pytest.mark.parametrize("rest", ["held by another job", "only marked unavailable"])
def test_a_failover_that_finds_the_rest_busy_waits_like_start_then_runs(cloud, capfd, rest):
    hog_running_node()
    if rest == "held by another job":
        place({**JOB, "name": "big", "gpus": 2}, job_id="big")
        free = lambda: ledger().release("big")  # noqa: E731
    else:
        offering = Unavailable(reason="OperationDenied.NoStock", expires_at=time.time() + 600, instance_type=T4X2, zone=ZONE)
        mark(offering)
        free = lambda: ledger().drop_unavailable([offering])  # noqa: E731
    sensor, ctx, event = boot_timed_out(cloud)
    with pytest.raises(TaskDeferred) as waiting:                 # not a failure: a wait, holding nothing
        sensor.execute_complete(ctx, event)
    assert waiting.value.method_name == "resume_after_capacity"
    assert held("job") == []
    wait_until(lambda: status(cloud, "gpu-stop") == "Stopped", timeout=30)
    free()
    assert resume_until_done(sensor, ctx, waiting.value) == ["train"]
    assert [a["node"] for a in ctx["ti"].pushed["plan"]["assignments"]] == ["gpu2-stop"] == held("job")
    text = logged(capfd)
    assert "re-placed job job after waiting for capacity" in text
    # the failed boot's watch (first deferral) is in the task log, and where to look
    assert "watch of node gpu-stop in the triggerer" in text
    assert "kubelet on gpu-stop never reported Ready for this boot" in text
    assert re.search(r"start requested at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC by this job", text)


@pytest.mark.simcloud_only(reason="holds the ledger contended with an endless 409 burst (k8s_conflict_burst), a fault of simcloud's own API server")
def test_a_failover_on_a_contended_ledger_defers_and_runs_again_instead_of_failing(cloud, capfd, monkeypatch):
    """Issue 11: no job fails for contention inside its queue timeout. A fail-over whose ledger
    write keeps conflicting (every ConfigMap write answered 409) writes nothing, defers a short
    while and runs the sensor again from the ledger, which then fails over and succeeds."""
    import functools

    import gpuboot.lifecycle.boot
    from gpuboot.lifecycle.booking import Booker

    monkeypatch.setattr(gpuboot.lifecycle.boot, "Booker", functools.partial(Booker, contended_seconds=2))
    hog_running_node()
    sensor, ctx, event = boot_timed_out(cloud)
    cloud.set_faults(k8s_conflict_burst=10**6)
    with pytest.raises(TaskDeferred) as contended:
        sensor.execute_complete(ctx, event)
    assert contended.value.method_name == "resume_after_contention"
    # The job's record still says gpu-stop. The move's one addition (gpu2-stop) went first, into a shard
    # created by a POST the burst does not refuse, and could not be taken back while every write conflicts:
    # it is left provisional, expiring within PROVISIONAL_SECONDS, until the job's next commit replaces it.
    mine = {r.node: r for r in ledger().live() if r.job_id == "job"}
    assert "gpu-stop" in mine and set(mine) <= {"gpu-stop", "gpu2-stop"}
    assert "gpu2-stop" not in mine or mine["gpu2-stop"].expires_at <= time.time() + PROVISIONAL_SECONDS
    cloud.set_faults(k8s_conflict_burst=0)
    assert resume_until_done(sensor, ctx, contended.value) == ["train"]
    assert [a["node"] for a in ctx["ti"].pushed["plan"]["assignments"]] == ["gpu2-stop"] == held("job")
    assert "running this step again from the ledger" in logged(capfd)

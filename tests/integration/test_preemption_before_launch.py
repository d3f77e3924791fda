"""Live preemption of a job with no pod yet, on the local cloud with the real steps and clients (both
Kubernetes backends): a low preemptible job is admitted to the only 8-GPU node; before its start step
(or its wait step) runs, or while its wait step watches the node boot, a high job that only fits there
arrives and preempts it (no pod to delete, its reservation given back); the victim's start or wait
step books nothing around the queue and hands it to its launch step, which is told by whom and why,
waits in the queue, places again once the high job is released, and runs to success. Nothing leaks."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from airflow.sdk.exceptions import TaskDeferred

from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.jobqueue import JobQueue
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.operators.launch import GpuPodOperator
from gpuboot.operators.start import StartGpuNodesOperator
from gpuboot.sensors.gpu_ready import GpuReadySensor
from simcloud.harness import MANAGED, small_fleet
from tests.integration.conftest import running_cloud
from tests.integration.test_operators import context, place, release
from tests.integration.test_preemption import FLEET, HIGH, LOW, V100X8, cloud, drive, run_job  # noqa: F401 (cloud: a fixture)

SHORT_LOW = {**LOW, "command": ["python", "-c", "print('sweep done')"]}
BOOT_SECONDS = 20.0      # the victim's node boots this long: its wait step is in its trigger when preempted
SLOW_FLEET = small_fleet([{"name": "gpu8", "instance_type": V100X8, "status": "Stopped", **MANAGED},
                          {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"}],
                         timings={"stale_seconds": 1.0, "device_plugin_seconds": 0.5, "boot_seconds": BOOT_SECONDS})
SLOW_FLEET["instance_types"][V100X8] = FLEET["instance_types"][V100X8]


@pytest.fixture
def slow_cloud(tmp_path, monkeypatch):
    with running_cloud(SLOW_FLEET, tmp_path, monkeypatch) as sim:
        yield sim


@pytest.mark.parametrize("preempted_before", ["start", "wait"])
def test_a_job_preempted_before_its_pods_exist_is_requeued_by_its_launch_and_later_succeeds(cloud, capfd,
                                                                                         preempted_before):
    plan, pushed = place(SHORT_LOW, job_id="sweep-run")
    assert plan["outcome"] == "fits", plan["message"]
    start = StartGpuNodesOperator(task_id="start", plan=plan, job=pushed["job"])
    started = None if preempted_before == "start" else start.execute(context("start"))
    high_plan, high_pushed = place(HIGH, job_id="urgent-run")     # preempts sweep-run: it has no pod yet
    assert high_plan["outcome"] == "fits" and [a["node"] for a in high_plan["assignments"]] == ["gpu8"]
    assert JobQueue(KubeClient()).snapshot().preempted_of("sweep-run").by == "urgent-run"
    assert "deleted its pod(s) none (not launched yet), gave back 1 reservation(s)" in capfd.readouterr().out
    if started is None:
        started = start.execute(context("start"))
    waited = context("wait")
    drive(GpuReadySensor(task_id="wait", baselines=started["baselines"], job=pushed["job"], plan=started["plan"]),
          waited)
    out = capfd.readouterr().out
    assert "job sweep-run was preempted by job urgent (urgent-run) before its node(s) were up" in out
    assert [r.job_id for r in ReservationLedger(KubeClient()).live()] == ["urgent-run"]   # booked nothing again

    requeued_and_later_succeeds(capfd, pushed, waited, started, high_plan, high_pushed, out)


def test_a_job_preempted_while_its_wait_step_watches_its_node_boot_learns_it_from_its_trigger(slow_cloud, capfd):
    """The wait step is deferred on its node's readiness trigger, the node booting for BOOT_SECONDS, when
    the high job preempts it: the trigger ends with "preempted" within its 2 s look at the queue (not
    when the boot ends), and the step hands the job to its launch step, which requeues it."""
    plan, pushed = place(SHORT_LOW, job_id="sweep-run")
    assert plan["outcome"] == "fits", plan["message"]
    started = StartGpuNodesOperator(task_id="start", plan=plan, job=pushed["job"]).execute(context("start"))
    waited = context("wait")
    sensor = GpuReadySensor(task_id="wait", baselines=started["baselines"], job=pushed["job"], plan=started["plan"])
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(waited)
    event: dict = {}
    watching = threading.Thread(target=lambda: event.update(
        asyncio.run(deferred.value.trigger.run().__anext__()).payload))
    watching.start()
    booted_by = time.time() + BOOT_SECONDS
    high_plan, high_pushed = place(HIGH, job_id="urgent-run")      # preempts sweep-run, its node still booting
    assert high_plan["outcome"] == "fits" and [a["node"] for a in high_plan["assignments"]] == ["gpu8"]
    watching.join(BOOT_SECONDS)
    assert event.get("status") == "preempted" and time.time() < booted_by, event.get("message")
    assert "was preempted by job urgent (urgent-run)" in event["message"]
    sensor.execute_complete(waited, event)              # hands the job to its launch step
    out = capfd.readouterr().out
    assert "job sweep-run was preempted by job urgent (urgent-run) before its node(s) were up" in out
    assert [r.job_id for r in ReservationLedger(KubeClient()).live()] == ["urgent-run"]   # booked nothing again
    requeued_and_later_succeeds(capfd, pushed, waited, started, high_plan, high_pushed, out)


def test_a_job_preempted_while_its_poking_wait_step_watches_its_node_boot_learns_it_at_a_poke(slow_cloud, capfd):
    """The same in poke mode (deferrable=False): each poke looks at the queue with the trigger's own
    PreemptionWatch, so the step ends within 2 s of the preemption (not when the boot ends) and hands
    the job to its launch step the same way."""
    plan, pushed = place(SHORT_LOW, job_id="sweep-run")
    assert plan["outcome"] == "fits", plan["message"]
    started = StartGpuNodesOperator(task_id="start", plan=plan, job=pushed["job"]).execute(context("start"))
    waited = context("wait")
    sensor = GpuReadySensor(task_id="wait", baselines=started["baselines"], job=pushed["job"], plan=started["plan"],
                            deferrable=False, poke_interval=0.2)
    ended: dict = {}
    poking = threading.Thread(target=lambda: ended.update(tasks=sensor.execute(waited)))
    poking.start()
    booted_by = time.time() + BOOT_SECONDS
    high_plan, high_pushed = place(HIGH, job_id="urgent-run")      # preempts sweep-run, its node still booting
    assert high_plan["outcome"] == "fits" and [a["node"] for a in high_plan["assignments"]] == ["gpu8"]
    poking.join(BOOT_SECONDS)
    assert not poking.is_alive() and time.time() < booted_by and ended.get("tasks") == [], ended
    out = capfd.readouterr().out
    assert "job sweep-run was preempted by job urgent (urgent-run) before its node(s) were up" in out
    assert [r.job_id for r in ReservationLedger(KubeClient()).live()] == ["urgent-run"]   # booked nothing again
    requeued_and_later_succeeds(capfd, pushed, waited, started, high_plan, high_pushed, out)


def requeued_and_later_succeeds(capfd, pushed, waited, started, high_plan, high_pushed, out: str) -> None:
    """The victim's launch, told, waits in the queue while the high job runs, then places again and runs."""
    victim: dict = {}

    def launch() -> None:
        op = GpuPodOperator(task_id="launch", job=pushed["job"], plan=waited["ti"].pushed.get("plan", started["plan"]),
                            env_source=SHORT_LOW, startup_timeout_seconds=30, busy_poll_seconds=5)
        try:
            victim["pods"] = drive(op, context("launch"))
        except BaseException as exc:
            victim["error"] = exc

    thread = threading.Thread(target=launch)       # told, then waits in the queue behind the high job
    thread.start()
    started_high = StartGpuNodesOperator(task_id="start", plan=high_plan, job=high_pushed["job"]).execute(
        context("start"))
    waited_high = context("wait")
    drive(GpuReadySensor(task_id="wait", baselines=started_high["baselines"], job=high_pushed["job"],
                         plan=started_high["plan"]), waited_high)
    assert len(drive(GpuPodOperator(task_id="launch", job=high_pushed["job"], plan=started_high["plan"],
                                    env_source=HIGH, startup_timeout_seconds=30), context("launch"))) == 1
    assert release("urgent-run") == ["urgent"]
    thread.join(240)
    assert not thread.is_alive() and "error" not in victim, victim.get("error")
    out += capfd.readouterr().out
    assert "job sweep (sweep-run) was preempted by job urgent (urgent-run)" in out and "Requeued (not failed)" in out
    assert "placed again after preemption" in out and "sweep done" in out
    assert release("sweep-run") == ["sweep"]
    assert ReservationLedger(KubeClient()).live() == []
    state = JobQueue(KubeClient()).snapshot()
    assert (state.waiting, state.running, state.preempted) == ((), (), ())

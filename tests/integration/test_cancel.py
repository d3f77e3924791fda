"""Cancelling a running job deletes its pods: marking the run failed, clearing it or deleting it while
launch waits deferred cancels its GangTrigger with the triggerer's user-action message, and the
triggerer then calls on_kill (airflow.jobs.triggerer_job_runner); a launch killed in the worker
(execution_timeout) calls the operator's on_kill. Either way no pod runs on without a reservation."""
from __future__ import annotations

import asyncio

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from gpuboot.hooks.kube import KubeClient
from gpuboot.operators.launch import GpuPodOperator
from gpuboot.operators.release import ReleaseReservationOperator
from simcloud.harness import wait_until
from tests.integration.test_operators import JOB, context, place, release
from tests.integration.test_resilience import start, status

LONG = {**JOB, "name": "long", "cpu": "100m", "memory": "64Mi", "gpus": 0, "allow_gpu_nodes": True, "replicas": 2,
        "command": ["python", "-c", "import time\nprint('training', flush=True)\nwhile True: time.sleep(1)"]}  # sleep-ok: the pod's own workload


def running_pods(job_id: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in KubeClient().list_pods(f"gpuboot.io/job={job_id}")
                  if p["status"].get("phase") in ("Pending", "Running") and not p["metadata"].get("deletionTimestamp"))


def launched(job_id: str) -> tuple[GpuPodOperator, TaskDeferred]:
    plan, pushed = place(LONG, job_id=job_id)
    assert plan["outcome"] == "fits", plan["message"]
    launch = GpuPodOperator(task_id="launch", job=pushed["job"], plan=plan, startup_timeout_seconds=30)
    with pytest.raises(TaskDeferred) as deferred:
        launch.execute(context("launch"))
    wait_until(lambda: len(running_pods(job_id)) == 2, timeout=60, message="the gang did not start")
    return launch, deferred.value


def test_a_user_cancelling_the_deferred_launch_deletes_every_pod_of_the_gang(cloud, capfd):
    _launch, deferred = launched("cancelled")
    trigger = deferred.trigger

    async def run_then_cancel():
        task = asyncio.ensure_future(trigger.run().__anext__())
        await asyncio.sleep(0)            # the trigger is running: what the user cancels
        task.cancel("__airflow_user_action__")
        with pytest.raises(asyncio.CancelledError):
            await task
        await trigger.on_kill()           # what the triggerer does next, for a user action

    asyncio.run(asyncio.wait_for(run_then_cancel(), timeout=60))
    wait_until(lambda: running_pods("cancelled") == [], timeout=60, message="the gang's pods still run")
    assert "cancelled while the gang ran: deleted its pod(s)" in capfd.readouterr().out
    release("cancelled")


def test_a_launch_killed_in_the_worker_deletes_its_pods(cloud):
    launch, _ = launched("killed")
    launch.on_kill()                      # what the task runner calls on execution_timeout or a kill
    wait_until(lambda: running_pods("killed") == [], timeout=60, message="the gang's pods still run")
    release("killed")


def test_a_cancelled_job_leaves_the_node_it_booted_and_ran_on_to_the_idle_rules(cloud):
    """Release stops a node the job started where none of its pods ran; a cancel deletes the pods,
    yet they ran there: the node goes to the idle rules like any node that ran work (before, release
    found no pod, stopped it at once and said 'no pod of it ran'; seen in the demo's stack)."""
    job = {**LONG, "name": "booted", "replicas": 1, "gpus": 2}          # only gpu2-stop holds 2 GPUs
    plan, pushed = place(job, job_id="booted")
    assert plan["nodes_to_start"] == ["gpu2-stop"], plan
    out, _ = start(plan, pushed["job"])
    wait_until(lambda: (cloud.core_v1().read_node("gpu2-stop").status.allocatable or {}).get("nvidia.com/gpu") == "2",
               timeout=60, message="gpu2-stop's GPUs did not register")
    ctx = context("launch")
    launch = GpuPodOperator(task_id="launch", job=pushed["job"], plan=out["plan"], startup_timeout_seconds=30)
    with pytest.raises(TaskDeferred):
        launch.execute(ctx)
    wait_until(lambda: len(running_pods("booted")) == 1, timeout=60, message="the pod did not start")
    launch.on_kill()
    wait_until(lambda: running_pods("booted") == [], timeout=60, message="the pod still runs")
    assert ctx["ti"].pushed["nodes"] == ["gpu2-stop"]
    done = context("release")
    done["ti"].pulls[("launch", "nodes")] = ctx["ti"].pushed["nodes"]
    with pytest.raises(AirflowFailException, match=r"its pod\(s\) on gpu2-stop were deleted before they finished"):
        ReleaseReservationOperator(task_id="release", job_id="booted", launch_task_id="launch").execute(done)
    assert status(cloud, "gpu2-stop") in ("Starting", "Running")      # not stopped: left to scale-down

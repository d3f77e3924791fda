"""Issue 35 #9: a pod deleted mid-run is reported with its real name and the log lines it wrote.

Before: `rank 0 (pod rank-0) failed: its pod is gone (deleted). Last 0 log line(s) of rank 0: (no log: the
container never started)`, though its lines were in the same try's log (the pod, and its log, were gone
when launch asked for them)."""
from __future__ import annotations

import asyncio
import os

import pytest
from airflow.sdk.exceptions import AirflowException, TaskDeferred

from gpuboot.hooks.kube import KubeClient
from gpuboot.operators.launch import GpuPodOperator
from simcloud.harness import wait_until
from tests.integration.test_operators import JOB, context, place, release


def test_a_pod_deleted_mid_run_is_named_and_its_streamed_lines_are_in_the_failure(cloud, tmp_path, capfd):
    gate = tmp_path / "gate"                  # the pod writes its lines, then waits here until deleted
    os.mkfifo(gate)
    command = ["python", "-c", ("import os\nfor i in range(6): print(f'line {i} of six', flush=True)\n"
                                "open(os.environ['GATE']).read()\n")]
    job = {**JOB, "name": "deleted", "cpu": "100m", "memory": "64Mi", "gpus": 0, "allow_gpu_nodes": True,
           "command": command, "env": {"GATE": str(gate)}}
    plan, pushed = place(job, job_id="deleted-mid-run")
    launch = GpuPodOperator(task_id="launch", job=pushed["job"], plan=plan, env_source=job, startup_timeout_seconds=30)
    with pytest.raises(TaskDeferred) as deferred:
        launch.execute(context("launch"))
    (pod,) = deferred.value.trigger.pods

    async def follow_and_delete():
        verdict = asyncio.ensure_future(deferred.value.trigger.run().__anext__())
        await asyncio.to_thread(wait_until, lambda: "line 5 of six" in capfd.readouterr().out, timeout=60,
                                interval=0.2, message="the pod's lines were not streamed")
        KubeClient().delete_pod("gpu-jobs", pod, grace_seconds=0)
        return (await asyncio.wait_for(verdict, timeout=60)).payload

    event = asyncio.run(follow_and_delete())
    with pytest.raises(AirflowException) as failed:
        launch.execute_complete(context("launch"), event)
    message = str(failed.value)
    assert f"rank 0 (pod {pod}) failed" in message and "rank-0" not in message
    assert "Last 6 log line(s) of rank 0:" in message and "line 5 of six" in message, message
    assert "never started" not in message
    release("deleted-mid-run")


def test_a_missing_secret_fails_the_launch_at_once_naming_it_and_the_fix(cloud):
    """Issue 35 #5: a secret_env whose Secret does not exist keeps the container waiting
    (CreateContainerConfigError, as a kubelet does); the gang fails at once instead of waiting out its run."""
    job = {**JOB, "name": "nosecret", "cpu": "100m", "memory": "64Mi", "gpus": 0, "allow_gpu_nodes": True,
           "secret_env": {"HF_TOKEN": "hf-token/token"}}
    plan, pushed = place(job, job_id="missing-secret")
    launch = GpuPodOperator(task_id="launch", job=pushed["job"], plan=plan, env_source=job, deferrable=False,
                            startup_timeout_seconds=30)
    with pytest.raises(AirflowException) as failed:
        launch.execute(context("launch"))
    message = str(failed.value)
    assert 'its container cannot be created: secret "hf-token" not found' in message, message
    assert "Create the Secret (and key) in the job's namespace, or fix secret_env" in message
    release("missing-secret")

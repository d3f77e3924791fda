"""A job that accepts any of several GPU models, through every step against the local cloud:
the first model it lists is absent from the fleet, so it must boot and run on a node of the
second, never on the free running node of a model it does not accept."""
from __future__ import annotations

import pytest
from airflow.sdk.exceptions import TaskDeferred

from gpuboot.hooks.kube import KubeClient
from gpuboot.operators.launch import GpuPodOperator
from gpuboot.operators.place import PlaceGpuJobOperator
from gpuboot.operators.release import ReleaseReservationOperator
from gpuboot.operators.start import StartGpuNodesOperator
from gpuboot.sensors.gpu_ready import GpuReadySensor
from tests.integration.conftest import SETTLE_SECONDS, running_cloud, small_fleet
from tests.integration.step_runner import TaskInstance
from tests.integration.test_operators import run_deferred

# A running T4 node (free, and preferred were the model ignored: running beats stopped) and a
# stopped A10 node; no V100 at all.
FLEET = small_fleet([
    {"name": "t4-running", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Running"},
    {"name": "a10-stopped", "instance_type": "ecs.gn7i-c8g1.2xlarge", "status": "Stopped"},
], timings={"stale_seconds": 1.0, "device_plugin_seconds": 0.5})
JOB = {"name": "any-model", "image": "python:3.11", "command": ["python", "-c", "print('any-model-done')"],
       "gpus": 1, "cpu": "1", "memory": "1Gi", "gpu_model": ["V100M16", "A10"],
       "settle_seconds": int(SETTLE_SECONDS), "boot_timeout_seconds": 60}


@pytest.fixture
def cloud(tmp_path, monkeypatch):
    with running_cloud(FLEET, tmp_path, monkeypatch) as sim:
        yield sim


def context(step: str) -> dict:
    ti = TaskInstance(step, 1, 0 if step == "launch" else -1)
    return {"ti": ti, "run_id": ti.run_id, "dag": None, "params": {}, "task_state_store": None}


def test_a_job_accepting_two_models_boots_and_runs_on_the_second_when_the_first_is_absent(cloud):
    ctx = context("place")
    plan = PlaceGpuJobOperator(task_id="place", job=JOB, job_id="any-model-1").execute(ctx)
    job = ctx["ti"].pushed["job"]
    assert job["gpu_model"] == ["V100M16", "A10"]
    assert [a["node"] for a in plan["assignments"]] == ["a10-stopped"] and plan["nodes_to_start"] == ["a10-stopped"]

    started = StartGpuNodesOperator(task_id="start", plan=plan).execute(context("start"))
    sensor = GpuReadySensor(task_id="wait", baselines=started["baselines"], job=job, plan=plan)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context("wait"))
    assert sensor.execute_complete(context("wait"), run_deferred(deferred.value)) == ["any-model"]

    launch = GpuPodOperator(task_id="launch", job=job, plan=plan, deferrable=False, startup_timeout_seconds=60)
    launch.execute(context("launch"))
    pods = KubeClient().list_pods("gpuboot.io/job=any-model-1")
    assert [((p.get("spec") or {}).get("nodeName"), (p.get("status") or {}).get("phase")) for p in pods] == \
        [("a10-stopped", "Succeeded")]
    # pinned by hostname: the pod needs no selector on the model label, whatever the job accepts
    assert set(pods[0]["spec"]["nodeSelector"]) == {"kubernetes.io/hostname"}
    assert ReleaseReservationOperator(task_id="release", job_id="any-model-1").execute(context("release")) == \
        ["any-model"]

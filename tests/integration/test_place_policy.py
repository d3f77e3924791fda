"""The place step's policies against the local cloud: CPU-only work and GPU nodes, and what a
busy placement says about who holds the capacity."""
from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from gpuboot.hooks.ecs import EcsHook
from gpuboot.operators.place import PlaceGpuJobOperator
from tests.integration.test_operators import JOB, context, place

# More CPU than the CPU node (4) or the running T4 node (4) has: only the stopped 2-GPU node (48) holds it.
CPU_ONLY = {**JOB, "name": "etl", "gpus": 0, "cpu": "6"}


def test_a_cpu_only_job_never_boots_a_gpu_node_by_default(cloud):
    """Issue 9: `gpus: 0, cpu: "40"` booted a GPU node."""
    with pytest.raises(AirflowFailException) as err:
        place(CPU_ONLY, job_id="etl")
    assert "CPU-only work stays off GPU nodes, allow_gpu_nodes: true lets it on" in str(err.value)
    assert EcsHook().statuses([cloud.instance_id("gpu2-stop")]) == {cloud.instance_id("gpu2-stop"): "Stopped"}


def test_a_cpu_only_job_may_use_gpu_nodes_when_it_allows_them_unless_the_operator_forbids(cloud):
    plan, pushed = place({**CPU_ONLY, "allow_gpu_nodes": True}, job_id="etl-ok")
    assert plan["nodes_to_start"] == ["gpu2-stop"] and pushed["job"]["allow_gpu_nodes"] is True

    with pytest.raises(AirflowFailException, match="CPU-only work stays off GPU nodes"):
        place({**CPU_ONLY, "name": "etl-2", "allow_gpu_nodes": True}, job_id="etl-no", cpu_jobs_on_gpu_nodes=False)


def test_busy_place_says_capacity_busy_once_and_names_the_job_holding_the_node(cloud, capfd):
    place({**JOB, "name": "hog", "gpus": 2}, job_id="hog-job")             # takes the only 2-GPU node
    op = PlaceGpuJobOperator(task_id="place", job={**JOB, "gpus": 2}, job_id="waiting")
    capfd.readouterr()
    with pytest.raises(TaskDeferred):
        op.execute(context("place"))
    busy = [line for line in capfd.readouterr().out.splitlines() if "capacity busy" in line]
    assert len(busy) == 1 and busy[0].count("capacity busy") == 1, busy
    assert "gpu2-stop" in busy[0] and "job hog-job (hog, reserved)" in busy[0]

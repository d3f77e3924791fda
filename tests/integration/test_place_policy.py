"""The place step's policies against the local cloud: CPU-only work and GPU nodes, and what a
busy placement says about who holds the capacity."""
from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from gpuboot.hooks.ecs import EcsHook
from gpuboot.operators.place import PlaceGpuJobOperator
from tests.integration.conftest import running_cloud, small_fleet
from tests.integration.test_operators import JOB, context, place, release

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


def _big_cheap_per_slot_fleet() -> dict:
    """Two stopped V100 nodes: a 4-GPU one priced (here) below the 1-GPU one per GPU, 1.5 against
    2.6 USD/h, but dearer as a whole, 6.0; and the CPU node."""
    fleet = small_fleet([{"name": "v100-big", "instance_type": "ecs.gn6v-c8g1.8xlarge", "status": "Stopped"},
                         {"name": "v100-small", "instance_type": "ecs.gn6v-c8g1.2xlarge", "status": "Stopped"},
                         {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"}])
    fleet["instance_types"]["ecs.gn6v-c8g1.8xlarge"] = {**fleet["instance_types"]["ecs.gn6v-c8g1.8xlarge"],
                                                        "price_per_hour": 6.0}
    return fleet


def test_boot_fill_from_load_starts_the_small_node_when_nothing_runs(tmp_path, monkeypatch):
    """The gpu_job field through the place step against the local cloud's prices: off, the cheapest
    slot (the 4-GPU node); at 4 with no GPU in use, the node is priced whole, so the 1-GPU one."""
    with running_cloud(_big_cheap_per_slot_fleet(), tmp_path, monkeypatch):
        plan, _ = place({**JOB, "name": "per-slot"}, job_id="per-slot")
        assert plan["nodes_to_start"] == ["v100-big"]
        release("per-slot")
        plan, pushed = place({**JOB, "name": "by-load", "boot_fill_from_load": 4}, job_id="by-load")
        assert plan["nodes_to_start"] == ["v100-small"] and pushed["job"]["boot_fill_from_load"] == 4

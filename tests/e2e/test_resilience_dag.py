"""The gpu_job DAG under faults, with dag.test() against the local cloud: a job whose first
node has no stock, or never becomes GPU-ready, still succeeds on another node; the bad
instance is left (or put back) Stopped and no reservation is left behind."""
from __future__ import annotations

import json

import pytest

from tests.e2e.test_gpu_job import admission_failures, live_reservations, states

T4, T4X2 = "ecs.gn6i-c4g1.xlarge", "ecs.gn6i-c24g1.12xlarge"
FLEET_NODES = [
    {"name": "t4-a", "instance_type": T4, "status": "Stopped"},
    {"name": "t4-b", "instance_type": T4, "status": "Stopped"},
    {"name": "t4x2", "instance_type": T4X2, "status": "Stopped"},
]
JOB = {"name": "resilient", "image": "python:3.11-slim", "command": ["python", "-c", "print('resilient-done')"],
       "gpus": 1, "cpu": "1", "memory": "1Gi", "settle_seconds": 1, "boot_timeout_seconds": 8,
       "queue_timeout_seconds": 60}


@pytest.fixture
def cloud(tmp_path):
    """Overrides the e2e fleet: three stopped GPU nodes, t4-a the first choice for a 1-GPU job."""
    from simcloud.harness import SimCloud, small_fleet

    with SimCloud.start(small_fleet(FLEET_NODES), tmp_path / "cloud") as sim:
        yield sim


@pytest.fixture(scope="module")
def gpu_job_dag():
    from airflow.dag_processing.dagbag import DagBag

    from tests.e2e.conftest import REPO

    bag = DagBag(dag_folder=str(REPO / "dags" / "gpu_job.py"), safe_mode=False)
    return bag.dags["gpu_job"]


def ecs_status(cloud, node: str) -> str:
    """The instance's status through the official ECS SDK."""
    from alibabacloud_ecs20140526 import models

    iid = cloud.instance_id(node)
    body = cloud.ecs_client().describe_instances(models.DescribeInstancesRequest(
        region_id=cloud.region, instance_ids=json.dumps([iid]))).body.to_map()
    return body["Instances"]["Instance"][0]["Status"]


def job_pods(cloud) -> list:
    return [p for p in cloud.core_v1().list_pod_for_all_namespaces().items
            if (p.metadata.labels or {}).get("gpuboot.io/job")]


def assert_succeeded_on(cloud, dag_run, output: str, node: str) -> None:
    assert dag_run.state == "success", output[-5000:]
    assert {k: states(dag_run)[k] for k in ("place", "start", "wait_gpu_ready", "launch")} == dict.fromkeys(
        ("place", "start", "wait_gpu_ready", "launch"), "success")
    (pod,) = job_pods(cloud)
    assert (pod.spec.node_name, pod.status.phase) == (node, "Succeeded")
    assert admission_failures(cloud) == [] and live_reservations(cloud) == []


def test_no_stock_on_the_first_choice_moves_the_job_within_the_start_step(cloud, connections, gpu_job_dag, capfd):
    cloud.set_faults(no_stock=[T4])
    dag_run = gpu_job_dag.test(conn_file_path=str(connections), run_conf=JOB)
    output = capfd.readouterr().out
    assert_succeeded_on(cloud, dag_run, output, "t4x2")
    assert "OperationDenied.NoStock" in output and "re-placed job" in output
    assert ecs_status(cloud, "t4-a") == ecs_status(cloud, "t4-b") == "Stopped"


def test_a_node_that_never_becomes_ready_is_stopped_again_and_the_job_runs_elsewhere(cloud, connections,
                                                                                       gpu_job_dag, capfd):
    from simcloud.harness import wait_until

    cloud.set_faults(never_ready=["t4-a"])
    dag_run = gpu_job_dag.test(conn_file_path=str(connections), run_conf=JOB)
    output = capfd.readouterr().out
    assert_succeeded_on(cloud, dag_run, output, "t4-b")
    assert "t4-a not GPU-ready before the boot timeout" in output
    wait_until(lambda: ecs_status(cloud, "t4-a") == "Stopped", timeout=10)
    assert ecs_status(cloud, "t4x2") == "Stopped"

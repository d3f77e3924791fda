"""A GPU-sharing job end to end (dag.test() on the local cloud): it asks for aliyun.com/gpu-mem and no whole
GPU, on a stopped node labelled for ACK's GPU sharing. That node's gpu-mem goes stale -> 0 -> real after the
boot, registered by its own plugin after nvidia.com/gpu, and the kubelet refuses a gpu-mem pod bound before
(tests/conformance/test_kubelet_extended.py; a rule that looked at whole GPUs only would commit it
then: tests/integration/test_trigger.py). The job must succeed with no pod refused."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import REPO, task_log
from tests.e2e.test_gpu_job import admission_failures, all_pods, node_boot_id
from tests.shared import live_reservations

SHARED = "t4x2-share"
GPU_MEM = "aliyun.com/gpu-mem"
NODES = [
    {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"},
    {"name": SHARED, "instance_type": "ecs.gn6i-c24g1.12xlarge", "status": "Stopped",
     "labels": {"ack.node.gpu.schedule": "share"}},
]
JOB = {"name": "mem-infer", "image": "python:3.11-slim",
       "command": ["python", "-c", "import os; print('gpu-mem share', os.environ['ALIYUN_COM_GPU_MEM_CONTAINER'])"],
       "gpus": 0, "extra_resources": {GPU_MEM: 8}, "allow_gpu_nodes": True, "cpu": "1", "memory": "1Gi",
       "settle_seconds": 1, "boot_timeout_seconds": 120, "queue_timeout_seconds": 60}


@pytest.fixture
def cloud(tmp_path):
    """The local cloud with a stopped GPU-sharing node; gpu-mem registers 1.5 s after the whole GPUs."""
    from simcloud.harness import SimCloud, small_fleet

    with SimCloud.start(small_fleet(NODES, timings={"device_plugin_seconds": 1.5}), tmp_path / "cloud") as sim:
        yield sim


def test_gpu_mem_job_boots_the_shared_node_and_is_committed_only_after_gpu_mem_registered(cloud, connections, capfd):
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags" / "gpu_job.py"), safe_mode=False).dags["gpu_job"]
    before = node_boot_id(cloud, SHARED)
    dag_run = dag.test(conn_file_path=str(connections), run_conf=JOB)
    output = capfd.readouterr().out

    assert dag_run.state == "success", output[-5000:]
    assert node_boot_id(cloud, SHARED) != before, "the shared node was booted for the job"
    (pod,) = [p for p in all_pods(cloud) if (p.metadata.labels or {}).get("gpuboot.io/job")]
    assert (pod.spec.node_name, pod.status.phase) == (SHARED, "Succeeded")
    assert pod.spec.containers[0].resources.limits == {**pod.spec.containers[0].resources.limits, GPU_MEM: "8"}
    assert "nvidia.com/gpu" not in (pod.spec.containers[0].resources.limits or {})
    assert admission_failures(cloud) == [], "committed before gpu-mem was registered"
    assert "gpu-mem share 8" in task_log(output, dag_run, "launch")
    wait_log = task_log(output, dag_run, "wait_gpu_ready")
    assert f"allocatable {GPU_MEM} is 0, 8 needed" in wait_log, "the trigger saw gpu-mem's zero and waited"
    assert live_reservations(cloud) == []

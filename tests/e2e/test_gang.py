"""A gang (replicas: 2) through the gpu_job DAG with dag.test() on the local cloud: both stopped
nodes boot, the ranks really rendezvous at MASTER_ADDR:MASTER_PORT with only the environment
launch set, both ranks' logs reach the launch task's log; a rank that fails takes the gang
down with it, and the retry relaunches the whole gang with no pod of the failed attempt left."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import task_log
from tests.e2e.test_gpu_job import admission_failures, live_reservations, states
from tests.e2e.test_resilience_dag import gpu_job_dag, job_pods  # noqa: F401  (fixture)
from tests.shared import gang_job

T4 = "ecs.gn6i-c4g1.xlarge"
FLEET_NODES = [
    {"name": "cpu-run", "instance_type": "ecs.g7.2xlarge", "status": "Running"},
    {"name": "t4-a", "instance_type": T4, "status": "Stopped"},
    {"name": "t4-b", "instance_type": T4, "status": "Stopped"},
]


@pytest.fixture
def cloud(tmp_path):
    """Two stopped 1-GPU nodes: a 2-rank gang of 1-GPU tasks needs both."""
    from simcloud.harness import SimCloud, small_fleet

    with SimCloud.start(small_fleet(FLEET_NODES), tmp_path / "cloud") as sim:
        yield sim


def attempts(pods) -> dict[str, list[tuple[str, str, str]]]:
    """(rank, node, phase) of the job's pods by launch attempt."""
    out: dict[str, list] = {}
    for p in pods:
        out.setdefault(p.metadata.labels["gpuboot.io/attempt"], []).append(
            (p.metadata.labels["gpuboot.io/rank"], p.spec.node_name, p.status.phase))
    return {k: sorted(v) for k, v in out.items()}


def test_a_gang_boots_both_nodes_and_its_ranks_rendezvous(cloud, connections, gpu_job_dag, capfd):
    dag_run = gpu_job_dag.test(conn_file_path=str(connections), run_conf=gang_job("e2e"))
    output = capfd.readouterr().out
    assert dag_run.state == "success", output[-6000:]
    assert states(dag_run)["launch"] == "success"
    pods = job_pods(cloud)
    assert attempts(pods) == {"1": [("0", "t4-a", "Succeeded"), ("1", "t4-b", "Succeeded")]
                              } or attempts(pods) == {"1": [("0", "t4-b", "Succeeded"), ("1", "t4-a", "Succeeded")]}
    ips = {p.status.pod_ip for p in pods}
    assert len(ips) == 2 and all(ip.startswith("127.") for ip in ips)
    log = task_log(output, dag_run, "launch")
    # each rank prints its rank; the message went both ways through rank 0's pod IP
    rank0_ip = next(p.status.pod_ip for p in pods if p.metadata.labels["gpuboot.io/rank"] == "0")
    assert f"[rank 0] e2e rank 0 of 2: master {rank0_ip}:29500" in log
    assert f"[rank 1] e2e rank 1 of 2: master {rank0_ip}:29500" in log
    assert "[rank 0] e2e rank 0 got: hello from rank 1" in log
    assert "[rank 1] e2e rank 1 got: welcome from rank 0 of 2" in log
    assert "DEFERRED" in log                       # launch waited in the triggerer, not in a worker
    assert admission_failures(cloud) == [] and live_reservations(cloud) == []


def test_a_failed_rank_fails_the_gang_and_the_retry_relaunches_it_whole(cloud, connections, gpu_job_dag, capfd,
                                                                       tmp_path):
    job = gang_job("once", RENDEZVOUS_FAIL_RANK="1", RENDEZVOUS_FAIL_ONCE=str(tmp_path / "failed-once"))
    dag_run = gpu_job_dag.test(conn_file_path=str(connections), run_conf=job)
    output = capfd.readouterr().out
    assert dag_run.state == "success", output[-6000:]
    launch = next(ti for ti in dag_run.get_task_instances() if ti.task_id.endswith(".launch"))
    assert launch.try_number == 2
    log = output      # task_log() covers the last try only; the job's names are unique to this test
    # try 1: rank 1 exited 1; rank 0 (still waiting for it) was deleted; the failure names rank,
    # code and the rank's last lines
    assert "gang of 2: rank 1 (pod once-gang-1-" in log and "failed with exit code 1" in log
    assert "the other rank(s) deleted: once-gang-0-" in log
    assert "once rank 1 gives up: failing on purpose" in log.split("Last ")[1]
    # try 2 found only the failed rank's pod left (rank 0 had gone with the one fate) and cleared it
    assert "deleting 1 pod(s) left by earlier attempt(s) ['1']: once-gang-1-" in log
    # the whole gang ran again, once: two pods, both of attempt 2, nothing of attempt 1
    assert {k: [(r, ph) for r, _n, ph in v] for k, v in attempts(job_pods(cloud)).items()} == {
        "2": [("0", "Succeeded"), ("1", "Succeeded")]}
    assert "[rank 1] once rank 1 got: welcome from rank 0 of 2" in log
    assert live_reservations(cloud) == []

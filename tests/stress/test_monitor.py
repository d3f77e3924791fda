"""The monitor itself: it must see a real overcommit and a refused pod, and not cry wolf when
a finished pod's GPU is promised again (what every stress and chaos verdict rests on)."""
from __future__ import annotations

import time

import pytest

from chaos.harness import api_client_factory, cloud_connections
from chaos.monitor import Monitor
from simcloud.harness import SimCloud, small_fleet, wait_until

T4 = "ecs.gn6i-c4g1.xlarge"
FLEET = small_fleet([{"name": "g-run", "instance_type": T4, "status": "Running"},
                     {"name": "g-stop", "instance_type": T4, "status": "Stopped"}])


@pytest.fixture
def cloud(tmp_path):
    with SimCloud.start(FLEET, tmp_path / "cloud", ready_timeout=120) as sim, cloud_connections(sim.connections_file):
        yield sim


def reserve(job_id: str, node: str, gpus: int = 1) -> None:
    from gpuboot.core.model import Reservation
    from gpuboot.core.resources import Resources
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.ledger import ReservationLedger

    ledger = ReservationLedger(KubeClient())
    _, version = ledger.read()
    ledger.commit(job_id, [Reservation(job_id, "t", node, Resources({"nvidia.com/gpu": gpus}), time.time() + 300)],
                  version)


def gpu_pod(name: str, node: str, command: str = "echo hi") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "restartPolicy": "Never",
                     "containers": [{"name": "c", "image": "busybox", "command": ["sh", "-c", command],
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


def test_two_promises_of_one_gpu_are_an_overcommit(cloud):
    with Monitor(api_client_factory(cloud.kubeconfig)) as monitor:
        reserve("a", "g-run")
        reserve("b", "g-run")
    (found,) = monitor.report.overcommits
    assert found.node == "g-run" and found.over == {"nvidia.com/gpu": 1}
    assert monitor.report.max_overcommit == {"nvidia.com/gpu": 1}
    assert {r.job_id for r in monitor.report.leaked()} == {"a", "b"}


def test_a_gpu_freed_by_a_finished_pod_can_be_promised_again(cloud):
    core = cloud.core_v1()
    with Monitor(api_client_factory(cloud.kubeconfig)) as monitor:
        core.create_namespaced_pod("default", gpu_pod("first", "g-run"))
        wait_until(lambda: core.read_namespaced_pod("first", "default").status.phase == "Succeeded", timeout=20)
        reserve("next", "g-run")
    assert monitor.report.overcommits == [] and monitor.report.max_promised_gpus == 1
    assert monitor.report.checks > 0 and monitor.report.admission_failures == []


def test_a_pod_refused_by_the_kubelet_is_recorded(cloud):
    """A node whose device plugin never registers: Ready with 0 GPUs, so a GPU pod bound there fails."""
    cloud.set_faults(device_plugin_never=["g-stop"])
    from gpuboot.hooks.ecs import EcsHook

    EcsHook().start_instances([cloud.instance_id("g-stop")])
    wait_until(lambda: cloud.node_ready("g-stop"), timeout=20)
    core = cloud.core_v1()
    with Monitor(api_client_factory(cloud.kubeconfig)) as monitor:
        core.create_namespaced_pod("default", gpu_pod("refused", "g-stop"))
        wait_until(lambda: core.read_namespaced_pod("refused", "default").status.phase == "Failed", timeout=20)
    (failure,) = monitor.report.admission_failures
    assert "refused" in failure and "UnexpectedAdmissionError" in failure


def test_streams_compacted_mid_run_list_again_and_raise_no_false_alarm(cloud):
    """The watch history is compacted while a pod ends and its GPU is promised again: every stream resumes
    into a 410 (an ERROR event inside the stream, which the client's raw watch cannot read) and lists again,
    each at its own resourceVersion; the monitor keeps checking and does not cry wolf (the moments inside a
    stream's gap are not checked: chaos.monitor's doc)."""
    core = cloud.core_v1()
    with Monitor(api_client_factory(cloud.kubeconfig)) as monitor:
        core.create_namespaced_pod("default", gpu_pod("first", "g-run", "sleep 2"))
        wait_until(lambda: core.read_namespaced_pod("first", "default").status.phase == "Running", timeout=20)
        checks = monitor.report.checks
        cloud.compact()
        wait_until(lambda: core.read_namespaced_pod("first", "default").status.phase == "Succeeded", timeout=20)
        reserve("next", "g-run")
        wait_until(lambda: monitor.report.relists >= 2 and monitor.report.checks > checks, timeout=30)
    assert monitor.report.overcommits == [] and monitor.report.max_promised_gpus == 1

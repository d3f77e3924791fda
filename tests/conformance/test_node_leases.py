"""Node Leases (coordination.k8s.io/v1) as kubelets keep them, seen through `kubernetes` and kubectl."""
from __future__ import annotations

import subprocess

import kubernetes
import pytest
from alibabacloud_ecs20140526 import models as ecs_models

from simcloud.harness import small_fleet, wait_until
from tests.conftest import kubectl_binaries

NS = "kube-node-lease"
FLEET = small_fleet([
    {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"},
    {"name": "gpu-1", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Stopped"},
])


def renew_time(coord, name: str):
    return coord.read_namespaced_lease(name, NS).spec.renew_time


def test_every_node_has_a_lease_renewed_only_while_its_kubelet_is_up(simcloud_factory):
    cloud = simcloud_factory(FLEET)
    coord = kubernetes.client.CoordinationV1Api(cloud.api_client())
    leases = {lease.metadata.name: lease for lease in coord.list_namespaced_lease(NS).items}
    assert sorted(leases) == ["cpu-1", "gpu-1"]
    for name, lease in leases.items():
        node = cloud.core_v1().read_node(name)
        assert lease.spec.holder_identity == name and lease.spec.lease_duration_seconds == 40
        assert [(o.kind, o.name, o.uid) for o in lease.metadata.owner_references] == [
            ("Node", name, node.metadata.uid)]

    # the running node renews on every heartbeat; the stopped one does not
    stopped_at = renew_time(coord, "gpu-1")
    first = renew_time(coord, "cpu-1")
    second = wait_until(lambda: (t := renew_time(coord, "cpu-1")) > first and t, timeout=5)
    wait_until(lambda: renew_time(coord, "cpu-1") > second, timeout=5)
    assert renew_time(coord, "gpu-1") == stopped_at

    # a watch sees the renewals
    watch, seen = kubernetes.watch.Watch(), []
    rv = coord.list_namespaced_lease(NS).metadata.resource_version
    for event in watch.stream(coord.list_namespaced_lease, NS, resource_version=rv, timeout_seconds=5):
        seen.append((event["type"], event["object"].metadata.name))
        watch.stop()
    assert seen == [("MODIFIED", "cpu-1")]

    # once started, the GPU node's kubelet renews its lease again
    cloud.ecs_client().start_instances(ecs_models.StartInstancesRequest(
        region_id=cloud.region, instance_id=[cloud.instance_id("gpu-1")]))
    wait_until(lambda: renew_time(coord, "gpu-1") > stopped_at, timeout=10)


def test_a_deleted_lease_is_recreated_by_the_kubelet(simcloud_factory):
    cloud = simcloud_factory(FLEET)
    coord = kubernetes.client.CoordinationV1Api(cloud.api_client())
    uid = coord.read_namespaced_lease("cpu-1", NS).metadata.uid
    coord.delete_namespaced_lease("cpu-1", NS)
    wait_until(lambda: any(lease.metadata.name == "cpu-1" and lease.metadata.uid != uid
                           for lease in coord.list_namespaced_lease(NS).items), timeout=5)


@pytest.mark.kubectl
@pytest.mark.parametrize("kubectl", kubectl_binaries(), ids=str)
def test_kubectl_describe_node_shows_the_lease(simcloud_factory, kubectl, tmp_path):
    cloud = simcloud_factory(FLEET)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(kubectl), "--kubeconfig", str(cloud.kubeconfig), "--cache-dir",
                               str(tmp_path / "kcache"), *args], capture_output=True, text=True, timeout=30,
                              env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})

    resources = run("api-resources", "--api-group", "coordination.k8s.io")
    assert resources.returncode == 0, resources.stderr
    assert "leases" in resources.stdout and "coordination.k8s.io/v1" in resources.stdout
    for node in ("cpu-1", "gpu-1"):
        out = run("describe", "node", node)
        assert out.returncode == 0, out.stderr
        assert "Failed to get lease" not in out.stdout + out.stderr
        assert f"HolderIdentity:  {node}" in out.stdout and "RenewTime:" in out.stdout
    got = run("get", "leases", "-n", NS)
    assert got.returncode == 0 and "cpu-1" in got.stdout and "gpu-1" in got.stdout, got.stderr

"""`python -m simcloud serve|fault|state|token|apply`: the files it writes, clean shutdown, runtime faults, kubectl."""
from __future__ import annotations

import json
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from alibabacloud_ecs20140526 import models as ecs_models

from simcloud.harness import REPO_ROOT, SimCloud, pod_log, process_alive, small_fleet, wait_until
from simcloud.workdir import kubernetes_connection
from tests.conftest import kubectl_binaries

DEMO_FLEET = REPO_ROOT / "simcloud" / "fleets" / "demo.yaml"


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simcloud", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60, check=check)


def test_workdir_files_are_complete_private_and_work_with_real_clients(simcloud_factory, monkeypatch):
    cloud = simcloud_factory()
    wd = cloud.workdir
    info = json.loads((wd / "simcloud.json").read_text())
    assert info["pid"] == cloud.process.pid and info["admin_url"] == cloud.k8s_url + "/_simcloud"
    for url in (info["k8s_url"], info["ecs_endpoint"]):
        assert url.startswith("http://127.0.0.1:")
    for name in ("kubeconfig", "ecs.json", "connections.json"):
        assert stat.S_IMODE((wd / name).stat().st_mode) == 0o600, name
    secret = cloud.ecs["access_key_secret"]
    assert secret not in cloud.log_text() and secret not in (wd / "simcloud.json").read_text()

    assert {n.metadata.name for n in cloud.core_v1().list_node().items} == {"cpu-1", "gpu-t4-1"}
    body = cloud.ecs_client().describe_instances(ecs_models.DescribeInstancesRequest(region_id=cloud.region)).body
    assert {(i.host_name, i.status) for i in body.instances.instance} == {("cpu-1", "Running"),
                                                                        ("gpu-t4-1", "Stopped")}

    # connections.json: Airflow's connections-file format, each value also an AIRFLOW_CONN_* JSON
    from airflow.secrets.local_filesystem import load_connections_dict
    conns = load_connections_dict(str(cloud.connections_file))
    k8s, ecs = conns["kubernetes_default"], conns["alibaba_ecs_default"]
    assert k8s.conn_type == "kubernetes" and Path(k8s.extra_dejson["kube_config_path"]) == cloud.kubeconfig
    assert (ecs.conn_type, ecs.login, ecs.password) == ("gpuboot_ecs", cloud.ecs["access_key_id"], secret)
    assert ecs.extra_dejson == {"region_id": cloud.region, "endpoint": cloud.ecs_endpoint}
    raw = json.loads(cloud.connections_file.read_text())
    monkeypatch.setenv("AIRFLOW_CONN_SIMCLOUD_K8S", json.dumps(raw["kubernetes_default"]))
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    hook = KubernetesHook(conn_id="simcloud_k8s")
    assert len(hook.core_v1_client.list_node().items) == 2
    assert hook.get_namespace() == "default"



def test_host_is_bound_written_and_given_to_pods(tmp_path):
    """`--host` (docker compose passes its service name): the APIs listen there only, the files name
    it, and a pod's in-cluster address (KUBERNETES_SERVICE_HOST/PORT) is where the API really is."""
    host = "127.0.0.2"   # a loopback address that is not the default 127.0.0.1
    with SimCloud.start(small_fleet(), tmp_path, extra_args=["--host", host]) as cloud:
        for url in (cloud.info["k8s_url"], cloud.ecs_endpoint):
            assert url.startswith(f"http://{host}:")
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", cloud.info["k8s_port"]), timeout=1).close()
        v1 = cloud.core_v1()
        script = ("import os, urllib.request; h, p = os.environ['KUBERNETES_SERVICE_HOST'], "
                  "os.environ['KUBERNETES_SERVICE_PORT']; print(h, p, os.environ['KUBERNETES_PORT']); "
                  "print(urllib.request.urlopen(f'http://{h}:{p}/version', timeout=5).status)")
        v1.create_namespaced_pod("default", {"metadata": {"name": "in-cluster"}, "spec": {
            "nodeName": "cpu-1", "restartPolicy": "Never", "containers": [{
                "name": "main", "image": "python:3.11", "command": ["python", "-c", script]}]}})
        wait_until(lambda: v1.read_namespaced_pod("in-cluster", "default").status.phase in ("Succeeded", "Failed"),
                   timeout=20)
        port = cloud.info["k8s_port"]
        assert pod_log(v1, "in-cluster").splitlines() == [f"{host} {port} tcp://{host}:{port}", "200"]

def test_sigterm_stops_cleanly_killing_container_processes_and_closing_ports(tmp_path):
    with SimCloud.start(small_fleet(), tmp_path) as cloud:
        v1 = cloud.core_v1()
        v1.create_namespaced_pod("default", {"metadata": {"name": "long"}, "spec": {
            "nodeName": "cpu-1", "restartPolicy": "Never", "containers": [{
                "name": "main", "image": "python:3.11",
                "command": ["sh", "-c", "python -c 'import time; time.sleep(60)' & echo $!; wait"]}]}})  # sleep-ok: the pod's own workload, not a wait
        wait_until(lambda: v1.read_namespaced_pod("long", "default").status.phase == "Running", timeout=10)
        child = int(wait_until(lambda: pod_log(v1, "long").strip(), timeout=10))
        ports = [cloud.info["k8s_port"], cloud.info["ecs_port"]]
        cloud.process.send_signal(signal.SIGTERM)
        assert cloud.process.wait(timeout=10) == 0
    assert "simcloud stopped" in cloud.log_text()
    assert "Traceback" not in cloud.log_text()
    wait_until(lambda: not process_alive(child), timeout=5, message="a container process outlived the server")
    for port in ports:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_sigint_stops_too(tmp_path):
    with SimCloud.start(small_fleet(), tmp_path) as cloud:
        cloud.process.send_signal(signal.SIGINT)
        assert cloud.process.wait(timeout=10) == 0


def test_fault_cli_shows_and_changes_faults_at_run_time(simcloud_factory):
    cloud = simcloud_factory(small_fleet(faults={"no_stock": ["ecs.gn6i-c4g1.xlarge"]}))
    shown = json.loads(cli("fault", "--workdir", str(cloud.workdir), "--show").stdout)
    assert shown["no_stock"] == ["ecs.gn6i-c4g1.xlarge"] and shown["ecs_throttle_rate"] == 0.0
    changed = json.loads(cli("fault", "--workdir", str(cloud.workdir), "--set", "ecs_throttle_rate=0.25",
                             "never_ready=gpu-t4-1,cpu-1", "no_stock=", "k8s_latency_ms=5").stdout)
    assert (changed["ecs_throttle_rate"], changed["never_ready"], changed["no_stock"], changed["k8s_latency_ms"]) \
        == (0.25, ["gpu-t4-1", "cpu-1"], [], 5)
    assert cloud.faults() == changed

    bad = cli("fault", "--workdir", str(cloud.workdir), "--set", "ecs_throttle=1", check=False)
    assert bad.returncode == 2 and "unknown fault 'ecs_throttle'" in bad.stderr
    bad = cli("fault", "--workdir", str(cloud.workdir), "--set", "ecs_throttle_rate=7", check=False)
    assert bad.returncode == 2 and "ecs_throttle_rate must be in [0, 1]" in bad.stderr
    assert cloud.faults()["ecs_throttle_rate"] == 0.25
    missing = cli("fault", "--workdir", str(cloud.workdir / "nowhere"), "--show", check=False)
    assert missing.returncode == 2 and "simcloud.json not found" in missing.stderr


def test_state_summarises_instances_and_nodes(simcloud_factory):
    cloud = simcloud_factory()
    state = json.loads(cli("state", "--workdir", str(cloud.workdir)).stdout)
    nodes = {n["name"]: n for n in state["nodes"]}
    assert nodes["cpu-1"]["ready"] == "True" and nodes["gpu-t4-1"]["ready"] == "Unknown"
    assert nodes["gpu-t4-1"]["allocatable_gpu"] == "1" and nodes["gpu-t4-1"]["registered_gpus"] == 0
    assert nodes["gpu-t4-1"]["provider_id"] == f"cn-hangzhou.{nodes['gpu-t4-1']['instance_id']}"
    assert {i["status"] for i in state["instances"]} == {"Running", "Stopped"}


def test_bad_fleet_is_refused_with_the_field_named(tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes:\n  - {name: a, instance_type: ecs.nope}\n")
    out = cli("serve", "--fleet", str(fleet), "--workdir", str(tmp_path / "wd"), check=False)
    assert out.returncode == 2
    assert "nodes[0].instance_type" in out.stderr and "ecs.nope" in out.stderr


@pytest.mark.kubectl
@pytest.mark.parametrize("kubectl", kubectl_binaries(), ids=str)
def test_kubectl_get_nodes_wide_shows_running_and_stopped_gpu_nodes_of_the_demo_fleet(simcloud_factory, kubectl):
    cloud = simcloud_factory(DEMO_FLEET)
    out = subprocess.run([str(kubectl), "--kubeconfig", str(cloud.kubeconfig), "get", "nodes", "-o", "wide"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:5] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"] and "INTERNAL-IP" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["gpu-t4-busy-1"][1] == "Ready" and rows["cpu-system-1"][1] == "Ready"
    for stopped in ("gpu-t4-1", "gpu-a10-1", "gpu-t4x2-1", "gpu-a10x2-1", "gpu-v100x4-1"):
        assert rows[stopped][1] == "NotReady", rows[stopped]
    assert rows["gpu-t4-1"][4] == "v1.30.1-aliyun.1" and rows["gpu-t4-1"][5].startswith("172.16.")


def test_apply_then_token_is_the_compose_bootstrap_and_the_token_has_only_the_shipped_rights(simcloud_factory):
    """What docker-compose's simcloud-bootstrap runs: the shipped manifests applied as the admin (a
    re-run changes nothing), then connections acting as the ServiceAccount, which may create pods in
    the job namespace and not in kube-system."""
    cloud = simcloud_factory()
    wd = str(cloud.workdir)
    manifests = [str(REPO_ROOT / "deploy/kubernetes/namespace.yaml"), str(REPO_ROOT / "deploy/kubernetes/rbac.yaml")]
    first = cli("apply", "--workdir", wd, *manifests).stdout.splitlines()
    assert "namespace/gpu-jobs created" in first and "serviceaccount/gpuboot created" in first
    again = cli("apply", "--workdir", wd, *manifests).stdout.splitlines()
    assert again == [line.replace(" created", " unchanged") for line in first]
    missing = cli("apply", "--workdir", wd, str(cloud.workdir / "nowhere.yaml"), check=False)
    assert missing.returncode == 2 and "simcloud apply: FileNotFoundError" in missing.stderr

    kubeconfig, connections = cloud.workdir / "kubeconfig-gpuboot", cloud.workdir / "connections-gpuboot.json"
    cli("token", "--workdir", wd, "--serviceaccount", "gpuboot/gpuboot", "--namespace", "gpu-jobs",
        "--kubeconfig", str(kubeconfig), "--connections", str(connections))
    conns = json.loads(connections.read_text())
    assert conns["kubernetes_default"] == kubernetes_connection(kubeconfig, "gpu-jobs")
    assert conns["alibaba_ecs_default"] == json.loads((cloud.workdir / "connections.json").read_text())[
        "alibaba_ecs_default"]
    from kubernetes.client.exceptions import ApiException
    v1 = cloud.core_v1(kubeconfig)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    v1.create_namespaced_pod("gpu-jobs", pod, dry_run="All")
    with pytest.raises(ApiException) as refused:
        v1.create_namespaced_pod("kube-system", pod, dry_run="All")
    assert refused.value.status == 403

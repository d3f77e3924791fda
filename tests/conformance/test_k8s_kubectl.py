"""kubectl (1.32 and Debian's 1.20, whichever exist) against the local Kubernetes API."""
from __future__ import annotations

import json
import queue
import re
import subprocess
import threading

import pytest

from tests.conformance.k8s_harness import KUBECTL_PARAMS, K8sServer, k8s, kubectl, pod_body, wait_until  # noqa: F401

NS = "default"
UNREACHABLE = [{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
               {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]

pytestmark = pytest.mark.parametrize("binary", KUBECTL_PARAMS)


def _rows(output: str) -> dict[str, dict[str, str]]:
    """Parse kubectl's column output into {NAME: {COLUMN: value}} using the header's column offsets."""
    lines = output.splitlines()
    columns = list(re.finditer(r"\S+(?: \S+)*", lines[0]))     # headers may hold one space ("NOMINATED NODE")
    names, starts = [m.group() for m in columns], [m.start() for m in columns]
    rows = {}
    for line in lines[1:]:
        cells = [line[s:e].strip() for s, e in zip(starts, [*starts[1:], len(line) + 1])]
        rows[cells[0]] = dict(zip(names, cells))
    return rows


def _set_status(k8s: K8sServer, name: str, status: dict) -> None:
    k8s.on_loop(lambda: k8s.store.mutate("pods", NS, name, lambda p: p["status"].update(status)))


@pytest.mark.both_backends
def test_get_nodes_wide_shows_real_statuses(binary, k8s: K8sServer):
    k8s.add_node("gpu-running", gpu=1, ip="10.0.0.11")
    k8s.add_node("gpu-stopped", gpu=1, ready=False, taints=UNREACHABLE, ip="10.0.0.12")
    k8s.add_node("gpu-cordoned", gpu=1, unschedulable=True, ip="10.0.0.13")
    k8s.add_node("master", labels={"node-role.kubernetes.io/control-plane": ""})
    rows = _rows(kubectl(binary, k8s, "get", "nodes", "-o", "wide").stdout)
    assert rows["gpu-running"]["STATUS"] == "Ready"
    assert rows["gpu-stopped"]["STATUS"] == "NotReady"
    assert rows["gpu-cordoned"]["STATUS"] == "Ready,SchedulingDisabled"
    assert rows["master"]["ROLES"] == "control-plane" and rows["gpu-running"]["ROLES"] == "<none>"
    assert rows["gpu-running"]["INTERNAL-IP"] == "10.0.0.11" and rows["gpu-running"]["VERSION"] == "v1.32.4"
    assert rows["gpu-running"]["CONTAINER-RUNTIME"] == "containerd://1.7.22"
    assert rows["gpu-running"]["AGE"].endswith("s")
    narrow = kubectl(binary, k8s, "get", "nodes").stdout.splitlines()[0].split()
    assert narrow == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    nodes = json.loads(kubectl(binary, k8s, "get", "nodes", "-o", "json").stdout)
    assert sorted(n["metadata"]["name"] for n in nodes["items"]) == sorted(rows)
    assert "providerID: cn-hangzhou.i-gpu-stopped" in kubectl(binary, k8s, "get", "node", "gpu-stopped", "-o",
                                                               "yaml").stdout


def test_get_pods_wide_shows_status_reasons(binary, k8s: K8sServer):
    k8s.add_node("gpu-a", gpu=8)
    v1 = k8s.core_v1()
    for name in ("running", "done", "rejected", "creating", "pending"):
        v1.create_namespaced_pod(NS, pod_body(name, gpu=1 if name != "pending" else 0,
                                              node_selector={"none": "x"} if name == "pending" else None))
    for name in ("running", "done", "rejected", "creating"):
        wait_until(lambda: v1.read_namespaced_pod(name, NS).spec.node_name)
    _set_status(k8s, "running", {"phase": "Running", "podIP": "172.16.0.5", "containerStatuses": [
        {"name": "main", "ready": True, "restartCount": 2, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})
    _set_status(k8s, "done", {"phase": "Succeeded", "containerStatuses": [
        {"name": "main", "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]})
    _set_status(k8s, "rejected", {"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": (
        "Pod Update plugin resources failed due to requested number of devices unavailable for nvidia.com/gpu. "
        "Requested: 1, Available: 0, which is unexpected.")})
    _set_status(k8s, "creating", {"containerStatuses": [
        {"name": "main", "ready": False, "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}]})
    rows = _rows(kubectl(binary, k8s, "get", "pods", "-o", "wide").stdout)
    assert {n: r["STATUS"] for n, r in rows.items()} == {
        "running": "Running", "done": "Completed", "rejected": "UnexpectedAdmissionError",
        "creating": "ContainerCreating", "pending": "Pending"}
    assert rows["running"]["READY"] == "1/1" and rows["running"]["RESTARTS"].startswith("2")
    assert rows["running"]["IP"] == "172.16.0.5" and rows["running"]["NODE"] == "gpu-a"
    assert rows["pending"]["NODE"] == "<none>" and rows["pending"]["NOMINATED NODE"] == "<none>"
    assert rows["pending"]["READINESS GATES"] == "<none>"
    all_ns = kubectl(binary, k8s, "get", "pods", "-A").stdout
    assert all_ns.splitlines()[0].split()[:2] == ["NAMESPACE", "NAME"] and "rejected" in all_ns
    assert "running" in kubectl(binary, k8s, "get", "pods", "-l", "!missing", "--field-selector",
                                "status.phase=Running").stdout


def test_describe_pod_and_node(binary, k8s: K8sServer):
    k8s.add_node("gpu-a", gpu=1, labels={"aliyun.accelerator/nvidia_name": "Tesla-T4"})
    v1 = k8s.core_v1()
    v1.create_namespaced_pod(NS, pod_body("small", gpu=1))
    v1.create_namespaced_pod(NS, pod_body("too-big", gpu=4))
    wait_until(lambda: v1.list_namespaced_event(NS, field_selector="involvedObject.name=too-big").items)
    pod = kubectl(binary, k8s, "describe", "pod", "too-big")
    assert "Status:" in pod.stdout and "Pending" in pod.stdout
    assert "FailedScheduling" in pod.stdout and "Insufficient nvidia.com/gpu" in pod.stdout
    assert "nvidia.com/gpu:  4" in pod.stdout
    node = kubectl(binary, k8s, "describe", "node", "gpu-a")
    assert "ProviderID:" in node.stdout and "cn-hangzhou.i-gpu-a" in node.stdout
    assert "small" in node.stdout and "nvidia.com/gpu" in node.stdout      # non-terminated pods + allocation
    assert "Events:" in pod.stdout and not pod.stderr.strip()


def test_delete_logs_and_events(binary, k8s: K8sServer):
    k8s.add_node("gpu-a", gpu=1)
    v1 = k8s.core_v1()
    v1.create_namespaced_pod(NS, pod_body("unbound", node_selector={"none": "x"}))
    assert 'pod "unbound" deleted' in kubectl(binary, k8s, "delete", "pod", "unbound").stdout
    assert "NotFound" in kubectl(binary, k8s, "get", "pod", "unbound", check=False).stderr
    v1.create_namespaced_pod(NS, pod_body("trainer"))
    wait_until(lambda: v1.read_namespaced_pod("trainer", NS).spec.node_name)
    k8s.logs.lines[(NS, "trainer")] = [b"step 1/2\n", b"step 2/2\n"]
    assert kubectl(binary, k8s, "logs", "trainer").stdout == "step 1/2\nstep 2/2\n"
    _set_status(k8s, "trainer", {"phase": "Succeeded"})
    assert kubectl(binary, k8s, "logs", "-f", "trainer", "--tail", "1").stdout == "step 2/2\n"
    events = kubectl(binary, k8s, "get", "events").stdout
    assert "Scheduled" in events and "pod/trainer" in events
    assert kubectl(binary, k8s, "delete", "pod", "trainer", "--grace-period=0", "--force").returncode == 0
    assert kubectl(binary, k8s, "get", "pods", "-o", "name").stdout == ""
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "ledger"}, "data": {"a": "1", "b": "2"}})
    assert _rows(kubectl(binary, k8s, "get", "cm").stdout)["ledger"]["DATA"] == "2"


def test_get_watch_streams_changes(binary, k8s: K8sServer):
    k8s.add_node("gpu-a", gpu=1)
    proc = subprocess.Popen([binary, "--kubeconfig", str(k8s.kubeconfig), "--cache-dir", str(k8s.workdir / "kc"),
                             "get", "nodes", "-w"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []

    def saw(text: str) -> bool:
        while not lines.empty():
            seen.append(lines.get())
        return any(text in line for line in seen)
    try:
        wait_until(lambda: saw("Ready"), timeout=15)
        k8s.on_loop(lambda: k8s.store.mutate("nodes", None, "gpu-a", lambda n: n["spec"].update(unschedulable=True)))
        wait_until(lambda: saw("SchedulingDisabled"), timeout=15)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert seen[0].split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert sum(1 for line in seen if line.startswith("NAME")) == 1     # one header for the whole watch

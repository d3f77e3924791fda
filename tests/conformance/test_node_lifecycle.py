"""The node-lifecycle controller and kubelet clocks seen through real clients: a stopped node stays
Ready=True for the grace period, then Unknown and tainted (NoSchedule, then NoExecute); its pods stay
Running, are evicted after their tolerations and hang Terminating until it is back; a quick
stop-then-start never shows Unknown; Node status is written on change or every report period while
the Lease is renewed on its own clock.

Driven through the official ECS SDK, `kubernetes`, `kubernetes_asyncio` watches and kubectl against
`python -m simcloud serve` with `small_fleet`'s short timings.
"""
from __future__ import annotations

import asyncio
import subprocess
import time

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from simcloud.harness import FAST_TIMINGS, pod_log, process_alive, small_fleet, wait_until
from tests.conformance.nodes import instance_status, snapshot, start_instance, stop_instance, watch_node
from tests.conftest import kubectl_binaries

NODE = "gpu-1"
RUNNING = [{"name": NODE, "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Running"}]
GRACE = FAST_TIMINGS["node_monitor_grace_seconds"]
UNREACHABLE = ["node.kubernetes.io/unreachable:NoExecute", "node.kubernetes.io/unreachable:NoSchedule"]


def run_pod(v1, name: str = "long") -> int:
    """A bound, Running pod whose container sleeps; returns its container's pid."""
    v1.create_namespaced_pod("default", {
        "metadata": {"name": name},
        "spec": {"nodeName": NODE, "restartPolicy": "Never", "containers": [{
            "name": "main", "image": "python:3.11",
            "command": ["python", "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"]}]}})  # sleep-ok: the pod's own workload, not a wait
    wait_until(lambda: v1.read_namespaced_pod(name, "default").status.phase == "Running", timeout=10)
    return int(wait_until(lambda: pod_log(v1, name).strip(), timeout=10))


def ready_of(node) -> str:
    return next(c.status for c in node.status.conditions if c.type == "Ready")


def pod_gone(v1, name: str) -> bool:
    try:
        v1.read_namespaced_pod(name, "default")
    except ApiException as exc:
        return exc.status == 404
    return False


def test_a_stopped_node_stays_ready_for_the_grace_period_then_is_unknown_and_tainted(simcloud_factory):
    cloud = simcloud_factory(small_fleet(RUNNING))
    v1 = cloud.core_v1()
    pid = run_pod(v1)
    before = v1.read_node(NODE)
    stopped_at = []

    def stop():
        stop_instance(cloud, NODE)
        stopped_at.append(time.monotonic())
    states = asyncio.run(watch_node(cloud.kubeconfig, NODE, on_ready=stop,
                                    until=lambda s: s[-1]["taints"] == UNREACHABLE, timeout=GRACE * 5 + 5))
    unknown_at = time.monotonic()
    wait_until(lambda: not process_alive(pid), timeout=5, message=f"container process {pid} survived the stop")
    assert instance_status(cloud, NODE) == "Stopped"

    # the controller noticed only after the grace period (counted from the last Lease renewal)
    assert unknown_at - stopped_at[0] >= GRACE - FAST_TIMINGS["lease_renew_seconds"] - 0.1, states
    first_unknown = next(i for i, s in enumerate(states) if s["ready"] == "Unknown")
    assert all(s["ready"] == "True" and not s["taints"] for s in states[:first_unknown]), states
    # conditions first, then NoSchedule, then NoExecute: three writes
    taints = [s["taints"] for s in states[first_unknown:]]
    assert [t for i, t in enumerate(taints) if i == 0 or t != taints[i - 1]] == [
        [], ["node.kubernetes.io/unreachable:NoSchedule"], UNREACHABLE], states
    node = v1.read_node(NODE)
    ready = next(c for c in node.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason, ready.message) == (
        "Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status.")
    assert all(c.status == "Unknown" for c in node.status.conditions)
    # the controller keeps the kubelet's last heartbeat, from before the grace period (whole seconds)
    assert (ready.last_transition_time - ready.last_heartbeat_time).total_seconds() >= int(GRACE) - 1
    assert node.status.allocatable["nvidia.com/gpu"] == "1"   # stale, as a stopped kubelet leaves it
    assert node.status.node_info.boot_id == before.status.node_info.boot_id
    events = v1.list_namespaced_event("default", field_selector=f"involvedObject.name={NODE},reason=NodeNotReady")
    assert [e.source.component for e in events.items] == ["node-controller"]


def test_pods_of_a_stopped_node_stay_running_are_evicted_after_their_toleration_and_hang_terminating(
        simcloud_factory):
    cloud = simcloud_factory(small_fleet(RUNNING))
    v1 = cloud.core_v1()
    run_pod(v1)
    tolerated = next(t for t in v1.read_namespaced_pod("long", "default").spec.tolerations
                     if t.key == "node.kubernetes.io/unreachable")
    assert (tolerated.effect, tolerated.toleration_seconds) == ("NoExecute", FAST_TIMINGS["default_toleration_seconds"])
    stop_instance(cloud, NODE)
    wait_until(lambda: instance_status(cloud, NODE) == "Stopped", timeout=5)
    assert v1.read_namespaced_pod("long", "default").status.phase == "Running"   # nobody reports its death

    tainted = wait_until(lambda: any(t.effect == "NoExecute" for t in v1.read_node(NODE).spec.taints or []),
                         timeout=GRACE * 5)
    assert tainted and v1.read_namespaced_pod("long", "default").metadata.deletion_timestamp is None
    tainted_at = time.monotonic()
    pod = wait_until(lambda: (p := v1.read_namespaced_pod("long", "default")).metadata.deletion_timestamp and p,
                     timeout=FAST_TIMINGS["default_toleration_seconds"] * 5 + 5)
    assert time.monotonic() - tainted_at >= FAST_TIMINGS["default_toleration_seconds"] - 0.3
    assert pod.status.phase == "Running"                # Terminating: deleted, but no kubelet to finish it
    target = next(c for c in pod.status.conditions if c.type == "DisruptionTarget")
    assert (target.status, target.reason) == ("True", "DeletionByTaintManager")
    evicted = v1.list_namespaced_event("default", field_selector="involvedObject.name=long,reason=TaintManagerEviction")
    assert [e.message for e in evicted.items] == ["Marking for deletion Pod default/long"]

    # it stays Terminating: a watch over two grace periods sees it neither go nor change phase
    w = kubernetes.watch.Watch()
    seen = [(e["type"], e["object"].status.phase) for e in w.stream(
        v1.list_namespaced_pod, "default", field_selector="metadata.name=long",
        resource_version=pod.metadata.resource_version, timeout_seconds=int(GRACE * 2))]
    assert all(kind == "MODIFIED" and phase == "Running" for kind, phase in seen), seen
    assert not pod_gone(v1, "long")

    # the node comes back: its kubelet finishes the deletion
    start_instance(cloud, NODE)
    wait_until(lambda: pod_gone(v1, "long"), timeout=15)


def test_a_force_delete_removes_a_pod_of_a_stopped_node_at_once(simcloud_factory):
    cloud = simcloud_factory(small_fleet(RUNNING, timings={"default_toleration_seconds": 3600}))
    v1 = cloud.core_v1()
    run_pod(v1)
    stop_instance(cloud, NODE)
    wait_until(lambda: ready_of(v1.read_node(NODE)) == "Unknown", timeout=GRACE * 5)
    v1.delete_namespaced_pod("long", "default")                     # graceful: stays Terminating
    assert v1.read_namespaced_pod("long", "default").metadata.deletion_timestamp is not None
    assert not pod_gone(v1, "long")
    v1.delete_namespaced_pod("long", "default", grace_period_seconds=0)
    assert pod_gone(v1, "long")


def test_a_pod_running_when_the_power_went_fails_when_the_node_is_back(simcloud_factory):
    cloud = simcloud_factory(small_fleet(RUNNING, timings={"default_toleration_seconds": 3600}))
    v1 = cloud.core_v1()
    run_pod(v1)
    stop_instance(cloud, NODE)
    wait_until(lambda: instance_status(cloud, NODE) == "Stopped", timeout=5)
    start_instance(cloud, NODE)
    pod = wait_until(lambda: (p := v1.read_namespaced_pod("long", "default")).status.phase == "Failed" and p,
                     timeout=15)
    terminated = pod.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (137, "Error")


def test_graceful_node_shutdown_fails_the_pods_before_the_power_goes(simcloud_factory):
    cloud = simcloud_factory(small_fleet(RUNNING, timings={"shutdown_grace_seconds": 1}))
    v1 = cloud.core_v1()
    pid = run_pod(v1)
    stop_instance(cloud, NODE)
    pod = wait_until(lambda: (p := v1.read_namespaced_pod("long", "default")).status.phase == "Failed" and p,
                     timeout=10)
    assert pod.status.reason == "Terminated"
    assert pod.status.message == "Pod was terminated in response to imminent node shutdown."
    assert any(c.type == "DisruptionTarget" and c.status == "True" for c in pod.status.conditions)
    wait_until(lambda: not process_alive(pid), timeout=5, message=f"container process {pid} survived the stop")


@pytest.mark.parametrize("order", ["stale-first", "kubelet"])
def test_a_quick_stop_then_start_inside_the_grace_period_never_shows_unknown(simcloud_factory, order):
    """The harsh case for readiness: the old Ready=True, bootID and GPU count still show when the
    start is accepted; only the new boot's own writes tell them apart."""
    cloud = simcloud_factory(small_fleet(RUNNING, timings={"node_monitor_grace_seconds": 60},
                                         faults={"boot_order": {"*": order}}))
    v1 = cloud.core_v1()
    before = snapshot(v1.read_node(NODE))
    stop_instance(cloud, NODE)
    wait_until(lambda: instance_status(cloud, NODE) == "Stopped", timeout=5)
    stale = snapshot(v1.read_node(NODE))
    assert (stale["ready"], stale["boot"], stale["gpu"], stale["taints"]) == ("True", before["boot"], "1", [])

    states = asyncio.run(watch_node(
        cloud.kubeconfig, NODE, on_ready=lambda: start_instance(cloud, NODE), timeout=20,
        until=lambda s: s[-1]["boot"] != before["boot"] and s[-1]["gpu"] == "1" and s[-1]["ready"] == "True"
        and any(x["gpu"] == "0" for x in s)))
    assert all(s["ready"] != "Unknown" for s in states), states
    gpus = [s["gpu"] for s in states]
    assert [g for i, g in enumerate(gpus) if i == 0 or g != gpus[i - 1]] == ["1", "0", "1"], states
    if order == "kubelet":     # the registration zero comes with the old bootID and the old Ready=True
        zero = next(s for s in states if s["gpu"] == "0")
        assert (zero["boot"], zero["ready"]) == (before["boot"], "True")
        assert any(s["ready"] == "False" and s["boot"] != before["boot"] for s in states)
        wait_until(lambda: not v1.read_node(NODE).spec.taints, timeout=5)   # not-ready taints come and go


def test_node_status_is_written_on_change_or_per_report_period_while_the_lease_keeps_it_ready(simcloud_factory):
    cloud = simcloud_factory(small_fleet(RUNNING, timings={"heartbeat_seconds": 3600}))
    v1 = cloud.core_v1()
    coord = kubernetes.client.CoordinationV1Api(cloud.api_client())
    node = v1.read_node(NODE)
    renewed = coord.read_namespaced_lease(NODE, "kube-node-lease").spec.renew_time
    w = kubernetes.watch.Watch()
    seen = [e["type"] for e in w.stream(v1.list_node, field_selector=f"metadata.name={NODE}",
                                        resource_version=node.metadata.resource_version,
                                        timeout_seconds=int(GRACE * 2))]
    assert seen == [], "no Node write without a change inside the report period"
    assert ready_of(v1.read_node(NODE)) == "True"        # the Lease alone kept it Ready past the grace period
    assert coord.read_namespaced_lease(NODE, "kube-node-lease").spec.renew_time > renewed


@pytest.mark.kubectl
@pytest.mark.parametrize("kubectl", kubectl_binaries(), ids=str)
def test_kubectl_shows_a_stopped_node_ready_then_not_ready_and_its_pod_terminating(simcloud_factory, kubectl,
                                                                                     tmp_path):
    grace = 6.0        # long enough for kubectl to read the stopped node while it still shows Ready
    cloud = simcloud_factory(small_fleet(RUNNING, timings={"node_monitor_grace_seconds": grace}))
    v1 = cloud.core_v1()
    run_pod(v1)

    def get(*args: str) -> str:
        out = subprocess.run([str(kubectl), "--kubeconfig", str(cloud.kubeconfig), "--cache-dir",
                              str(tmp_path / "kcache"), "get", *args, "--no-headers"], capture_output=True,
                             text=True, timeout=30, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        return out.stdout

    stop_instance(cloud, NODE)
    wait_until(lambda: instance_status(cloud, NODE) == "Stopped", timeout=5)
    assert get("node", NODE).split()[1] == "Ready"
    wait_until(lambda: get("node", NODE).split()[1] == "NotReady", timeout=grace * 3)
    wait_until(lambda: get("pod", "long").split()[2] == "Terminating", timeout=10)

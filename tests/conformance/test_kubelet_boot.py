"""Emulated kubelets seen through real clients: the boot sequence after StartInstances, stops, faults.

Driven through the official ECS SDK, `kubernetes_asyncio` watches and the `kubernetes` client against
`python -m simcloud serve`.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from alibabacloud_ecs20140526 import models as ecs_models
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio import config as aconfig
from kubernetes_asyncio import watch as awatch

from simcloud.testing import pod_log, process_alive, small_fleet, wait_until

GPU_NODE = "gpu-v100x4-1"
FLEET = small_fleet([
    {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"},
    {"name": GPU_NODE, "instance_type": "ecs.gn6v-c8g1.8xlarge", "status": "Stopped"},
])
BOOT_TOTAL = sum(FLEET["timings"][k] for k in ("start_seconds", "boot_seconds", "stale_seconds",
                                               "device_plugin_seconds"))



def start_instance(cloud, node: str) -> None:
    cloud.ecs_client().start_instances(ecs_models.StartInstancesRequest(
        region_id=cloud.region, instance_id=[cloud.instance_id(node)]))


def stop_instance(cloud, node: str) -> None:
    cloud.ecs_client().stop_instances(ecs_models.StopInstancesRequest(
        region_id=cloud.region, instance_id=[cloud.instance_id(node)], stopped_mode="StopCharging"))


def snapshot(node) -> dict:
    ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
    return {"rv": int(node.metadata.resource_version), "ready": ready.status if ready else None,
            "gpu": (node.status.allocatable or {}).get("nvidia.com/gpu"),
            "boot": node.status.node_info.boot_id,
            "taints": sorted(f"{t.key}:{t.effect}" for t in node.spec.taints or [])}


async def watch_node(kubeconfig, name: str, until, timeout: float, on_ready=None) -> list[dict]:
    """Every state of Node `name` seen by a kubernetes_asyncio watch, until `until(states)` or `timeout`."""
    api = await aconfig.new_client_from_config(config_file=str(kubeconfig))
    states: list[dict] = []
    try:
        v1 = aclient.CoreV1Api(api)
        current = await v1.read_node(name)
        states.append(snapshot(current))
        if on_ready is not None:
            await asyncio.get_running_loop().run_in_executor(None, on_ready)
        w = awatch.Watch()
        deadline = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                async for event in w.stream(v1.list_node, field_selector=f"metadata.name={name}",
                                            resource_version=current.metadata.resource_version,
                                            timeout_seconds=max(1, int(timeout) + 1)):
                    states.append(snapshot(event["object"]))
                    if until(states) or time.monotonic() > deadline:
                        break
        except TimeoutError:
            pass
        finally:
            w.stop()
    finally:
        await api.close()
    return states


def test_start_shows_new_boot_ready_then_gpu_stale_zero_real(simcloud_factory):
    cloud = simcloud_factory(FLEET)
    before = cloud.core_v1().read_node(GPU_NODE)
    assert snapshot(before)["ready"] == "Unknown"
    assert snapshot(before)["gpu"] == "4"          # the stale count from before the stop
    assert snapshot(before)["taints"] == ["node.kubernetes.io/unreachable:NoExecute",
                                          "node.kubernetes.io/unreachable:NoSchedule"]

    states = asyncio.run(watch_node(cloud.kubeconfig, GPU_NODE, on_ready=lambda: start_instance(cloud, GPU_NODE),
                                    until=lambda s: s[-1]["gpu"] == "4" and s[-1]["ready"] == "True"
                                    and any(x["gpu"] == "0" for x in s), timeout=BOOT_TOTAL * 5 + 5))
    old_boot = states[0]["boot"]
    first_ready = next(i for i, s in enumerate(states) if s["ready"] == "True")
    assert states[first_ready]["boot"] != old_boot, "the first Ready must come from the new boot"
    assert states[first_ready]["gpu"] == "4", "Ready is posted while the GPU count is still stale"
    assert states[first_ready]["taints"] == []
    assert all(s["boot"] == old_boot and s["ready"] != "True" for s in states[:first_ready])
    # the GPU values seen from the first Ready on: stale -> 0 -> real, each a separate write
    gpus = [s["gpu"] for s in states[first_ready:]]
    collapsed = [g for i, g in enumerate(gpus) if i == 0 or g != gpus[i - 1]]
    assert collapsed == ["4", "0", "4"], states
    assert [s["rv"] for s in states] == sorted(s["rv"] for s in states)

    node = cloud.core_v1().read_node(GPU_NODE)
    assert node.status.capacity["nvidia.com/gpu"] == "4"
    ready = next(c for c in node.status.conditions if c.type == "Ready")
    assert ready.reason == "KubeletReady"
    # heartbeats keep coming while Ready
    beat = ready.last_heartbeat_time
    wait_until(lambda: next(c for c in cloud.core_v1().read_node(GPU_NODE).status.conditions
                            if c.type == "Ready").last_heartbeat_time > beat, timeout=5)


def test_kubelet_order_zeroes_with_the_old_boot_id_then_posts_not_ready_then_ready(simcloud_factory):
    """As a restarted kubelet writes it: registration patch (extended resources zeroed, old bootID),
    new bootID with Ready=False, Ready=True, then the device plugin's real count."""
    cloud = simcloud_factory(small_fleet(FLEET["nodes"], faults={"boot_order": {GPU_NODE: "kubelet"}}))
    states = asyncio.run(watch_node(cloud.kubeconfig, GPU_NODE, on_ready=lambda: start_instance(cloud, GPU_NODE),
                                    until=lambda s: s[-1]["gpu"] == "4" and s[-1]["ready"] == "True"
                                    and any(x["gpu"] == "0" for x in s), timeout=BOOT_TOTAL * 5 + 5))
    old_boot = states[0]["boot"]
    first_zero = next(i for i, s in enumerate(states) if s["gpu"] == "0")
    assert states[first_zero]["boot"] == old_boot and states[first_zero]["ready"] == "Unknown"
    new_boot = next(s for s in states if s["boot"] != old_boot)
    assert new_boot["ready"] == "False" and new_boot["gpu"] == "0"
    assert not [s for s in states if s["ready"] == "True" and s["gpu"] == "4" and s["boot"] == old_boot]
    first_ready = next(s for s in states if s["ready"] == "True")
    assert first_ready["gpu"] == "0" and first_ready["taints"] == []
    gpus = [s["gpu"] for s in states]
    assert [g for i, g in enumerate(gpus) if i == 0 or g != gpus[i - 1]] == ["4", "0", "4"]


def test_reset_and_registration_delays_hold_the_stale_count_and_the_zero(simcloud_factory):
    cloud = simcloud_factory(small_fleet(FLEET["nodes"], faults={"gpu_reset_delay_seconds": {GPU_NODE: 3},
                                                                 "gpu_register_delay_seconds": {"*": 2}}))
    times: dict[str, float] = {}

    def until(states):
        now = time.monotonic()
        if states[-1]["ready"] == "True":
            times.setdefault(f"gpu={states[-1]['gpu']}", now)
        return "gpu=0" in times and states[-1]["gpu"] == "4" and states[-1]["ready"] == "True"

    asyncio.run(watch_node(cloud.kubeconfig, GPU_NODE, on_ready=lambda: start_instance(cloud, GPU_NODE),
                           until=until, timeout=BOOT_TOTAL * 5 + 20))
    stale_for = times["gpu=0"] - times["gpu=4"]
    timings = FLEET["timings"]
    assert stale_for >= timings["stale_seconds"] + 3 - 0.2, times
    assert cloud.faults()["gpu_reset_delay_seconds"] == {GPU_NODE: 3.0}


def test_compaction_ends_open_watches_and_resuming_from_before_it_is_410(simcloud_factory):
    from kubernetes import watch
    from kubernetes.client.exceptions import ApiException

    cloud = simcloud_factory(FLEET)
    v1 = cloud.core_v1()
    old = v1.read_node(GPU_NODE).metadata.resource_version
    start_instance(cloud, GPU_NODE)     # writes after `old`
    wait_until(lambda: v1.read_node(GPU_NODE).metadata.resource_version != old, timeout=BOOT_TOTAL * 5)
    rv = cloud.compact()
    assert rv >= int(old)
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(v1.list_node, resource_version=old, timeout_seconds=2):
            pass
    assert gone.value.status == 410
    events = list(watch.Watch().stream(v1.list_node, field_selector=f"metadata.name={GPU_NODE}",
                                       resource_version=str(rv), timeout_seconds=1))
    assert all(int(e["object"].metadata.resource_version) > rv for e in events)


def test_stop_makes_node_not_ready_tainted_and_fails_its_pod(simcloud_factory):
    cloud = simcloud_factory(small_fleet([{"name": "gpu-1", "instance_type": "ecs.gn6i-c4g1.xlarge",
                                           "status": "Running"}]))
    v1 = cloud.core_v1()
    v1.create_namespaced_pod("default", {
        "metadata": {"name": "long"},
        "spec": {"nodeName": "gpu-1", "restartPolicy": "Never", "containers": [{
            "name": "main", "image": "python:3.11",
            "command": ["python", "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]}]}})  # sleep-ok: the pod's own workload, not a wait
    wait_until(lambda: v1.read_namespaced_pod("long", "default").status.phase == "Running", timeout=10)
    pid = int(wait_until(lambda: pod_log(v1, "long").strip(), timeout=10))

    stop_instance(cloud, "gpu-1")
    pod = wait_until(lambda: (p := v1.read_namespaced_pod("long", "default")).status.phase == "Failed" and p,
                     timeout=10)
    assert pod.status.reason == "Terminated"
    assert pod.status.message == "Pod was terminated in response to imminent node shutdown."
    assert any(c.type == "DisruptionTarget" and c.status == "True" for c in pod.status.conditions)
    assert pod.status.container_statuses[0].state.terminated is not None
    wait_until(lambda: not process_alive(pid), timeout=5, message=f"container process {pid} survived the stop")

    node = v1.read_node("gpu-1")
    ready = next(c for c in node.status.conditions if c.type == "Ready")
    assert (ready.status, ready.message) == ("Unknown", "Kubelet stopped posting node status.")
    assert sorted((t.key, t.effect) for t in node.spec.taints) == [
        ("node.kubernetes.io/unreachable", "NoExecute"), ("node.kubernetes.io/unreachable", "NoSchedule")]
    assert node.status.allocatable["nvidia.com/gpu"] == "1"   # stale, as a stopped kubelet leaves it
    wait_until(lambda: _instance_status(cloud, "gpu-1") == "Stopped", timeout=5)


def test_never_ready_fault_holds_the_boot_until_cleared_through_the_cli(simcloud_factory):
    cloud = simcloud_factory(small_fleet([{"name": "gpu-1", "instance_type": "ecs.gn6i-c4g1.xlarge"}],
                                         faults={"never_ready": ["gpu-1"]}))
    start_instance(cloud, "gpu-1")
    wait_until(lambda: _instance_status(cloud, "gpu-1") == "Running", timeout=5)
    window = BOOT_TOTAL * 2
    states = asyncio.run(watch_node(cloud.kubeconfig, "gpu-1", until=lambda s: s[-1]["ready"] == "True",
                                    timeout=window))
    assert all(s["ready"] == "Unknown" for s in states), states

    out = subprocess.run([sys.executable, "-m", "simcloud", "fault", "--workdir", str(cloud.workdir),
                          "--set", "never_ready="], capture_output=True, text=True, check=True).stdout
    assert '"never_ready": []' in out
    wait_until(lambda: cloud.node_ready("gpu-1"), timeout=5)


def test_device_plugin_never_keeps_gpus_at_zero(simcloud_factory):
    cloud = simcloud_factory(small_fleet([{"name": "gpu-1", "instance_type": "ecs.gn6i-c4g1.xlarge"}]))
    iid = cloud.instance_id("gpu-1")
    cloud.set_faults(device_plugin_never=[iid])        # by instance id this time
    start_instance(cloud, "gpu-1")
    v1 = cloud.core_v1()
    wait_until(lambda: v1.read_node("gpu-1").status.allocatable["nvidia.com/gpu"] == "0", timeout=10)
    window = FLEET["timings"]["device_plugin_seconds"] * 4
    states = asyncio.run(watch_node(cloud.kubeconfig, "gpu-1", until=lambda s: s[-1]["gpu"] != "0",
                                    timeout=window))
    assert all(s["gpu"] == "0" and s["ready"] == "True" for s in states), states
    assert next(n for n in cloud.state()["nodes"] if n["name"] == "gpu-1")["blocked"] == "plugin"
    cloud.set_faults(device_plugin_never=[])
    wait_until(lambda: v1.read_node("gpu-1").status.allocatable["nvidia.com/gpu"] == "1", timeout=5)


def _instance_status(cloud, node: str) -> str:
    iid = cloud.instance_id(node)
    return next(i["status"] for i in cloud.state()["instances"] if i["instance_id"] == iid)


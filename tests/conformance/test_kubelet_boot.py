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

from simcloud.harness import small_fleet, wait_until
from tests.conformance.nodes import instance_status, snapshot, start_instance, watch_node

GPU_NODE = "gpu-v100x4-1"
FLEET = small_fleet([
    {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"},
    {"name": GPU_NODE, "instance_type": "ecs.gn6v-c8g1.8xlarge", "status": "Stopped"},
])
BOOT_TOTAL = sum(FLEET["timings"][k] for k in ("start_seconds", "boot_seconds", "stale_seconds",
                                               "device_plugin_seconds"))


def booted(states: list[dict]) -> bool:
    """The boot is over: Ready, the real count after a zero, and the controller's taints gone."""
    return states[-1]["gpu"] == "4" and states[-1]["ready"] == "True" and not states[-1]["taints"] \
        and any(x["gpu"] == "0" for x in states)


def assert_taints_removed_after_ready(states: list[dict]) -> None:
    """The node-lifecycle controller, not the kubelet, removes the taints: never before Ready=True,
    in a write of its own after it."""
    untainted = next(i for i, s in enumerate(states) if not s["taints"])
    first_ready = next(i for i, s in enumerate(states) if s["ready"] == "True")
    assert states[first_ready]["taints"], "Ready=True and the taints' removal are separate writes"
    assert untainted > first_ready and all(s["ready"] == "True" for s in states[first_ready:]), states
    assert all(t.startswith(("node.kubernetes.io/unreachable:", "node.kubernetes.io/not-ready:"))
               for s in states[:untainted] for t in s["taints"]), states


def test_start_shows_new_boot_ready_then_gpu_stale_zero_real(simcloud_factory):
    cloud = simcloud_factory(FLEET)
    before = cloud.core_v1().read_node(GPU_NODE)
    assert snapshot(before)["ready"] == "Unknown"
    assert snapshot(before)["gpu"] == "4"          # the stale count from before the stop
    assert snapshot(before)["taints"] == ["node.kubernetes.io/unreachable:NoExecute",
                                          "node.kubernetes.io/unreachable:NoSchedule"]

    states = asyncio.run(watch_node(cloud.kubeconfig, GPU_NODE, on_ready=lambda: start_instance(cloud, GPU_NODE),
                                    until=booted, timeout=BOOT_TOTAL * 5 + 5))
    old_boot = states[0]["boot"]
    first_ready = next(i for i, s in enumerate(states) if s["ready"] == "True")
    assert states[first_ready]["boot"] != old_boot, "the first Ready must come from the new boot"
    assert states[first_ready]["gpu"] == "4", "Ready is posted while the GPU count is still stale"
    assert_taints_removed_after_ready(states)
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
                                    until=booted, timeout=BOOT_TOTAL * 5 + 5))
    old_boot = states[0]["boot"]
    first_zero = next(i for i, s in enumerate(states) if s["gpu"] == "0")
    assert states[first_zero]["boot"] == old_boot and states[first_zero]["ready"] == "Unknown"
    new_boot = next(s for s in states if s["boot"] != old_boot)
    assert new_boot["ready"] == "False" and new_boot["gpu"] == "0"
    assert not [s for s in states if s["ready"] == "True" and s["gpu"] == "4" and s["boot"] == old_boot]
    first_ready = next(s for s in states if s["ready"] == "True")
    assert first_ready["gpu"] == "0"
    assert_taints_removed_after_ready(states)
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


def test_never_ready_fault_holds_the_boot_until_cleared_through_the_cli(simcloud_factory):
    cloud = simcloud_factory(small_fleet([{"name": "gpu-1", "instance_type": "ecs.gn6i-c4g1.xlarge"}],
                                         faults={"never_ready": ["gpu-1"]}))
    start_instance(cloud, "gpu-1")
    wait_until(lambda: instance_status(cloud, "gpu-1") == "Running", timeout=5)
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

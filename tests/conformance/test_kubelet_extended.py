"""Every device plugin's resource after a boot, through real clients: GPU sharing's aliyun.com/gpu-mem and a
declared RDMA device go stale -> 0 -> real like nvidia.com/gpu, each registered by its own plugin (after the
NVIDIA one), and the kubelet refuses a pod asking for any of them before its plugin registered."""
from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio import config as aconfig
from kubernetes_asyncio import watch as awatch

from simcloud.fleet import FleetError, load_fleet
from simcloud.harness import SimCloud, pod_log, small_fleet, wait_until
from simcloud.machines.kubelet import admission_message
from tests.conformance.nodes import instance_status, start_instance, stop_instance

GPU, GPU_MEM, RDMA = "nvidia.com/gpu", "aliyun.com/gpu-mem", "rdma/hca"
SHARED = "t4x2-share"
FLEET = small_fleet([
    {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"},
    {"name": SHARED, "instance_type": "ecs.gn6i-c24g1.12xlarge", "status": "Stopped",
     "labels": {"ack.node.gpu.schedule": "share"}, "extended_resources": {RDMA: 2}},
], timings={"device_plugin_seconds": 1.5})      # wide windows between registrations, even on a slow machine
REAL = {GPU: "2", GPU_MEM: "28", RDMA: "2"}      # 2 x T4 (15,109 MiB: 14 whole GiB each)


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    with SimCloud.start(FLEET, tmp_path_factory.mktemp("simcloud")) as running:
        yield running


def counts(node: dict) -> dict:
    allocatable = node["status"].get("allocatable") or {}
    return {r: allocatable.get(r) for r in REAL}


async def boot_states(cloud, name: str, timeout: float) -> list[dict]:
    """Every state of the Node from before the start until each resource shows its real count after a 0."""
    api = await aconfig.new_client_from_config(config_file=str(cloud.kubeconfig))
    try:
        v1 = aclient.CoreV1Api(api)
        current = await v1.read_node(name, _preload_content=False)
        node = await current.json()
        states = [counts(node)]
        await asyncio.get_running_loop().run_in_executor(None, start_instance, cloud, name)
        async with asyncio.timeout(timeout):
            async for event in awatch.Watch().stream(v1.list_node, field_selector=f"metadata.name={name}",
                                                     resource_version=node["metadata"]["resourceVersion"],
                                                     timeout_seconds=int(timeout) + 1):
                states.append(counts(event["raw_object"]))
                if states[-1] == REAL and any(s[GPU_MEM] == "0" for s in states):
                    return states
    finally:
        await api.close()
    raise AssertionError(f"boot not finished in {timeout}s: {states}")


def collapsed(values: list) -> list:
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def test_gpu_mem_and_declared_resources_go_stale_zero_real_one_plugin_after_another(cloud):
    before = cloud.core_v1().read_node(SHARED).status
    assert {r: before.capacity[r] for r in REAL} == {r: before.allocatable[r] for r in REAL} == REAL   # stale
    states = asyncio.run(boot_states(cloud, SHARED, timeout=60))
    for resource in REAL:
        assert collapsed([s[resource] for s in states]) == [REAL[resource], "0", REAL[resource]], (resource, states)
    zero = next(i for i, s in enumerate(states) if s[GPU] == "0")
    assert states[zero] == dict.fromkeys(REAL, "0"), "the kubelet zeroes every extended resource in one write"
    # registrations in the plugins' order, one write each: a rule looking at nvidia.com/gpu alone commits early
    registered = [next(i for i, s in enumerate(states) if i > zero and s[r] != "0") for r in (GPU, GPU_MEM, RDMA)]
    assert registered == sorted(registered) and len(set(registered)) == 3, states
    assert states[registered[0]][GPU_MEM] == "0"


def gpu_mem_pod(name: str, gib: int, command: str = "import os; print(os.environ['ALIYUN_COM_GPU_MEM_CONTAINER'])",
                **extra) -> dict:
    return {"metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "nodeName": SHARED,
        "containers": [{"name": "main", "image": "python:3.11-slim", "command": ["python", "-c", command],
                        "resources": {"limits": {GPU_MEM: str(gib), **extra}}}]}}


def final(v1, name: str):
    return wait_until(lambda: (p := v1.read_namespaced_pod(name, "default")).status.phase in ("Succeeded", "Failed")
                      and p, timeout=20)


def test_admission_refuses_a_gpu_mem_pod_until_its_plugin_registered_then_counts_what_is_held(cloud):
    v1 = cloud.core_v1()
    if instance_status(cloud, SHARED) != "Stopped":      # left up by the test above
        wait_until(lambda: instance_status(cloud, SHARED) == "Running", timeout=20)
        stop_instance(cloud, SHARED)
        wait_until(lambda: instance_status(cloud, SHARED) == "Stopped", timeout=20)
    start_instance(cloud, SHARED)
    # bound while nvidia.com/gpu is registered again but gpu-mem still reads 0
    wait_until(lambda: (a := v1.read_node(SHARED).status.allocatable)[GPU] == "2" and a[GPU_MEM] == "0",
               timeout=30, interval=0.05)
    v1.create_namespaced_pod("default", gpu_mem_pod("mem-early", 8))
    pod = final(v1, "mem-early")
    assert (pod.status.phase, pod.status.reason) == ("Failed", "UnexpectedAdmissionError")
    assert pod.status.message == admission_message(8, 0, GPU_MEM)

    wait_until(lambda: {r: v1.read_node(SHARED).status.allocatable[r] for r in REAL} == REAL, timeout=30)
    v1.create_namespaced_pod("default", gpu_mem_pod("mem-holder", 20, "import time; time.sleep(60)",  # sleep-ok: workload
                                                    **{RDMA: "1"}))
    wait_until(lambda: v1.read_namespaced_pod("mem-holder", "default").status.phase == "Running", timeout=20)
    v1.create_namespaced_pod("default", gpu_mem_pod("mem-more", 10))          # 28 - 20 = 8 left
    pod = final(v1, "mem-more")
    assert (pod.status.reason, pod.status.message) == ("UnexpectedAdmissionError", admission_message(10, 8, GPU_MEM))
    v1.create_namespaced_pod("default", gpu_mem_pod("mem-fits", 8))
    pod = final(v1, "mem-fits")
    assert pod.status.phase == "Succeeded" and pod_log(v1, "mem-fits") == "8\n"
    v1.create_namespaced_pod("default", gpu_mem_pod("no-plugin", 1, **{"example.com/fpga": "1"}))
    pod = final(v1, "no-plugin")
    assert pod.status.reason == "OutOfexample.com/fpga" and "example.com/fpga, requested: 1" in pod.status.message
    v1.delete_namespaced_pod("mem-holder", "default", grace_period_seconds=0)


def test_fleet_extended_resources_must_be_device_plugin_names():
    for bad in ({"cpu": 1}, {"kubernetes.io/x": 1}, {GPU: 1}, {RDMA: -1}):
        with pytest.raises(FleetError, match="extended_resources"):
            load_fleet(small_fleet([{"name": "n", "instance_type": "ecs.gn6i-c4g1.xlarge",
                                     "extended_resources": bad}]))
    node = load_fleet(small_fleet([{"name": "n", "instance_type": "ecs.gn6i-c4g1.xlarge",
                                    "labels": {"ack.node.gpu.schedule": "cgpu"}}])).nodes[0]
    assert node.device_resources() == {GPU: 1, GPU_MEM: 14}

"""Kubernetes and ECS objects in API form for unit tests of the pure core, and the little of
Airflow's context a step reads."""
from __future__ import annotations

from datetime import UTC, datetime

from gpuboot.core.resources import GPU

REGION = "cn-hangzhou"


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node(name: str, *, gpus: int = 1, cpu: str = "8", memory: str = "32Gi", ready: str = "True",
         instance: str | None = "auto", heartbeat: float | None = None, transition: float | None = None,
         boot_id: str = "boot-1", unschedulable: bool = False, taints=(), labels=None, provider_prefix: str = "",
         allocatable: dict | None = None, gpu_model: str | None = "Tesla-T4") -> dict:
    """A Node; `instance="auto"` ties it to ECS instance i-<name>, None leaves providerID out."""
    alloc = allocatable if allocatable is not None else {"cpu": cpu, "memory": memory, "pods": "110",
                                                         **({GPU: str(gpus)} if gpus else {})}
    all_labels = {"kubernetes.io/hostname": f"host-{name}", **(labels or {})}
    if gpus and gpu_model:
        all_labels["aliyun.accelerator/nvidia_name"] = gpu_model
    condition = {"type": "Ready", "status": ready, "reason": "KubeletReady" if ready == "True" else "NodeStatusUnknown"}
    if heartbeat is not None:
        condition["lastHeartbeatTime"] = iso(heartbeat)
    if transition is not None:
        condition["lastTransitionTime"] = iso(transition)
    spec = {"taints": list(taints)}
    if unschedulable:
        spec["unschedulable"] = True
    if instance is not None:
        spec["providerID"] = f"{provider_prefix}{REGION}.{instance_id(name) if instance == 'auto' else instance}"
    return {
        "metadata": {"name": name, "labels": all_labels, "annotations": {}},
        "spec": spec,
        "status": {"allocatable": alloc, "capacity": dict(alloc), "conditions": [condition],
                   "nodeInfo": {"bootID": boot_id}},
    }


def instance_id(node_name: str) -> str:
    return f"i-{node_name.replace('-', '')}"


def instance(node_name: str, status: str = "Running", *, itype: str = "ecs.gn6i-c8g1.2xlarge",
             start: float | None = None, tags: dict | None = None, gpus: int = 1) -> dict:
    out = {"InstanceId": instance_id(node_name), "Status": status, "InstanceType": itype, "ZoneId": f"{REGION}-h",
           "Cpu": 8, "Memory": 32768, "GPUAmount": gpus, "GPUSpec": "NVIDIA T4", "StoppedMode": "StopCharging",
           "Tags": {"Tag": [{"TagKey": k, "TagValue": v} for k, v in (tags or {}).items()]}}
    if start is not None:
        out["StartTime"] = datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%dT%H:%MZ")
    return out


TYPES = {
    "ecs.gn6i-c8g1.2xlarge": {"InstanceTypeId": "ecs.gn6i-c8g1.2xlarge", "CpuCoreCount": 8, "MemorySize": 31.0,
                              "GPUAmount": 1, "GPUSpec": "NVIDIA T4"},
    "ecs.gn6i-c24g1.12xlarge": {"InstanceTypeId": "ecs.gn6i-c24g1.12xlarge", "CpuCoreCount": 48, "MemorySize": 186.0,
                                "GPUAmount": 2, "GPUSpec": "NVIDIA T4"},
}


def pod(name: str, node_name: str | None, *, requests: dict | None = None, phase: str = "Running",
        labels: dict | None = None, init=(), overhead: dict | None = None, namespace: str = "default") -> dict:
    spec = {"containers": [{"name": "main", "resources": {"requests": dict(requests or {})}}],
            "initContainers": list(init)}
    if node_name:
        spec["nodeName"] = node_name
    if overhead:
        spec["overhead"] = overhead
    return {"metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
            "spec": spec, "status": {"phase": phase}}


class TaskInstance:
    """A step's task instance as far as the step uses it: what it pushes to XCom, recorded."""

    try_number = 1          # the first try (launch names its pods after it)

    def __init__(self):
        self.pushed = {}

    def xcom_push(self, key, value):
        self.pushed[key] = value


def step_context() -> dict:
    """The Airflow context a step reads: its task instance, the run id, no params."""
    return {"ti": TaskInstance(), "run_id": "manual__1", "params": {}}

"""The local kube-scheduler, seen through the kubernetes client: what binds where, and what stays Pending."""
from __future__ import annotations

from tests.conformance.k8s_harness import K8sServer, k8s, pod_body, wait_until  # noqa: F401

NS = "default"
UNREACHABLE = [{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
               {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]


def _bound_node(k8s: K8sServer, name: str) -> str:
    v1 = k8s.core_v1()
    return wait_until(lambda: v1.read_namespaced_pod(name, NS).spec.node_name, timeout=5)


def _scheduled_event(k8s: K8sServer, name: str):
    events = k8s.core_v1().list_namespaced_event(NS, field_selector=f"involvedObject.name={name},reason=Scheduled")
    return events.items


def test_binds_by_node_selector_affinity_toleration_and_gpu(k8s: K8sServer):
    k8s.add_node("cpu-a", labels={"pool": "cpu"})
    k8s.add_node("gpu-t4", gpu=1, labels={"pool": "gpu", "aliyun.accelerator/nvidia_name": "Tesla-T4"})
    k8s.add_node("gpu-a10", gpu=4, labels={"pool": "gpu", "aliyun.accelerator/nvidia_name": "NVIDIA-A10"},
                 taints=[{"key": "dedicated", "value": "training", "effect": "NoSchedule"}])
    v1 = k8s.core_v1()
    v1.create_namespaced_pod(NS, pod_body("by-selector", node_selector={"pool": "cpu"}))
    v1.create_namespaced_pod(NS, pod_body("by-affinity", affinity={"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "aliyun.accelerator/nvidia_name", "operator": "In", "values": ["Tesla-T4"]}]}]}}}))
    v1.create_namespaced_pod(NS, pod_body("by-field", affinity={"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["cpu-a"]}]}]}}}))
    v1.create_namespaced_pod(NS, pod_body("two-gpus", gpu=2, tolerations=[
        {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}]))
    assert _bound_node(k8s, "by-selector") == "cpu-a"
    assert _bound_node(k8s, "by-affinity") == "gpu-t4"
    assert _bound_node(k8s, "by-field") == "cpu-a"
    assert _bound_node(k8s, "two-gpus") == "gpu-a10"        # only node with 2 GPUs, taint tolerated
    pod = v1.read_namespaced_pod("two-gpus", NS)
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "True")]
    assert _scheduled_event(k8s, "two-gpus")[0].message == "Successfully assigned default/two-gpus to gpu-a10"
    assert _scheduled_event(k8s, "two-gpus")[0].source.component == "default-scheduler"


def test_gpu_capacity_counts_bound_pods_and_frees_on_completion(k8s: K8sServer):
    k8s.add_node("gpu-1", gpu=1)
    v1 = k8s.core_v1()
    v1.create_namespaced_pod(NS, pod_body("first", gpu=1))
    assert _bound_node(k8s, "first") == "gpu-1"
    v1.create_namespaced_pod(NS, pod_body("second", gpu=1))
    reason = wait_until(lambda: next((c for c in v1.read_namespaced_pod("second", NS).status.conditions or []
                                      if c.type == "PodScheduled" and c.status == "False"), None), timeout=5)
    assert reason.reason == "Unschedulable"
    assert reason.message.startswith("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    # the first pod finishes: its GPU is free again and the waiting pod binds
    k8s.on_loop(lambda: k8s.store.mutate("pods", NS, "first", lambda p: p["status"].update(phase="Succeeded")))
    assert _bound_node(k8s, "second") == "gpu-1"


def test_nothing_fits_leaves_pod_pending_with_failed_scheduling_then_retries(k8s: K8sServer):
    k8s.add_node("stopped-gpu", gpu=8, ready=False, taints=UNREACHABLE)
    k8s.add_node("cordoned", gpu=8, unschedulable=True)
    k8s.add_node("small", gpu=1, cpu="4")
    k8s.add_node("cpu-only", labels={"pool": "cpu"})
    v1 = k8s.core_v1()
    v1.create_namespaced_pod(NS, pod_body("big", gpu=4))
    events = wait_until(lambda: v1.list_namespaced_event(
        NS, field_selector="involvedObject.name=big,reason=FailedScheduling").items, timeout=5)
    assert events[0].type == "Warning"
    assert events[0].message == (
        "0/4 nodes are available: 1 node(s) had untolerated taint {node.kubernetes.io/unreachable: }, "
        "1 node(s) were unschedulable, 2 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available: "
        "4 Preemption is not helpful for scheduling.")
    pod = v1.read_namespaced_pod("big", NS)
    assert pod.status.phase == "Pending" and pod.spec.node_name is None
    # the stopped node boots: taints go, the scheduler retries on the node change and binds
    k8s.on_loop(lambda: k8s.store.mutate("nodes", None, "stopped-gpu", lambda n: n["spec"].update(taints=[])))
    assert _bound_node(k8s, "big") == "stopped-gpu"


def test_pods_with_another_scheduler_or_a_node_name_are_left_alone(k8s: K8sServer):
    k8s.add_node("n1")
    v1 = k8s.core_v1()
    body = pod_body("custom")
    body["spec"]["schedulerName"] = "volcano"
    v1.create_namespaced_pod(NS, body)
    pinned = pod_body("pinned")
    pinned["spec"]["nodeName"] = "n1"
    v1.create_namespaced_pod(NS, pinned)
    v1.create_namespaced_pod(NS, pod_body("normal"))
    assert _bound_node(k8s, "normal") == "n1"
    assert v1.read_namespaced_pod("custom", NS).spec.node_name is None
    assert not _scheduled_event(k8s, "pinned")

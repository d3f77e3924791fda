"""The scheduler's pure rules: pod requests, tolerations, node affinity, per-node fit."""
from decimal import Decimal

from simcloud.kube.scheduler import filter_node, node_affinity_matches, pod_requests, tolerates, unschedulable_message

NODE = {"metadata": {"name": "n1", "labels": {"gpu": "a10", "zone": "k", "cores": "32"}},
        "spec": {}, "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1", "pods": "110"}}}


def _pod(**spec):
    return {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}], **spec}}


def test_requests_take_max_of_init_containers_and_add_overhead():
    pod = _pod(containers=[{"name": "a", "resources": {"requests": {"cpu": "500m", "nvidia.com/gpu": "1"}}},
                           {"name": "b", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
               initContainers=[{"name": "i", "resources": {"requests": {"cpu": "2", "memory": "512Mi"}}}],
               overhead={"cpu": "100m"})
    assert pod_requests(pod) == {"cpu": Decimal("2.1"), "memory": Decimal(2**30), "nvidia.com/gpu": Decimal(1),
                                 "pods": Decimal(1)}


def test_tolerations():
    taint = {"key": "k", "value": "v", "effect": "NoSchedule"}
    assert tolerates({"key": "k", "operator": "Equal", "value": "v"}, taint)
    assert tolerates({"key": "k", "value": "v", "effect": "NoSchedule"}, taint)
    assert not tolerates({"key": "k", "value": "x"}, taint)
    assert not tolerates({"key": "k", "operator": "Exists", "effect": "NoExecute"}, taint)
    assert tolerates({"operator": "Exists"}, taint)                       # tolerate everything


def test_node_affinity_terms_are_ored_and_expressions_anded():
    def affinity(*terms):
        return _pod(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": list(terms)}}})
    assert node_affinity_matches(affinity({"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a10"]},
                                                                {"key": "cores", "operator": "Gt", "values": ["16"]}]}),
                                 NODE)
    assert not node_affinity_matches(affinity({"matchExpressions": [{"key": "gpu", "operator": "NotIn",
                                                                     "values": ["a10"]}]}), NODE)
    assert node_affinity_matches(affinity({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]},
                                          {"matchFields": [{"key": "metadata.name", "operator": "In",
                                                            "values": ["n1"]}]}), NODE)
    assert not node_affinity_matches(affinity({}), NODE)                  # an empty term matches nothing
    assert not node_affinity_matches(_pod(nodeSelector={"gpu": "t4"}), NODE)


def test_filter_node_is_per_node_fit():
    gpu2 = _pod(containers=[{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "2", "cpu": "9"}}}])
    assert filter_node(gpu2, pod_requests(gpu2), NODE, {}) == ["Insufficient cpu", "Insufficient nvidia.com/gpu"]
    one = _pod(containers=[{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "1"}}}])
    assert filter_node(one, pod_requests(one), NODE, {}) == []
    assert filter_node(one, pod_requests(one), NODE, {"nvidia.com/gpu": Decimal(1)}) == ["Insufficient nvidia.com/gpu"]
    cpu_node = {**NODE, "status": {"allocatable": {"cpu": "8", "memory": "8Gi"}}}
    assert filter_node(one, pod_requests(one), cpu_node, {}) == ["Insufficient nvidia.com/gpu"]


def test_unschedulable_message_format():
    from collections import Counter
    assert unschedulable_message(0, Counter()) == "no nodes available to schedule pods"
    assert unschedulable_message(3, Counter({"Insufficient nvidia.com/gpu": 2, "node(s) were unschedulable": 1})) == (
        "0/3 nodes are available: 1 node(s) were unschedulable, 2 Insufficient nvidia.com/gpu. preemption: "
        "0/3 nodes are available: 3 Preemption is not helpful for scheduling.")


def test_the_scheduler_binds_pods_pending_before_it_started_and_after_and_forgets_deleted_ones():
    """The scheduler's queue of pending pods (it no longer scans every pod): a pod pending before it started
    and one created later are bound once a Node with room comes; a pending pod deleted leaves the queue; a pod
    created bound is never queued."""
    import asyncio
    import time

    from simcloud.kube.scheduler import Scheduler
    from simcloud.kube.store import Store

    def pod(name: str, **spec) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
                "spec": {"containers": [{"name": "c", "image": "i", "resources": {"requests": {"cpu": "1"}}}],
                         **spec}}

    def node(name: str) -> dict:
        return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {},
                "status": {"allocatable": {"cpu": "8", "memory": "8Gi", "pods": "110"},
                           "conditions": [{"type": "Ready", "status": "True"}]}}

    async def until(done, what: str) -> None:
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        store = Store()
        store.create("pods", pod("early"))
        scheduler = Scheduler(store)
        scheduler.start()
        try:
            store.create("pods", pod("late"))
            store.create("pods", pod("gone"))
            store.create("pods", pod("pinned", nodeName="elsewhere"))
            await until(lambda: scheduler._pending == {("default", "early"), ("default", "late"),
                                                       ("default", "gone")}, "the queue holds the pending pods")
            store.delete("pods", "default", "gone", grace_period_seconds=0)
            store.create("nodes", node("n1"))
            await until(lambda: all(store.read("pods", "default", n)["spec"].get("nodeName") == "n1"
                                    for n in ("early", "late")), "both pending pods bound to the new node")
            await until(lambda: not scheduler._pending, "the queue empty")
            assert store.read("pods", "default", "pinned")["spec"]["nodeName"] == "elsewhere"
        finally:
            await scheduler.stop()

    asyncio.run(scenario())

"""The node-lifecycle controller on a fake clock: grace period, taints, removal after Ready, eviction."""
from simcloud.config import Timings
from simcloud.kube.node_lifecycle import (
    NOT_READY,
    UNREACHABLE,
    UNSCHEDULABLE,
    NodeLifecycleController,
    toleration_seconds,
)
from simcloud.kube.store import Store

TIMINGS = Timings(node_monitor_period_seconds=5, node_monitor_grace_seconds=50)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ready_node(store: Store, name: str = "n1") -> None:
    store.create("nodes", {"metadata": {"name": name}, "spec": {}, "status": {"conditions": [
        {"type": "Ready", "status": "True", "lastHeartbeatTime": "t0", "reason": "KubeletReady"}]}})
    store.create("leases", {"metadata": {"name": name, "namespace": "kube-node-lease"},
                            "spec": {"renewTime": "r0"}})


def renew(store: Store, when: str, name: str = "n1") -> None:
    store.mutate("leases", "kube-node-lease", name, lambda lease: lease["spec"].update(renewTime=when))


def set_ready(store: Store, status: str, name: str = "n1") -> None:
    store.mutate("nodes", None, name, lambda n: n["status"].update(conditions=[
        {"type": "Ready", "status": status, "lastHeartbeatTime": f"beat-{status}"}]))


def state(store: Store, name: str = "n1") -> tuple[str, list[str]]:
    node = store.read("nodes", None, name)
    ready = next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready")
    return ready, sorted(f"{t['key']}:{t['effect']}" for t in node["spec"].get("taints") or [])


def controller() -> tuple[Store, Clock, NodeLifecycleController]:
    store, clock = Store(), Clock()
    ready_node(store)
    ctl = NodeLifecycleController(store, TIMINGS, clock)
    ctl.monitor()
    return store, clock, ctl


def test_lease_renewals_keep_a_node_ready_past_the_grace_period():
    store, clock, ctl = controller()
    for step in range(1, 20):
        clock.now = step * 10
        renew(store, f"r{step}")
        ctl.monitor()
    assert state(store) == ("True", [])


def test_silence_longer_than_the_grace_period_is_unknown_and_unreachable_taints():
    store, clock, ctl = controller()
    clock.now = 50
    ctl.monitor()
    assert state(store) == ("True", [])            # not longer than the grace period yet
    clock.now = 50.5
    ctl.monitor()
    assert state(store) == ("Unknown", [f"{UNREACHABLE}:NoExecute", f"{UNREACHABLE}:NoSchedule"])
    node = store.read("nodes", None, "n1")
    assert node["status"]["conditions"][-1]["lastHeartbeatTime"] == "t0"


def test_ready_false_is_not_ready_and_taints_go_a_period_after_ready_true():
    store, clock, ctl = controller()
    set_ready(store, "False")
    clock.now = 61
    ctl.monitor()
    assert state(store) == ("False", [f"{NOT_READY}:NoExecute", f"{NOT_READY}:NoSchedule"])
    set_ready(store, "True")
    clock.now = 62
    ctl.monitor()
    assert state(store)[1], "taints outlive Ready=True by a period"
    clock.now = 67
    ctl.monitor()
    assert state(store) == ("True", [])


def test_pods_are_evicted_after_their_toleration_counted_from_when_first_seen_tainted():
    store, clock, ctl = controller()
    store.create("pods", {"metadata": {"name": "default-300", "namespace": "default"},
                          "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i:1"}]}})
    store.create("pods", {"metadata": {"name": "forever", "namespace": "default"},
                          "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i:1"}],
                                   "tolerations": [{"key": UNREACHABLE, "operator": "Exists",
                                                    "effect": "NoExecute"}]}})
    for pod in store.list("pods")[0]:
        store.mutate("pods", "default", pod["metadata"]["name"], lambda p: p["status"].update(phase="Running"))
    clock.now = 51
    ctl.monitor()                                    # tainted now; the pods' clocks start
    clock.now = 350
    ctl.monitor()
    assert not store.read("pods", "default", "default-300")["metadata"].get("deletionTimestamp")
    clock.now = 351
    ctl.monitor()
    evicted = store.read("pods", "default", "default-300")
    assert evicted["metadata"].get("deletionTimestamp") and evicted["status"]["phase"] == "Running"
    assert any(c["type"] == "DisruptionTarget" and c["reason"] == "DeletionByTaintManager"
               for c in evicted["status"]["conditions"])
    clock.now = 10_000
    ctl.monitor()
    assert not store.read("pods", "default", "forever")["metadata"].get("deletionTimestamp")


def test_toleration_seconds_is_the_least_used_and_zero_when_a_taint_is_not_tolerated():
    taints = [{"key": UNREACHABLE, "effect": "NoExecute"}, {"key": "x", "effect": "NoExecute"}]

    def pod(*tolerations):
        return {"spec": {"tolerations": list(tolerations)}}
    assert toleration_seconds(pod({"key": UNREACHABLE, "operator": "Exists", "tolerationSeconds": 30}), taints) == 0
    assert toleration_seconds(pod({"operator": "Exists", "tolerationSeconds": 30},
                                  {"key": "x", "operator": "Exists", "tolerationSeconds": 10}), taints) == 10
    assert toleration_seconds(pod({"operator": "Exists"}), taints) is None


def test_a_cordoned_node_carries_the_unschedulable_taint_until_uncordoned():
    """doNoScheduleTaintingPass: node.kubernetes.io/unschedulable follows spec.unschedulable, one pass late."""
    store, _clock, ctl = controller()
    store.mutate("nodes", None, "n1", lambda n: n["spec"].update(unschedulable=True))
    assert state(store) == ("True", [])
    ctl.monitor()
    assert state(store) == ("True", [f"{UNSCHEDULABLE}:NoSchedule"])
    store.mutate("nodes", None, "n1", lambda n: n["spec"].pop("unschedulable"))
    assert state(store)[1] == [f"{UNSCHEDULABLE}:NoSchedule"]       # outlives the uncordon until the pass
    ctl.monitor()
    assert state(store) == ("True", [])

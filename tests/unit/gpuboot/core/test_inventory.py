"""Inventory: every node state with its reason, capacities, pod requests and reservations."""
from dataclasses import replace

import pytest

from gpuboot.core.inventory import (
    build_inventory,
    gpu_model_alternatives,
    gpu_model_matches,
    normalize_gpu_model,
    parse_provider_id,
    pod_requests,
    with_reservations,
)
from gpuboot.core.model import NodeState, Reservation
from gpuboot.core.resources import GPU, QuantityError, Resources
from tests.builders import TYPES, instance, iso, node, pod

NOW = 1_700_000_400.0          # on a minute boundary: ECS StartTime has minute resolution
STARTED = NOW - 120


def one(n, inst=None, pods=(), reservations=(), types=TYPES, grace=900):
    views = build_inventory([n], list(pods), [inst] if inst else [], types, list(reservations), NOW, grace)
    assert len(views) == 1
    return views[0]


def test_running_ready_registered_node_is_ready():
    v = one(node("a", heartbeat=NOW - 5, labels={"gpuboot.io/managed": "true"}), instance("a", start=STARTED))
    assert v.state is NodeState.READY, v.reason
    assert v.instance_id == "i-a" and v.instance_type == "ecs.gn6i-c8g1.2xlarge" and v.zone == "cn-hangzhou-h"
    assert v.hostname == "host-a" and v.gpu_model == "Tesla-T4" and v.managed
    assert v.allocatable == Resources.parse({"cpu": "8", "memory": "32Gi", "pods": "110", GPU: 1})
    assert v.free == v.allocatable


def test_alicloud_provider_id_form_is_accepted():
    assert parse_provider_id("alicloud://cn-hangzhou.i-abc") == ("cn-hangzhou", "i-abc")
    assert parse_provider_id("cn-hangzhou.i-abc") == ("cn-hangzhou", "i-abc")
    assert parse_provider_id("aws:///us-east-1a/i-abc") is None
    v = one(node("a", heartbeat=NOW, provider_prefix="alicloud://"), instance("a", start=STARTED))
    assert v.state is NodeState.READY and v.instance_id == "i-a"


@pytest.mark.parametrize("status", ["Pending", "Starting"])
def test_starting_instance_is_booting_with_its_gpus_counted(status):
    n = node("a", ready="Unknown", allocatable={"cpu": "8", "memory": "32Gi", GPU: "0"})
    v = one(n, instance("a", status))
    assert v.state is NodeState.BOOTING and status in v.reason
    assert v.allocatable.gpus == 1  # zeroed by the kubelet, but the machine has one


def test_running_not_ready_is_booting_within_grace_then_unavailable():
    n = node("a", ready="False", heartbeat=NOW - 30)
    v = one(n, instance("a", start=NOW - 60))
    assert v.state is NodeState.BOOTING and "NodeReady False" in v.reason
    v = one(n, instance("a", start=NOW - 1200))
    assert v.state is NodeState.UNAVAILABLE and "boot grace" in v.reason and "NodeReady False" in v.reason


def test_running_ready_without_gpus_registered_is_booting_then_unavailable():
    n = node("a", gpus=0, gpu_model=None, heartbeat=NOW)
    v = one(n, instance("a", start=NOW - 60))
    assert v.state is NodeState.BOOTING and "GPUs not registered (0/1" in v.reason
    assert v.allocatable.gpus == 1
    v = one(n, instance("a", start=NOW - 1200), grace=900)
    assert v.state is NodeState.UNAVAILABLE and "GPUs not registered" in v.reason


def test_ready_status_written_before_the_start_is_not_trusted():
    # Ready=True with a heartbeat from before the stop: the kubelet has not reported since the start
    v = one(node("a", heartbeat=NOW - 3600), instance("a", start=NOW - 60))
    assert v.state is NodeState.BOOTING and "predates" in v.reason


def test_running_not_ready_without_start_time_is_unavailable():
    v = one(node("a", ready="False"), instance("a"))
    assert v.state is NodeState.UNAVAILABLE and "start time unknown" in v.reason


def test_stopped_node_keeps_its_last_allocatable():
    v = one(node("a", ready="Unknown", cpu="7800m", memory="30Gi"), instance("a", "Stopped"))
    assert v.state is NodeState.STOPPED and "StopCharging" in v.reason
    assert v.allocatable == Resources.parse({"cpu": "7800m", "memory": "30Gi", "pods": "110", GPU: 1})


def test_stopped_node_without_allocatable_falls_back_to_instance_type():
    v = one(node("a", allocatable={}), instance("a", "Stopped", itype="ecs.gn6i-c24g1.12xlarge", gpus=2))
    assert v.allocatable == Resources.parse({"cpu": "48", "memory": "186Gi", GPU: 2})
    # unknown type: the instance's own Cpu / Memory (MiB) / GPUAmount
    v = one(node("a", allocatable={}), instance("a", "Stopped", itype="ecs.unknown"), types={})
    assert v.allocatable == Resources.parse({"cpu": "8", "memory": "32Gi", GPU: 1})


def test_stopping_instance():
    assert one(node("a", ready="Unknown"), instance("a", "Stopping")).state is NodeState.STOPPING


def test_cordoned_node_is_unavailable_whatever_its_instance():
    for status in ("Running", "Stopped"):
        v = one(node("a", heartbeat=NOW, unschedulable=True), instance("a", status, start=STARTED))
        assert v.state is NodeState.UNAVAILABLE and "cordoned" in v.reason


def test_provider_id_without_instance_is_unavailable():
    v = one(node("a"), None)
    assert v.state is NodeState.UNAVAILABLE and "has no ECS instance" in v.reason


def test_node_without_ecs_provider_id_goes_by_its_ready_condition():
    v = one(node("cpu-1", gpus=0, instance=None, labels={"gpuboot.io/managed": "true"}))
    assert v.state is NodeState.READY and not v.managed and v.instance_id is None
    v = one(node("cpu-1", gpus=0, instance=None, ready="False"))
    assert v.state is NodeState.UNAVAILABLE and "NodeReady False" in v.reason


def test_managed_by_ecs_tag_and_price_from_annotation_or_type():
    n = node("a", heartbeat=NOW)
    n["metadata"]["annotations"]["gpuboot.io/price-per-hour"] = "2.5"
    v = one(n, instance("a", start=STARTED, tags={"gpuboot:managed": "true"}))
    assert v.managed and v.price_per_hour == 2.5
    types = {k: {**t, "PricePerHour": 1.25} for k, t in TYPES.items()}
    v = one(node("a", heartbeat=NOW), instance("a", start=STARTED), types=types)
    assert not v.managed and v.price_per_hour == 1.25


def test_gpu_model_falls_back_to_instance_type_spec():
    v = one(node("a", heartbeat=NOW, gpu_model=None), instance("a", start=STARTED))
    assert v.gpu_model == "NVIDIA T4"


def test_allocated_counts_active_pods_only():
    pods = [pod("p1", "a", requests={"cpu": "1", GPU: 1}),
            pod("p2", "a", requests={"cpu": "500m"}, phase="Pending"),
            pod("done", "a", requests={"cpu": "4"}, phase="Succeeded"),
            pod("failed", "a", requests={"cpu": "4"}, phase="Failed"),
            pod("unbound", None, requests={"cpu": "4"}, phase="Pending"),
            pod("elsewhere", "b", requests={"cpu": "4"})]
    v = one(node("a", heartbeat=NOW), instance("a", start=STARTED), pods=pods)
    assert v.allocated == Resources.parse({"cpu": "1500m", GPU: 1})
    assert v.free.gpus == 0


def reservation(task="t0", node_name="a", gpus=1, expires=NOW + 60, job="job-1"):
    return Reservation(job_id=job, task=task, node=node_name, resources=Resources({GPU: gpus}), expires_at=expires)


def test_live_reservations_count_expired_ones_do_not():
    n, i = node("a", gpus=2, heartbeat=NOW), instance("a", start=STARTED, gpus=2)
    assert one(n, i, reservations=[reservation()]).allocated.gpus == 1
    assert one(n, i, reservations=[reservation(), reservation("t1")]).free.gpus == 0
    assert one(n, i, reservations=[reservation(expires=NOW)]).allocated.gpus == 0
    assert one(n, i, reservations=[reservation(node_name="b")]).allocated.gpus == 0


def test_reservation_backed_by_its_bound_pod_is_not_double_counted():
    n, i = node("a", gpus=2, heartbeat=NOW), instance("a", start=STARTED, gpus=2)
    labels = {"gpuboot.io/job": "job-1", "gpuboot.io/task": "t0"}
    bound = pod("p", "a", requests={GPU: 1}, labels=labels)
    assert one(n, i, pods=[bound], reservations=[reservation()]).allocated.gpus == 1
    # not yet bound, bound elsewhere, or another task's pod: the reservation still counts
    assert one(n, i, pods=[pod("p", None, requests={GPU: 1}, labels=labels, phase="Pending")],
               reservations=[reservation()]).allocated.gpus == 1
    other = pod("p", "a", requests={GPU: 1}, labels={**labels, "gpuboot.io/task": "t9"})
    assert one(n, i, pods=[other], reservations=[reservation()]).allocated.gpus == 2
    finished = pod("p", "a", requests={GPU: 1}, labels=labels, phase="Succeeded")
    assert one(n, i, pods=[finished], reservations=[reservation()]).allocated.gpus == 1


def test_pod_requests_sum_containers_and_overhead():
    p = pod("p", "a", requests={"cpu": "1", "memory": "1Gi"}, overhead={"cpu": "250m"})
    p["spec"]["containers"].append({"name": "side", "resources": {"requests": {"cpu": "500m", GPU: "1"}}})
    assert pod_requests(p) == Resources.parse({"cpu": "1750m", "memory": "1Gi", GPU: 1})


def test_pod_requests_init_containers_take_the_max():
    init = [{"name": "fetch", "resources": {"requests": {"cpu": "4", "memory": "512Mi"}}},
            {"name": "warm", "resources": {"requests": {"memory": "8Gi"}}}]
    p = pod("p", "a", requests={"cpu": "1", "memory": "1Gi"}, init=init)
    assert pod_requests(p) == Resources.parse({"cpu": "4", "memory": "8Gi"})


def test_pod_requests_sidecars_add_to_everything_after_them():
    init = [{"name": "early", "resources": {"requests": {"cpu": "2"}}},
            {"name": "proxy", "restartPolicy": "Always", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
            {"name": "late", "resources": {"requests": {"cpu": "3"}}}]
    p = pod("p", "a", requests={"cpu": "1"}, init=init)
    # app phase: 1 + 0.5 sidecar = 1.5; "late" runs beside the sidecar: 3 + 0.5 = 3.5; "early" alone: 2
    assert pod_requests(p) == Resources.parse({"cpu": "3500m", "memory": "1Gi"})


def test_pod_requests_init_peak_does_not_stack_with_later_sidecars():
    init = [{"name": "migrate", "resources": {"requests": {"cpu": "3"}}},
            {"name": "proxy", "restartPolicy": "Always", "resources": {"requests": {"cpu": "500m"}}}]
    p = pod("p", "a", requests={"cpu": "1"}, init=init)
    assert pod_requests(p) == Resources.parse({"cpu": "3"})   # max(3, 1 + 0.5)


def test_bad_pod_quantity_names_the_pod_and_container():
    p = pod("bad", "a", requests={"cpu": "lots"}, namespace="ml")
    with pytest.raises(QuantityError, match=r"pod ml/bad container main resources\.requests\.cpu"):
        pod_requests(p)


def test_pod_requests_default_to_limits_and_pod_level_requests_win():
    p = pod("p", "a")
    p["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "2", GPU: "1"}}
    assert pod_requests(p) == Resources.parse({"cpu": "2", GPU: 1})
    p["spec"]["resources"] = {"requests": {"cpu": "3"}}
    assert pod_requests(p) == Resources.parse({"cpu": "3", GPU: 1})


def test_gpu_model_normalization():
    assert normalize_gpu_model("Tesla-T4") == normalize_gpu_model("NVIDIA T4") == normalize_gpu_model("t4") == "T4"
    assert gpu_model_matches("A100", "NVIDIA-A100-SXM4-80GB")
    assert not gpu_model_matches("A10", "NVIDIA-A100-SXM4-80GB")
    assert not gpu_model_matches("A100", "NVIDIA-A10")
    assert gpu_model_matches(None, "anything") and not gpu_model_matches("T4", None)


def test_gpu_models_any_of_and_with_memory():
    """The trace's V100M16 is a V100 with 16 GB (ACK labels the memory: Tesla-V100-SXM2-16GB); a
    job may list several models, any one will do."""
    assert normalize_gpu_model("V100M16") == normalize_gpu_model("V100-16GB") == "V100-16GB"
    assert normalize_gpu_model("M40") == "M40" and normalize_gpu_model("L40S") == "L40S"
    assert gpu_model_matches("V100M16", "Tesla-V100-SXM2-16GB") and gpu_model_matches("V100-16GB", "V100M16")
    assert not gpu_model_matches("V100M16", "Tesla-V100-SXM2-32GB")
    assert not gpu_model_matches("V100M16", "NVIDIA V100")          # memory unknown: not promised
    assert gpu_model_matches("V100", "Tesla-V100-SXM2-32GB") and gpu_model_matches("A100M80", "NVIDIA-A100-SXM4-80GB")
    assert gpu_model_matches(["V100M16", "V100M32"], "Tesla-V100-SXM2-32GB")
    assert gpu_model_matches("T4|A10", "NVIDIA-A10") and not gpu_model_matches("T4|A10", "NVIDIA-A100-SXM4-80GB")
    assert gpu_model_matches([], "NVIDIA-A10") and gpu_model_matches("", None)
    assert gpu_model_alternatives(" V100M16 |V100M32| V100M16") == ("V100M16", "V100M32")
    assert gpu_model_alternatives(["T4", "A10|T4"]) == ("T4", "A10") and gpu_model_alternatives(None) == ()


def test_twin_nodes_share_their_vectors():
    """Placement judges nodes with equal inputs once and compares them fastest when they share the
    same objects: build_inventory (and re-counting reservations) gives equal vectors one object."""
    nodes = [node(n, heartbeat=NOW) for n in ("a", "b", "c")]
    instances = [instance(n, start=STARTED) for n in ("a", "b", "c")]
    pods = [pod(f"p-{n}", n, requests={"cpu": "1"}) for n in ("a", "b")]
    a, b, c = build_inventory(nodes, pods, instances, TYPES, [], NOW)
    assert a.allocatable is b.allocatable is c.allocatable and a.allocated is b.allocated
    assert c.allocated == Resources() and c.allocated is not a.allocated
    held = [Reservation("j", "t", n, Resources({GPU: 1}), NOW + 60) for n in ("a", "b")]
    a2, b2, c2 = with_reservations([a, b, c], set(), held, NOW)
    assert a2.allocated is b2.allocated and a2.allocated == Resources.parse({"cpu": "1", GPU: 1}) and c2 is c
    assert a2.twin is b2.twin and a2.twin is not a.twin and c2.twin is c.twin


def test_twins_share_one_twin_token_and_nothing_else_does():
    """Placement judges the nodes of one twin token once (NodeView.twin): build_inventory must give a
    token to exactly the nodes alike in state, capacity, usage, price, GPU model and taints, whatever
    their names, labels or taints' timeAdded."""
    down = [{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule", "timeAdded": iso(NOW - k)}
            for k in range(6)]
    nodes = [node("a", heartbeat=NOW, labels={"pool": "x"}), node("b", heartbeat=NOW, labels={"pool": "y"}),
             node("c", heartbeat=NOW), node("d", heartbeat=NOW, gpu_model="NVIDIA-A10"),
             node("e", heartbeat=NOW, taints=[{"key": "gpu", "value": "only", "effect": "NoSchedule"}]),
             node("f", heartbeat=NOW, labels={"gpuboot.io/price-per-hour": "9.5"}),
             node("s1", ready="Unknown", taints=[down[0]]), node("s2", ready="Unknown", taints=[down[1]]),
             node("s3", ready="Unknown", taints=[down[2]], cpu="16")]
    instances = [instance(n["metadata"]["name"], "Stopped" if n["metadata"]["name"].startswith("s") else "Running",
                          start=STARTED) for n in nodes]
    pods = [pod("p-c", "c", requests={"cpu": "1"})]
    views = {v.name: v for v in build_inventory(nodes, pods, instances, TYPES, [], NOW)}
    groups = {}
    for v in views.values():
        groups.setdefault(id(v.twin), []).append(v.name)
    assert sorted(groups.values()) == [["a", "b"], ["c"], ["d"], ["e"], ["f"], ["s1", "s2"], ["s3"]]
    assert views["s1"].taints == ({"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},)
    # a view changed afterwards is nobody's twin any more, not even of the view it came from
    changed = replace(views["a"], allocated=views["c"].allocated)
    assert changed.twin is not views["a"].twin and changed.twin is not views["c"].twin


def test_busy_since_is_when_the_oldest_workload_pod_started():
    """Placement's oldest-work order: DaemonSet and static pods run on every node from its boot and
    do not count; a pod not started yet counts from its creation, a terminated one not at all."""
    n = node("a", heartbeat=NOW - 5)

    def started(p, at, key="startTime"):
        (p["status"] if key == "startTime" else p["metadata"])[key] = iso(at)
        return p
    daemon = started(pod("dp", "a"), NOW - 9000)
    daemon["metadata"]["ownerReferences"] = [{"kind": "DaemonSet", "name": "nvidia-device-plugin"}]
    mirror = started(pod("static", "a"), NOW - 9000)
    mirror["metadata"]["annotations"] = {"kubernetes.io/config.mirror": "x"}
    done = started(pod("done", "a", phase="Succeeded"), NOW - 8000)
    work = [started(pod("w1", "a"), NOW - 600), started(pod("w2", "a", phase="Pending"), NOW - 3000,
                                                        "creationTimestamp")]
    assert one(n, instance("a", start=STARTED), pods=[daemon, mirror, done, *work]).busy_since == NOW - 3000
    assert one(n, instance("a", start=STARTED), pods=[daemon, mirror, done]).busy_since is None
    assert one(n, instance("a", start=STARTED), pods=[pod("no-times", "a")]).busy_since == NOW
    # nothing runs on a node that is not running, whatever pods are still bound to it
    stopped = one(n, instance("a", "Stopped"), pods=work)
    assert stopped.state is NodeState.STOPPED and stopped.busy_since is None

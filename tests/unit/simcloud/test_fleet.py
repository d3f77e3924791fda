"""Fleet files: parsing, validation messages, and the Node objects they become."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from simcloud.fleet import FleetError, instance_id_for, load_fleet, node_object
from simcloud.harness import small_fleet

DEMO = Path(__file__).resolve().parents[3] / "simcloud" / "fleets" / "demo.yaml"


def test_demo_fleet_has_running_and_stopped_gpu_nodes_and_a_stopped_multi_gpu_node():
    fleet = load_fleet(DEMO)
    running_gpu = [n for n in fleet.nodes if n.status == "Running" and n.instance_type.gpu]
    stopped = [n for n in fleet.nodes if n.status == "Stopped"]
    assert running_gpu and all(n.instance_type.gpu < 2 for n in running_gpu)
    assert any(n.instance_type.gpu >= 2 for n in stopped)
    assert all(n.stopped_mode == "StopCharging" and n.labels.get("gpuboot.io/managed") == "true"
               and n.tags.get("gpuboot:managed") == "true" for n in stopped)
    assert fleet.access_key_secret and fleet.access_key_secret not in repr(fleet)


def test_node_object_carries_ack_labels_provider_id_and_resources():
    fleet = load_fleet(DEMO)
    spec = next(n for n in fleet.nodes if n.name == "gpu-v100x4-1")
    node = node_object(spec, fleet.region, "boot-1")
    labels = node["metadata"]["labels"]
    assert labels["kubernetes.io/hostname"] == "gpu-v100x4-1"
    assert labels["node.kubernetes.io/instance-type"] == "ecs.gn6v-c8g1.8xlarge"
    assert labels["topology.kubernetes.io/zone"] == "cn-hangzhou-h"
    assert labels["topology.kubernetes.io/region"] == "cn-hangzhou"
    assert labels["aliyun.accelerator/nvidia_name"] == "Tesla-V100-SXM2-16GB"
    assert labels["aliyun.accelerator/nvidia_count"] == "4"
    assert labels["gpuboot.io/managed"] == "true"
    assert node["spec"]["providerID"] == f"cn-hangzhou.{spec.instance_id}"
    status = node["status"]
    assert status["capacity"]["nvidia.com/gpu"] == status["allocatable"]["nvidia.com/gpu"] == "4"
    assert status["capacity"]["cpu"] == "32" and status["allocatable"]["cpu"] == "31260m"
    assert status["nodeInfo"]["bootID"] == "boot-1"
    assert status["nodeInfo"]["kubeletVersion"].startswith("v1.30.")
    assert {"type": "InternalIP", "address": spec.private_ip} in status["addresses"]
    cpu = node_object(fleet.nodes[0], fleet.region, "b")
    assert "nvidia.com/gpu" not in cpu["status"]["allocatable"]
    assert not any(k.startswith("aliyun.accelerator/") for k in cpu["metadata"]["labels"])


def test_count_expands_names_with_stable_distinct_ids():
    fleet = load_fleet(small_fleet([{"name": "g", "instance_type": "ecs.gn6i-c4g1.xlarge", "count": 3}]))
    assert [n.name for n in fleet.nodes] == ["g-0", "g-1", "g-2"]
    assert len({n.instance_id for n in fleet.nodes}) == 3
    assert fleet.nodes[1].instance_id == instance_id_for("cn-hangzhou", "g-1")
    assert len({n.private_ip for n in fleet.nodes}) == 3


def test_yaml_text_and_timings():
    fleet = load_fleet("region: cn-beijing\ntimings: {boot_seconds: 0.5}\ninstance_types:\n"
                       "  ecs.g7.xlarge: {cpu: 4, memory_gib: 16}\nnodes:\n"
                       "  - {name: a, instance_type: ecs.g7.xlarge}\n")
    assert fleet.region == "cn-beijing" and fleet.timings.boot_seconds == 0.5
    assert fleet.nodes[0].zone == "cn-beijing-h" and fleet.nodes[0].status == "Running"
    # the cluster's clocks a fleet does not set are Kubernetes 1.32's
    t = fleet.timings
    assert (t.node_monitor_grace_seconds, t.node_monitor_period_seconds, t.default_toleration_seconds,
            t.heartbeat_seconds, t.lease_renew_seconds, t.watch_history_seconds, t.watch_bookmark_seconds,
            t.shutdown_grace_seconds) == (50, 5, 300, 300, 10, 300, 60, 0)


def test_small_fleet_and_the_demo_shorten_the_cluster_clocks():
    for fleet in (load_fleet(small_fleet()), load_fleet(Path(__file__).parents[3] / "simcloud/fleets/demo.yaml")):
        t = fleet.timings
        assert t.node_monitor_grace_seconds <= 10 and t.default_toleration_seconds <= 30
        assert t.heartbeat_seconds <= 5 and t.lease_renew_seconds * 4 <= t.node_monitor_grace_seconds


@pytest.mark.parametrize("change, words", [
    (lambda f: f["nodes"][0].update(instance_type="ecs.nope"), ["nodes[0].instance_type", "instance_types"]),
    (lambda f: f["nodes"][0].update(status="Sleeping"), ["nodes[0].status", "Running or Stopped"]),
    (lambda f: f["nodes"][0].update(colour="red"), ["nodes[0]", "colour"]),
    (lambda f: f["timings"].update(boot_secs=1), ["timings", "boot_secs"]),
    (lambda f: f["timings"].update(boot_seconds=-1), ["timings.boot_seconds", ">= 0"]),
    (lambda f: f["faults"].update(ecs_throttle_rate=3), ["faults", "ecs_throttle_rate"]),
    (lambda f: f["instance_types"]["ecs.gn6i-c4g1.xlarge"].pop("gpu_spec"), ["gpu_spec", "NVIDIA T4"]),
    (lambda f: f["nodes"].append(dict(f["nodes"][0])), ["duplicate", "cpu-1"]),
    (lambda f: f.update(nodes=[]), ["nodes", "non-empty"]),
    (lambda f: f["timings"].update(node_monitor_grace_seconds=0.2), ["node_monitor_grace_seconds", "exceed"]),
])
def test_bad_fleets_name_the_field(change, words):
    fleet = small_fleet()
    fleet["instance_types"] = {k: dict(v) for k, v in fleet["instance_types"].items()}
    change(fleet)
    with pytest.raises(FleetError) as caught:
        load_fleet(fleet)
    assert all(w in str(caught.value) for w in words), str(caught.value)


def test_boot_ids_follow_the_seed():
    from simcloud.fleet import new_boot_id
    assert new_boot_id(random.Random(7)) == new_boot_id(random.Random(7)) != new_boot_id(random.Random(8))

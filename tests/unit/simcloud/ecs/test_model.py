"""The ECS instance state machine of simcloud, without any server."""
from __future__ import annotations

import asyncio

import pytest

from simcloud.config import Faults, Timings
from simcloud.ecs.model import EcsCloud, EcsError, Instance, InstanceType

T4 = InstanceType("ecs.gn6i-c4g1.xlarge", cpu=4, memory_gib=15.0, gpu=1, gpu_spec="NVIDIA T4")


def cloud_with(*statuses: str, faults: Faults | None = None) -> EcsCloud:
    cloud = EcsCloud("cn-hangzhou", Timings(start_seconds=0.05, stop_seconds=0.05), faults or Faults())
    for n, status in enumerate(statuses):
        cloud.add_instance(Instance(f"i-{n}", f"node-{n}", f"node-{n}", T4, "cn-hangzhou-h", "cn-hangzhou", status))
    return cloud


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_instance_type_family_and_provider_id():
    assert T4.family == "ecs.gn6i"
    assert InstanceType("ecs.g7.xlarge", 4, 16).family == "ecs.g7"
    instance = Instance("i-1", "n", "n", T4, "cn-hangzhou-h", "cn-hangzhou", "Running")
    assert instance.provider_id == "cn-hangzhou.i-1"
    assert instance.start_time == instance.creation_time   # a running instance has been started
    with pytest.raises(ValueError, match="status 'On'"):
        Instance("i-2", "n", "n", T4, "z", "cn-hangzhou", "On")


def test_start_stop_cycle_notifies_listeners_in_order():
    async def scenario():
        cloud = cloud_with("Stopped")
        seen = []
        cloud.add_listener(lambda i, old, new: seen.append((i.instance_id, old, new)))
        cloud.add_listener(lambda *_: 1 / 0)      # a broken listener does not stop the others or the cloud
        (outcome,) = cloud.start_instances(["i-0"])
        assert (outcome.previous_status, outcome.current_status, outcome.ok) == ("Stopped", "Starting", True)
        await until(lambda: cloud.instances["i-0"].status == "Running")
        assert cloud.instances["i-0"].start_time
        cloud.stop_instances(["i-0"], stopped_mode="StopCharging", force=True)
        await until(lambda: cloud.instances["i-0"].status == "Stopped")
        assert cloud.instances["i-0"].stopped_mode == "StopCharging"
        return seen

    assert asyncio.run(scenario()) == [("i-0", "Stopped", "Starting"), ("i-0", "Starting", "Running"),
                                       ("i-0", "Running", "Stopping"), ("i-0", "Stopping", "Stopped")]


def test_pending_instance_becomes_stopped():
    async def scenario():
        cloud = cloud_with("Pending")
        with pytest.raises(EcsError) as e:
            cloud.start_instances(["i-0"])
        assert e.value.code == "IncorrectInstanceStatus"
        await until(lambda: cloud.instances["i-0"].status == "Stopped")

    asyncio.run(scenario())


def test_errors_and_batch_modes():
    async def scenario():
        cloud = cloud_with("Stopped", "Running", faults=Faults(no_stock=["ecs.gn6i-c4g1.xlarge@cn-hangzhou-h"]))
        with pytest.raises(EcsError) as e:
            cloud.start_instances(["i-0", "i-9"])
        assert (e.value.code, e.value.status) == ("InvalidInstanceId.NotFound", 404)
        with pytest.raises(EcsError) as e:
            cloud.start_instances(["i-0"])
        assert (e.value.code, e.value.status) == ("OperationDenied.NoStock", 403)
        with pytest.raises(EcsError) as e:
            cloud.stop_instances(["i-1"], stopped_mode="Sleep")
        assert e.value.code == "InvalidParameter" and "StoppedMode" in e.value.message
        outcomes = cloud.stop_instances(["i-0", "i-1"], all_together=False)
        assert [(o.instance_id, o.ok, o.current_status) for o in outcomes] == \
            [("i-0", False, "Stopped"), ("i-1", True, "Stopping")]
        assert outcomes[0].error.code == "IncorrectInstanceStatus"
        assert cloud.stop_instances(["i-1"], all_together=False, dry_run=True)[0].error.code == "IncorrectInstanceStatus"
        cloud.close()

    asyncio.run(scenario())


def test_dry_run_changes_nothing_and_close_cancels_transitions():
    async def scenario():
        cloud = cloud_with("Stopped", "Stopped")
        assert cloud.start_instances(["i-0"], dry_run=True) == []
        assert cloud.instances["i-0"].status == "Stopped"
        cloud.start_instances(["i-1"])
        cloud.close()
        await asyncio.sleep(2 * cloud.timings.start_seconds)   # absence can only be checked after its due time
        assert cloud.instances["i-1"].status == "Starting"

    asyncio.run(scenario())


def test_find_filters():
    cloud = cloud_with("Stopped", "Running")
    cloud.instances["i-1"].tags["pool"] = "gpu"
    assert [i.instance_id for i in cloud.find(status="Running")] == ["i-1"]
    assert [i.instance_id for i in cloud.find(tags={"pool": None})] == ["i-1"]
    assert [i.instance_id for i in cloud.find(name="node-*", instance_ids=["i-0"])] == ["i-0"]
    with pytest.raises(ValueError, match="duplicate"):
        cloud.add_instance(Instance("i-0", "x", "x", T4, "z", "cn-hangzhou", "Stopped"))

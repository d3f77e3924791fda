"""An instance stopped outside gpuboot while wait_gpu_ready waits for it (a person, ECS, a spot reclaim):
the wait follows the instance's power state, ends within seconds of the Node going unreachable with
that cause, and places the job again at once, without marking the node unavailable for others or
failed for this job (it is not the node's fault). Before, it waited the whole boot timeout and then
blamed the kubelet."""
from __future__ import annotations

import time

import pytest
from airflow.sdk.exceptions import TaskDeferred

from gpuboot.hooks.ecs import EcsHook
from gpuboot.sensors.gpu_ready import GpuReadySensor
from simcloud.harness import small_fleet, wait_until
from tests.integration.conftest import running_cloud
from tests.integration.test_operators import JOB, context, place, run_deferred
from tests.integration.test_resilience import FAST_BOOT, T4, T4X2, ledger, start, status

GRACE = 4.0        # the node-lifecycle controller's grace period in this fleet (real default: 50 s)
FLEET = small_fleet([
    {"name": "gpu-run", "instance_type": T4, "status": "Running"},
    {"name": "gpu-stop", "instance_type": T4X2, "status": "Stopped"},
], timings={"stale_seconds": 1.0, "device_plugin_seconds": 0.5, "node_monitor_grace_seconds": GRACE})


# a second node that fits the job: the one the job moves to (the stopped one is started again only
# when nothing else fits, as in FLEET)
FLEET_TWO = small_fleet([
    {"name": "gpu-stop", "instance_type": T4X2, "status": "Stopped"},
    {"name": "gpu-stop-2", "instance_type": T4X2, "status": "Stopped"},
], timings=FLEET["timings"])
JOB_2GPU = {**JOB, **FAST_BOOT, "gpus": 2, "boot_timeout_seconds": 300}


@pytest.fixture
def cloud(tmp_path, monkeypatch):
    with running_cloud(FLEET, tmp_path, monkeypatch) as sim:
        yield sim


@pytest.fixture
def cloud_two(tmp_path, monkeypatch):
    with running_cloud(FLEET_TWO, tmp_path, monkeypatch) as sim:
        yield sim


def stopped_while_waited(cloud, nodes: list[str]):
    """Place and start the job, defer its wait on the chosen node (GPUs held back by a fault on `nodes`),
    stop that instance through ECS as someone else would, run the trigger to its event; returns the
    sensor, its context, the event, the node and its instance id."""
    cloud.set_faults(device_plugin_never=nodes)                           # the wait would last the boot timeout
    plan, pushed = place(JOB_2GPU, job_id="job")
    (first,) = [a["node"] for a in plan["assignments"]]
    out, _ = start(plan, pushed["job"])
    sensor = GpuReadySensor(task_id="wait", baselines=out["baselines"], job=pushed["job"], plan=out["plan"])
    ctx = context("wait")
    with pytest.raises(TaskDeferred) as first_wait:
        sensor.execute(ctx)
    wait_until(lambda: status(cloud, first) == "Running", timeout=60, message=f"{first} did not start")
    stopped_at = time.monotonic()
    iid = cloud.instance_id(first)
    EcsHook().stop_instances([iid])                       # someone else stops it
    event = run_deferred(first_wait.value)
    seconds = time.monotonic() - stopped_at
    assert event["status"] == "stopped", event
    assert f"its instance {iid} is Stop" in event["message"] and "stopped outside gpuboot" in event["message"]
    assert seconds < GRACE + 15, seconds                  # the Node's grace, then one ECS check: not 300 s
    print(f"external stop -> wait ended in {seconds:.1f} s (grace {GRACE:g} s)")
    cloud.set_faults(device_plugin_never=[])
    wait_until(lambda: status(cloud, first) == "Stopped", timeout=60, message=f"{first} did not stop")
    return sensor, ctx, event, first


def assert_not_blamed(node: str) -> None:
    state = ledger().snapshot()
    assert [m for m in state.live_unavailable(time.time()) if m.node == node] == []   # not its fault
    record = state.record("job", time.time())
    assert record is not None and dict(record.failed) == {}                          # nor this job's


def test_an_instance_stopped_outside_gpuboot_ends_the_wait_at_once_and_the_job_is_placed_again(cloud, capfd):
    sensor, ctx, event, first = stopped_while_waited(cloud, ["gpu-stop"])   # only gpu-stop holds 2 GPUs
    assert first == "gpu-stop"
    with pytest.raises(TaskDeferred):                     # placed again at once: it waits for the new boot
        sensor.execute_complete(ctx, event)
    assert_not_blamed("gpu-stop")
    assert [r.node for r in ledger().live() if r.job_id == "job"] == ["gpu-stop"]          # the only fit, again
    assert "stopped outside gpuboot" in capfd.readouterr().out


def test_the_job_moves_to_another_node_rather_than_starting_the_stopped_one_again(cloud_two):
    """Whoever stopped the instance meant it (a person, a spot reclaim): another node that fits is
    chosen, even a dearer one (before, placement chose the same, cheapest node and started it again;
    seen in the demo's stack)."""
    sensor, ctx, event, first = stopped_while_waited(cloud_two, ["gpu-stop", "gpu-stop-2"])
    other = ({"gpu-stop", "gpu-stop-2"} - {first}).pop()
    with pytest.raises(TaskDeferred):
        sensor.execute_complete(ctx, event)
    assert [r.node for r in ledger().live() if r.job_id == "job"] == [other]
    assert status(cloud_two, first) == "Stopped" and status(cloud_two, other) in ("Starting", "Running")
    assert_not_blamed(first)

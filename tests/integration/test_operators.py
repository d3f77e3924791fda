"""Each gpuboot operator's execute against the local cloud, with a minimal Airflow context
(a stand-in task instance that only records XCom pushes; Kubernetes and ECS are real)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import threading

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred
from airflow.sdk.execution_time.task_runner import _serialize_rendered_fields

from gpuboot.core.gang import LABEL_RANK, gang_pods
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.placement import Plan
from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import AsyncKubeClient, KubeClient
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.operators.launch import GpuPodOperator
from gpuboot.operators.place import PlaceGpuJobOperator
from gpuboot.operators.release import ReleaseReservationOperator
from gpuboot.operators.start import StartGpuNodesOperator
from gpuboot.sensors.gpu_ready import GpuReadySensor
from gpuboot.triggers.gpu_ready import NodeGpuReadyTrigger
from simcloud.harness import wait_until
from tests.integration.conftest import SETTLE_SECONDS

JOB = {"name": "train", "image": "python:3.11", "command": ["python", "-c", "print('epoch 1/1 done')"],
       "gpus": 1, "cpu": "1", "memory": "1Gi", "settle_seconds": int(SETTLE_SECONDS), "boot_timeout_seconds": 30}


class TaskInstanceStandIn:
    """Just enough of a task instance: identity, XCom pushes, and pulls of what a test put in `pulls`."""

    def __init__(self, task_id: str):
        self.dag_id, self.task_id, self.run_id, self.map_index, self.try_number = "d", task_id, "r1", -1, 1
        self.pushed: dict[str, object] = {}
        self.pulls: dict[tuple[str, str], object] = {}     # (task id, key) -> value

    def xcom_push(self, key, value):
        self.pushed[key] = value

    def xcom_pull(self, task_ids=None, key="return_value", **_):
        return self.pulls.get((task_ids, key))


def context(task_id: str, params: dict | None = None) -> dict:
    return {"ti": TaskInstanceStandIn(task_id), "run_id": "r1", "dag": None, "params": params or {}}


def place(job: dict, job_id: str = "job-1", **kwargs):
    ctx = context("place")
    plan = PlaceGpuJobOperator(task_id="place", job=job, job_id=job_id, **kwargs).execute(ctx)
    return plan, ctx["ti"].pushed


def release(job_id: str) -> list[str] | None:
    """The release step, as the teardown runs it: the tasks released, or None when the job did not run
    to completion (the step then fails the run, after releasing, with that cause)."""
    try:
        return ReleaseReservationOperator(task_id="release", job_id=job_id).execute(context("release"))
    except AirflowFailException as exc:
        assert f"job {job_id} did not run to completion" in str(exc) and "reservations are released" in str(exc)
        return None


def run_deferred(deferred: TaskDeferred):
    """What the triggerer does: run the trigger until its first event."""
    return asyncio.run(deferred.trigger.run().__anext__()).payload


def test_place_prefers_the_running_node_and_reserves_it(cloud):
    plan, pushed = place(JOB)
    assert plan["outcome"] == "fits"
    assert [a["node"] for a in plan["assignments"]] == ["gpu-run"] and plan["nodes_to_start"] == []
    assert pushed["job"]["image"] == "python:3.11" and pushed["job_id"] == "job-1"
    assert [(r.job_id, r.node) for r in ReservationLedger(KubeClient()).live()] == [("job-1", "gpu-run")]


def test_place_never_boots_a_node_too_small_for_the_task_alone(cloud):
    """The seed's regression: 1 GPU free on a running node + a stopped 1-GPU node do not make 2."""
    plan, _ = place({**JOB, "gpus": 2})
    assert [a["node"] for a in plan["assignments"]] == ["gpu2-stop"]
    assert plan["nodes_to_start"] == ["gpu2-stop"]


def test_place_retry_keeps_one_reservation_per_task(cloud):
    place(JOB)
    place(JOB)                                       # a retry of the same job id re-places, not adds
    assert len(ReservationLedger(KubeClient()).live()) == 1


def test_never_fits_fails_at_once_with_the_reason(cloud):
    with pytest.raises(AirflowFailException, match="can never run") as err:
        place({**JOB, "gpus": 8})
    assert "nvidia.com/gpu" in str(err.value)


def test_busy_defers_on_a_timer_then_gives_up_at_the_queue_timeout(cloud):
    for n in range(3):                               # take all 4 GPUs (1 + 1 + 2)
        place({**JOB, "gpus": 2 if n == 2 else 1}, job_id=f"hog-{n}")
    op = PlaceGpuJobOperator(task_id="place", job=JOB, job_id="late", busy_poll_seconds=1)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context("place"))
    assert deferred.value.method_name == "resume"
    woke = run_deferred(deferred.value)              # the timer fires and carries the queue deadline back
    assert woke["echo"]["deadline"] > 0
    with pytest.raises(TaskDeferred):                # still busy, deadline not reached: wait again
        op.resume(context("place"), woke)
    with pytest.raises(AirflowFailException, match="still waiting for capacity"):
        op.resume(context("place"), {"status": "wake", "echo": {"deadline": 1.0}})


def test_invalid_job_fails_without_retry_naming_the_field(cloud):
    with pytest.raises(AirflowFailException, match="gpus"):
        place({**JOB, "gpus": -1})


def test_job_from_dag_run_params(cloud):
    """A param the DAG declares for its own use is not part of the job (an undeclared key is a
    typo and fails: tests/e2e/test_trigger_input.py)."""
    ctx = context("place", params={**JOB, "unrelated_param": 1})
    plan = PlaceGpuJobOperator(task_id="place", job_id="from-params", params={"unrelated_param": 1}).execute(ctx)
    assert plan["outcome"] == "fits"


def test_start_wait_launch_release_on_a_stopped_node(cloud):
    """The whole chain by hand: the 2-GPU job boots gpu2-stop, the sensor (deferred) waits for
    its GPUs, the pod runs pinned there and its log reaches the task log, release cleans up."""
    job = {**JOB, "gpus": 2, "env": {"EPOCHS": "3", "WANDB_API_KEY": "a-secret-value-123"}}
    plan, pushed = place(job, job_id="chain")
    iid = plan["assignments"][0]["instance_id"]
    boot_before = KubeClient().get_node("gpu2-stop")["status"]["nodeInfo"]["bootID"]

    ctx = context("start")
    started = StartGpuNodesOperator(task_id="start", plan=plan).execute(ctx)
    assert started["started"] == [iid]
    assert ctx["ti"].pushed["summary"].startswith("start requested for gpu2-stop at 20")   # a UTC time, not epoch
    (boot,) = started["baselines"]
    assert boot["node"] == "gpu2-stop" and boot["boot_id_before"] == boot_before and boot["gpus_needed"] == 2
    assert EcsHook().statuses([iid])[iid] in ("Starting", "Running")
    again = StartGpuNodesOperator(task_id="start", plan=plan).execute(context("start"))
    assert again["started"] == []                    # a retry does not start it twice

    sensor = GpuReadySensor(task_id="wait", baselines=started["baselines"], job=pushed["job"], plan=plan)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context("wait"))
    assert isinstance(deferred.value.trigger, NodeGpuReadyTrigger)
    event = run_deferred(deferred.value)
    ctx = context("wait")
    assert sensor.execute_complete(ctx, event) == ["train"]
    assert int(ctx["ti"].pushed["evidence"]["gpu2-stop"]["gpus_allocatable"]) == 2
    assert re.fullmatch(r"booted gpu2-stop in [\d.]+ s \(instance up [\d.]+ s, kubelet Ready [\d.]+ s, "
                        r"GPUs registered [\d.]+ s(, settled [\d.]+ s)?\)", ctx["ti"].pushed["summary"])

    launch = GpuPodOperator(task_id="launch", job=pushed["job"], plan=plan, startup_timeout_seconds=30)
    launch.render_template_fields(context("launch"))      # as the task runner does, before storing them
    rendered = _serialize_rendered_fields(launch)          # what "Rendered Templates" shows
    assert rendered["launched"]["image"] == JOB["image"] and rendered["launched"]["command"] == JOB["command"]
    assert rendered["launched"]["nodes"] == ["gpu2-stop"]
    assert {"EPOCHS", "WANDB_API_KEY", "RANK", "MASTER_ADDR"} <= set(rendered["launched"]["env"])
    assert rendered["launched"]["resources"]["nvidia.com/gpu"] == "2"
    assert "a-secret-value-123" not in json.dumps(rendered)
    (pod,) = gang_pods(JobSpec.from_dict(pushed["job"]), Plan.from_json(plan), attempt=1, master_addr=None)
    assert pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "gpu2-stop"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["metadata"]["labels"]["gpuboot.io/job"] == "chain" and pod["metadata"]["labels"]["gpuboot.io/task"] == "train"

    ctx = context("release")
    with pytest.raises(AirflowFailException, match=r"job chain did not run to completion \(no pod of it ran\)"):
        ReleaseReservationOperator(task_id="release", job_id="chain").execute(ctx)   # launch never ran its pod
    assert ctx["ti"].pushed["summary"].startswith("released 1 reservation(s) of job chain: train on gpu2-stop")
    assert ReservationLedger(KubeClient()).live() == []
    assert release("chain") is None                       # idempotent: nothing left, the same verdict


def test_poke_mode_applies_the_same_rule_and_times_out_with_evidence(cloud):
    cloud.set_faults(device_plugin_never=["gpu-stop"])
    job = {**JOB, "boot_timeout_seconds": 3}
    # occupy gpu-run so the job goes to the stopped 1-GPU node
    place(JOB, job_id="hog")
    plan, pushed = place(job, job_id="stuck")
    assert plan["nodes_to_start"] == ["gpu-stop"]
    started = StartGpuNodesOperator(task_id="start", plan=plan).execute(context("start"))
    sensor = GpuReadySensor(task_id="wait", baselines=started["baselines"], job=pushed["job"], deferrable=False,
                            poke_interval=0.2)
    with pytest.raises(AirflowFailException, match="not GPU-ready") as err:
        sensor.execute(context("wait"))
    assert "gpus_allocatable" in str(err.value)


def test_a_deferred_wait_that_times_out_fails_with_what_it_saw(cloud):
    cloud.set_faults(never_ready=["gpu-stop"])
    place(JOB, job_id="hog")
    plan, pushed = place({**JOB, "boot_timeout_seconds": 3}, job_id="never")   # >= 1s boot + 2s settle
    started = StartGpuNodesOperator(task_id="start", plan=plan).execute(context("start"))
    sensor = GpuReadySensor(task_id="wait", baselines=started["baselines"], job=pushed["job"])
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context("wait"))
    event = run_deferred(deferred.value)
    with pytest.raises(AirflowFailException, match="gpu-stop not GPU-ready") as err:
        sensor.execute_complete(context("wait"), event)
    assert "ready=" in str(err.value)


def test_pod_states_gives_the_pod_as_it_is_then_each_change_and_none_once_deleted(cloud):
    """What launch waits on for rank 0's IP (KubeClient.pod_states): the pod as it is now (a pod
    that already has its IP is seen at once), then its changes; None for a pod deleted while
    watched or already gone; a quiet stream ends at the deadline."""
    kube = KubeClient()
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "watched", "namespace": "gpu-jobs"},
           "spec": {"nodeSelector": {"kubernetes.io/hostname": "cpu-1"}, "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "python:3.11",
                                    "command": ["python", "-c", "import signal; signal.pause()"]}]}}
    kube.create_pod("gpu-jobs", pod)
    phases = []
    for state in kube.pod_states("gpu-jobs", "watched", 60):
        phases.append(state["status"].get("phase"))
        if state["status"].get("podIP"):
            break
    assert phases[0] in ("Pending", "Running") and (state["status"].get("podIP"))
    first = next(iter(kube.pod_states("gpu-jobs", "watched", 60)))      # already has it: the first state
    assert first["status"]["podIP"] == state["status"]["podIP"]
    states = kube.pod_states("gpu-jobs", "watched", 60)
    assert next(states)["metadata"]["name"] == "watched"
    kube.delete_pod("gpu-jobs", "watched", grace_seconds=0)
    assert None in states                                                # the deletion, seen by the watch
    assert list(kube.pod_states("gpu-jobs", "watched", 1.5)) == [None]   # already gone, then quiet until the deadline


def test_a_gang_whose_rank_0_gets_no_pod_ip_fails_at_the_startup_timeout_and_deletes_it(cloud):
    """Rank 0 pinned to a host no kubelet serves stays Pending without an IP: launch waits for the
    IP only until startup_timeout_seconds, deletes rank 0 and never creates the others."""
    job = {**JOB, "name": "pair", "cpu": "100m", "memory": "64Mi", "gpus": 0, "allow_gpu_nodes": True, "replicas": 2}
    plan, pushed = place(job, job_id="no-ip")
    assert plan["outcome"] == "fits", plan["message"]
    plan["assignments"][0] = {**plan["assignments"][0], "hostname": "no-such-host"}
    launch = GpuPodOperator(task_id="launch", job=pushed["job"], plan=plan, startup_timeout_seconds=2)
    with pytest.raises(AirflowException, match=r"rank 0 \(pod .*\) got no pod IP .* within 2.0 s .*deleted it"):
        launch.execute(context("launch"))
    assert KubeClient().list_pods("gpuboot.io/job=no-ip") == []


@pytest.mark.parametrize("exit_code, status", [(0, "succeeded"), (3, "failed")])
def test_the_gang_trigger_is_woken_by_its_pods_changing_not_by_its_poll(cloud, capfd, monkeypatch, tmp_path,
                                                                         exit_code, status):
    """GangTrigger reads the gang's pods again at each change a watch reports: with a poll of an
    hour it still gives its verdict as soon as the ranks end (rank 1 exits with `exit_code`), with
    the last line each rank wrote in its log. The ranks' Nodes are read per poll, not per change:
    here once each, when its rank is first seen running."""
    fifo = tmp_path / "release-rank-0"             # rank 0 runs on until the test has seen rank 1 end
    os.mkfifo(fifo)
    command = ["python", "-c", ("import os, sys; rank = os.environ['RANK']; "
               "rank == '0' and open(os.environ['RELEASE']).read(); print('rank', rank, 'ends', flush=True); "
               f"sys.exit({exit_code} if rank == '1' else 0)")]
    job = {**JOB, "name": "pair", "cpu": "100m", "memory": "64Mi", "gpus": 0, "allow_gpu_nodes": True,
           "replicas": 2, "command": command, "env": {"RELEASE": str(fifo)}}
    plan, pushed = place(job, job_id=f"woken-{exit_code}")
    assert plan["outcome"] == "fits", plan["message"]
    launch = GpuPodOperator(task_id="launch", job=pushed["job"], plan=plan, env_source=job, startup_timeout_seconds=30)
    with pytest.raises(TaskDeferred) as deferred:
        launch.execute(context("launch"))
    _path, kwargs = deferred.value.trigger.serialize()
    trigger = type(deferred.value.trigger)(**{**kwargs, "poll_seconds": 3600.0})
    read_nodes = []
    get_node = AsyncKubeClient.get_node

    async def counted(self, name):
        read_nodes.append(name)
        return await get_node(self, name)

    monkeypatch.setattr(AsyncKubeClient, "get_node", counted)

    def release_rank_0_once_rank_1_ended():
        wait_until(lambda: any(p["metadata"]["labels"][LABEL_RANK] == "1" and p["status"].get("phase") in
                               ("Succeeded", "Failed") for p in KubeClient().list_pods(f"gpuboot.io/job=woken-{exit_code}")),
                   timeout=60, interval=0.1, message="rank 1 did not end")
        with open(fifo, "w"):                     # rank 0's read returns when this closes
            pass

    releaser = threading.Thread(target=release_rank_0_once_rank_1_ended, daemon=True)
    releaser.start()

    async def verdict():
        async for event in trigger.run():
            return event.payload

    payload = asyncio.run(asyncio.wait_for(verdict(), timeout=90))
    releaser.join(timeout=60)
    logged = capfd.readouterr().out                   # the trigger's log (the triggerer files it with the task's)
    assert payload["status"] == status
    assert sorted(read_nodes) == sorted(set(read_nodes)) and read_nodes, read_nodes
    assert "[rank 1] rank 1 ends" in logged
    if status == "succeeded":
        assert "[rank 0] rank 0 ends" in logged
    if status == "failed":
        assert payload["failure"]["rank"] == 1 and payload["failure"]["exit_code"] == exit_code
    release(f"woken-{exit_code}")


class LineRecorder:
    """The trigger's logger, recording each formatted line (read by the test while the trigger runs)."""

    def __init__(self):
        self.lines: list[str] = []

    def _record(self, msg, *args, **_):
        self.lines.append(msg % args if args else msg)

    info = warning = error = debug = exception = _record


@pytest.mark.simcloud_only(reason="cuts followed log streams with log_stream_cut_seconds, a fault of simcloud's own API server")
def test_a_log_stream_cut_while_the_rank_runs_is_opened_again_at_once(cloud, monkeypatch, tmp_path):
    """The API server ends a followed log stream mid-run (the local cloud's fault: every 0.5 s);
    GangTrigger opens it again while the rank runs on, so a line written after the cut reaches
    the task log before anything else about the pod changes (the poll here is an hour), and
    every line shows exactly once."""
    cloud.set_faults(log_stream_cut_seconds=0.5)
    gates = [tmp_path / "gate-1", tmp_path / "gate-2"]
    for gate in gates:
        os.mkfifo(gate)
    command = ["python", "-c", ("import os; print('one', flush=True); open(os.environ['GATE_1']).read(); "
               "print('two', flush=True); open(os.environ['GATE_2']).read(); print('three', flush=True)")]
    job = {**JOB, "name": "cut", "cpu": "100m", "memory": "64Mi", "gpus": 0, "allow_gpu_nodes": True,
           "command": command, "env": {"GATE_1": str(gates[0]), "GATE_2": str(gates[1])}}
    plan, pushed = place(job, job_id="cut-log")
    assert plan["outcome"] == "fits", plan["message"]
    launch = GpuPodOperator(task_id="launch", job=pushed["job"], plan=plan, env_source=job, startup_timeout_seconds=30)
    with pytest.raises(TaskDeferred) as deferred:
        launch.execute(context("launch"))
    _, kwargs = deferred.value.trigger.serialize()
    trigger = type(deferred.value.trigger)(**{**kwargs, "poll_seconds": 3600.0})
    trigger._log = recorder = LineRecorder()
    opens = []
    pod_log = AsyncKubeClient.pod_log

    def counted(self, *args, **kwargs):
        opens.append(args[1])
        return pod_log(self, *args, **kwargs)

    monkeypatch.setattr(AsyncKubeClient, "pod_log", counted)

    def open_gate(gate, once):
        wait_until(once, timeout=30, interval=0.05, message=f"before {gate.name}: {recorder.lines}, {len(opens)} opens")
        with open(gate, "w"):                      # the rank's read returns when this closes
            pass

    def gatekeeper():
        open_gate(gates[0], lambda: "[rank 0] one" in recorder.lines and len(opens) >= 3)   # cut twice meanwhile
        open_gate(gates[1], lambda: "[rank 0] two" in recorder.lines)   # came while the rank still runs

    keeper = threading.Thread(target=gatekeeper, daemon=True)
    keeper.start()

    async def verdict():
        async for event in trigger.run():
            return event.payload

    payload = asyncio.run(asyncio.wait_for(verdict(), timeout=90))
    keeper.join(timeout=60)
    assert not keeper.is_alive()
    assert payload["status"] == "succeeded", payload
    assert [line for line in recorder.lines if line.startswith("[rank 0]")] == \
        ["[rank 0] one", "[rank 0] two", "[rank 0] three"]
    release("cut-log")

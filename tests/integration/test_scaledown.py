"""Idle scale-down against the local cloud, through the real Kubernetes client and ECS SDK.

The operator's clock is a seam: the first run records idle-since (now), the second runs
"an hour later", so nothing waits for real idle time. The cordon window is another seam
(`on_cordoned`), which the race tests use to act exactly between cordon and stop."""
from __future__ import annotations

import os
import time

import pytest

from gpuboot.core.idle import ANNOTATION_CORDONED_BY, ANNOTATION_IDLE_SINCE, CORDONED_BY
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import Reservation
from gpuboot.core.placement import Outcome
from gpuboot.core.resources import Resources
from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.ledger import LedgerConflict, ReservationLedger
from gpuboot.operators.place import PlaceGpuJobOperator
from gpuboot.operators.scaledown import IdleScaleDownOperator
from simcloud.harness import small_fleet
from tests.integration.conftest import expose_connections, wait_until

T4 = "ecs.gn6i-c4g1.xlarge"
UNMANAGED = {"labels": {"gpuboot.io/managed": "false"}, "tags": {"gpuboot:managed": "false"}}
FLEET = small_fleet([
    {"name": "idle-1", "instance_type": T4, "status": "Running"},
    {"name": "busy-1", "instance_type": T4, "status": "Running"},
    {"name": "reserved-1", "instance_type": T4, "status": "Running"},
    {"name": "plain-1", "instance_type": T4, "status": "Running", **UNMANAGED},
    {"name": "stopped-1", "instance_type": T4, "status": "Stopped"},
    {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"},
])
IDLE_SECONDS = 600
LATER = IDLE_SECONDS + 60       # how far the second run's clock is ahead
ONE_GPU = Resources.parse({"nvidia.com/gpu": 1, "cpu": "1"})


class ScaleDown(IdleScaleDownOperator):
    """The operator with a settable clock offset and a callback inside the cordon window."""

    def __init__(self, *, offset: float = 0.0, in_window=None, **kwargs) -> None:
        kwargs.setdefault("task_id", "scale_down")
        kwargs.setdefault("spare_seconds", 0)      # no spare, but where a test asks for one
        super().__init__(idle_seconds=IDLE_SECONDS, stop_timeout_seconds=20, stop_poll_seconds=0.1, **kwargs)
        self.offset, self.in_window = offset, in_window

    def now(self) -> float:
        return time.time() + self.offset

    def on_cordoned(self, nodes: list[str]) -> None:
        if self.in_window:
            self.in_window(nodes)


@pytest.fixture
def cloud(simcloud_factory, monkeypatch):
    sim = simcloud_factory(FLEET)
    expose_connections(sim.connections_file, monkeypatch)
    wait_until(lambda: all(sim.node_ready(n) for n in ("idle-1", "busy-1", "reserved-1", "plain-1")),
               timeout=20, message="fleet nodes never became Ready")
    kube = KubeClient()
    create_pod(kube, "train", "busy-1")
    create_pod(kube, "nvidia-device-plugin-idle", "idle-1", namespace="kube-system", daemonset=True)
    ReservationLedger(kube).commit("job-r", [reservation("job-r", "reserved-1")], None)
    return sim


def reservation(job: str, node: str) -> Reservation:
    return Reservation(job_id=job, task=f"{job}-0", node=node, resources=ONE_GPU,
                       expires_at=time.time() + 4 * 3600)


DEVICE_PLUGIN_LABELS = {"app": "nvidia-device-plugin"}


def daemonset_uid(kube: KubeClient, namespace: str, node: str) -> str:
    """The uid of the DaemonSet that owns the device plugin's pod. On the real control plane it must
    exist: the garbage collector deletes a pod whose owner does not (the local cloud runs no
    DaemonSet controller there: its kubelets are the device plugins). simcloud's own server has no
    apps/v1 and no garbage collector."""
    if os.environ.get("GPUBOOT_KUBE") != "real":
        return "00000000-0000-0000-0000-000000000001"
    from kubernetes import client
    labels = DEVICE_PLUGIN_LABELS
    created = client.AppsV1Api(kube.core.api_client).create_namespaced_daemon_set(namespace, {
        "metadata": {"name": "nvidia-device-plugin"},
        "spec": {"selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "containers": [{"name": "plugin", "image": "nvidia/k8s-device-plugin"}]}}}})
    return created.metadata.uid


def create_pod(kube: KubeClient, name: str, node: str, namespace: str = "default", daemonset: bool = False,
               gpus: int = 0) -> None:
    meta = {"name": name, "namespace": namespace, "annotations": {"simcloud.io/run-seconds": "3600"}}
    if daemonset:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "nvidia-device-plugin",
                                    "uid": daemonset_uid(kube, namespace, node), "controller": True}]
        meta["labels"] = dict(DEVICE_PLUGIN_LABELS)
    kube.core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"nodeName": node, "restartPolicy": "Never",
                 "containers": [{"name": "main", "image": "busybox", "resources": {
                     "requests": {"cpu": "100m", **({"nvidia.com/gpu": str(gpus)} if gpus else {})},
                     **({"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {})}}]}})
    wait_until(lambda: kube.core.read_namespaced_pod(name, namespace).status.phase == "Running", timeout=10)


def node(name: str) -> dict:
    return KubeClient().get_node(name)


def annotations(name: str) -> dict:
    return node(name)["metadata"].get("annotations") or {}


def status(cloud, name: str) -> dict:
    (instance,) = EcsHook().describe_instances([cloud.instance_id(name)])
    return instance


def cordoned(name: str) -> bool:
    return bool(node(name)["spec"].get("unschedulable"))


def ready(name: str) -> str:
    return next(c["status"] for c in node(name)["status"]["conditions"] if c["type"] == "Ready")


def snapshot(cloud) -> dict:
    """Everything scale-down could change: Node annotations and spec, instance states, the ledger."""
    kube = KubeClient()
    nodes = {n["metadata"]["name"]: (n["metadata"].get("annotations"), n["spec"]) for n in kube.list_nodes()}
    instances = {i["InstanceId"]: i["Status"] for i in EcsHook().describe_instances()}
    return {"nodes": nodes, "instances": instances, "ledger": ReservationLedger(kube).read()}


def test_the_fleets_last_spare_is_kept_until_its_spare_time(cloud):
    """With every other GPU taken, the idle node is the fleet's spare: past the idle time it stays up,
    schedulable, with its verdict in the summary, until idle + spare; then it is stopped."""
    kube = KubeClient()
    create_pod(kube, "train-gpu", "plain-1", gpus=1)          # the unmanaged node's GPU counts as capacity too
    create_pod(kube, "train-gpu-2", "busy-1", gpus=1)
    ScaleDown(spare_seconds=3600).execute({})                 # first seen idle: now
    kept = ScaleDown(spare_seconds=3600, offset=LATER).execute({})
    assert kept["stopped"] == [] and kept["spare_seconds"] == 3600
    assert kept["decisions"]["idle-1"]["verdict"] == "spare", kept["decisions"]["idle-1"]
    assert "the other running nodes have 0 free GPU(s), fewer than its 1" in kept["decisions"]["idle-1"]["reason"]
    assert status(cloud, "idle-1")["Status"] == "Running" and not cordoned("idle-1")
    last = ScaleDown(spare_seconds=3600, offset=LATER + 3600).execute({})
    assert last["stopped"] == ["idle-1"], last["decisions"]["idle-1"]
    assert status(cloud, "idle-1")["Status"] == "Stopped"


def test_idle_managed_node_is_stopped_the_others_are_kept(cloud, capfd):
    first = ScaleDown().execute({})
    assert first["stopped"] == []
    assert first["decisions"]["idle-1"] == {"verdict": "idle", "reason": "idle for 0.0 s < 10 min"}
    assert ANNOTATION_IDLE_SINCE in annotations("idle-1")

    if cloud.kube == "simcloud":
        cloud.set_faults(k8s_conflict_burst=2)      # the ledger fence retries through 409s
    second = ScaleDown(offset=LATER).execute({})

    assert second["stopped"] == ["idle-1"]
    assert status(cloud, "idle-1")["Status"] == "Stopped"
    assert status(cloud, "idle-1")["StoppedMode"] == "StopCharging"
    wait_until(lambda: ready("idle-1") != "True", timeout=10, message="stopped node still Ready")
    # Un-cordoned once Stopped (a later boot comes up schedulable), books cleared.
    assert not cordoned("idle-1")
    assert not {ANNOTATION_IDLE_SINCE, ANNOTATION_CORDONED_BY} & set(annotations("idle-1"))
    # Busy, reserved and unmanaged nodes are running and untouched.
    for name in ("busy-1", "reserved-1", "plain-1", "cpu-1"):
        assert status(cloud, name)["Status"] == "Running", name
        assert not cordoned(name), name
    assert second["decisions"]["busy-1"]["verdict"] == "busy"
    assert second["decisions"]["reserved-1"] == {
        "verdict": "reserved", "reason": second["decisions"]["reserved-1"]["reason"]}
    assert "job-r" in second["decisions"]["reserved-1"]["reason"]
    assert {"plain-1", "cpu-1"} <= set(second["unmanaged"]) and "plain-1" not in second["decisions"]
    assert ANNOTATION_IDLE_SINCE not in annotations("plain-1")
    # The fence entries are gone; the job's reservation is intact.
    assert [r.job_id for r in ReservationLedger(KubeClient()).live()] == ["job-r"]
    # Every decision is in the task log, one line per managed node.
    log = capfd.readouterr().out
    assert "busy: 1 pod (default/train)" in log
    assert "reserved by job job-r" in log
    assert "idle for 11 min >= 10 min" in log
    assert "unmanaged, never touched: cpu-1, plain-1" in log
    assert "test-secret-not-for-logs" not in log


def test_dry_run_logs_the_decision_and_changes_nothing(cloud, capfd):
    ScaleDown().execute({})                        # records idle-since, as a scheduled run would
    before = snapshot(cloud)
    capfd.readouterr()

    summary = ScaleDown(offset=LATER, dry_run="True").execute({})

    assert summary["dry_run"] is True and summary["stopped"] == []
    assert summary["decisions"]["idle-1"]["verdict"] == "stop"
    assert "would stop ['idle-1']" in capfd.readouterr().out
    assert snapshot(cloud) == before


def test_a_reservation_made_inside_the_cordon_window_backs_off_and_uncordons(cloud):
    """A placement that read the cluster before the cordon commits its reservation on the node
    after the decision: the re-check must see it, keep the instance running and un-cordon."""
    ScaleDown().execute({})
    seen = {}

    def placement_commits(nodes):
        seen["cordoned"] = {n: cordoned(n) for n in nodes}
        ledger = ReservationLedger(KubeClient())
        _, version = ledger.read()
        ledger.commit("job-late", [reservation("job-late", "idle-1")], version)

    summary = ScaleDown(offset=LATER, in_window=placement_commits).execute({})

    assert seen["cordoned"] == {"idle-1": True}
    assert summary["stopped"] == [] and "job-late" in summary["backed_off"]["idle-1"]
    assert status(cloud, "idle-1")["Status"] == "Running"
    assert not cordoned("idle-1") and ANNOTATION_CORDONED_BY not in annotations("idle-1")
    assert ANNOTATION_IDLE_SINCE not in annotations("idle-1")      # busy again: the idle clock restarts
    assert sorted(r.job_id for r in ReservationLedger(KubeClient()).live()) == ["job-late", "job-r"]


def test_a_placement_that_read_before_the_cordon_cannot_commit_after_the_stop(cloud):
    """The fence: a placement that read the ledger before scale-down acted gets a conflict,
    re-reads, and then sees the node cordoned (unavailable) or stopped."""
    ScaleDown().execute({})
    ledger = ReservationLedger(KubeClient())
    _, stale_version = ledger.read()

    assert ScaleDown(offset=LATER).execute({})["stopped"] == ["idle-1"]

    with pytest.raises(LedgerConflict):
        ledger.commit("job-stale", [reservation("job-stale", "idle-1")], stale_version)


def test_a_placement_inside_the_cordon_window_does_not_choose_the_cordoned_node(cloud):
    """A real placement run between the cordon and the stop treats the node as unavailable,
    so scale-down goes ahead and the job lands elsewhere."""
    ScaleDown().execute({})
    spec = JobSpec.from_dict({"name": "late", "image": "python:3.11", "command": ["true"], "gpus": 1,
                              "cpu": "1", "memory": "1Gi"})
    plans = []

    def placement_runs(nodes):
        plans.append(PlaceGpuJobOperator(task_id="place", job=spec.to_dict()).place_and_reserve(spec, "job-p"))

    summary = ScaleDown(offset=LATER, in_window=placement_runs).execute({})

    (plan,) = plans
    assert plan.outcome == Outcome.FITS
    assert [a.node for a in plan.assignments] != ["idle-1"]
    idle_candidates = [c for c in plan.candidates if c.node == "idle-1"]
    assert idle_candidates and all(c.verdict == "excluded" for c in idle_candidates)
    assert summary["stopped"] == ["idle-1"]
    assert "job-p" in {r.job_id for r in ReservationLedger(KubeClient()).live()}


def test_leftover_cordons_are_finished_and_foreign_cordons_respected(cloud):
    """A run that died after cordoning: the node is un-cordoned once Stopped. A node cordoned
    by an administrator is never stopped nor un-cordoned by scale-down."""
    kube = KubeClient()
    kube.core.patch_node("stopped-1", {"spec": {"unschedulable": True},
                                       "metadata": {"annotations": {ANNOTATION_CORDONED_BY: CORDONED_BY}}},
                         _content_type="application/merge-patch+json")
    kube.core.patch_node("idle-1", {"spec": {"unschedulable": True}}, _content_type="application/merge-patch+json")
    ScaleDown().execute({})

    summary = ScaleDown(offset=LATER).execute({})

    assert not cordoned("stopped-1") and ANNOTATION_CORDONED_BY not in annotations("stopped-1")
    assert summary["decisions"]["idle-1"] == {"verdict": "kept", "reason": "cordoned by someone else; left alone"}
    assert cordoned("idle-1") and status(cloud, "idle-1")["Status"] == "Running"


def test_bad_idle_time_fails_the_task_naming_the_field():
    from airflow.sdk.exceptions import AirflowFailException

    op = IdleScaleDownOperator(task_id="scale_down", idle_seconds="soon")
    with pytest.raises(AirflowFailException, match="idle_seconds"):
        op.execute({})



def test_a_failure_inside_the_cordon_window_leaves_the_node_running_and_schedulable(cloud):
    ScaleDown().execute({})

    def api_outage(nodes):
        raise ConnectionError("API server went away")

    with pytest.raises(ConnectionError):
        ScaleDown(offset=LATER, in_window=api_outage).execute({})

    assert status(cloud, "idle-1")["Status"] == "Running"
    assert not cordoned("idle-1") and ANNOTATION_CORDONED_BY not in annotations("idle-1")

"""The pure idle scale-down decision: what counts as work, idle-since books, who is never touched."""
from __future__ import annotations

import pytest

from gpuboot.core.idle import (
    ANNOTATION_CORDONED_BY,
    ANNOTATION_IDLE_SINCE,
    CORDONED_BY,
    FENCE_JOB,
    IdleVerdict,
    fence_entries,
    plan_scaledown,
    recheck,
)
from gpuboot.core.model import Reservation
from gpuboot.core.resources import GPU, Resources
from gpuboot.core.timefmt import rfc3339
from gpuboot.operators.scaledown import _as_bool, _as_seconds
from tests.builders import instance, node, pod

NOW = 1_700_000_000.0
IDLE = 600.0
MANAGED = {"gpuboot.io/managed": "true"}
BOOTED = NOW - 3600


def managed_node(name: str, *, idle_since: float | str | None = None, cordoned_by_us: bool = False,
                 unschedulable: bool = False, labels: dict | None = None) -> dict:
    n = node(name, labels={**MANAGED, **(labels or {})}, unschedulable=unschedulable or cordoned_by_us)
    if idle_since is not None:
        n["metadata"]["annotations"][ANNOTATION_IDLE_SINCE] = (
            idle_since if isinstance(idle_since, str) else rfc3339(idle_since))
    if cordoned_by_us:
        n["metadata"]["annotations"][ANNOTATION_CORDONED_BY] = CORDONED_BY
    return n


def plan(nodes, pods=(), instances=None, reservations=(), now=NOW, idle=IDLE, spare=0.0):
    instances = instances if instances is not None else [instance(n["metadata"]["name"], start=BOOTED)
                                                         for n in nodes]
    return plan_scaledown(list(nodes), list(pods), instances, list(reservations), now, idle, spare)


def decision(p, name):
    (d,) = [d for d in p.decisions if d.node == name]
    return d


def daemonset_pod(name: str, node_name: str) -> dict:
    p = pod(name, node_name, requests={"cpu": "100m"}, namespace="kube-system")
    p["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "nvidia-dp",
                                         "uid": "u1", "controller": True}]
    return p


def mirror_pod(name: str, node_name: str) -> dict:
    p = pod(name, node_name, namespace="kube-system")
    p["metadata"]["annotations"] = {"kubernetes.io/config.mirror": "abc"}
    return p


def reservation(job: str, node_name: str, expires_at: float = NOW + 300) -> Reservation:
    return Reservation(job_id=job, task=f"{job}-0", node=node_name,
                       resources=Resources.parse({"nvidia.com/gpu": 1}), expires_at=expires_at)


# --- what counts as work -------------------------------------------------------------------

def test_daemonset_mirror_and_terminated_pods_do_not_make_a_node_busy():
    pods = [daemonset_pod("dp-a", "a"), mirror_pod("static-a", "a"),
            pod("done", "a", phase="Succeeded"), pod("crashed", "a", phase="Failed")]
    d = decision(plan([managed_node("a", idle_since=NOW - 700)], pods), "a")
    assert d.verdict == IdleVerdict.STOP
    assert d.reason == "idle for 11 min >= 10 min"


def test_workload_pods_make_a_node_busy_and_clear_its_idle_since():
    pods = [pod("train-1", "a"), pod("train-2", "a", phase="Pending"), daemonset_pod("dp-a", "a")]
    d = decision(plan([managed_node("a", idle_since=NOW - 1800)], pods), "a")
    assert d.verdict == IdleVerdict.BUSY
    assert d.reason == "busy: 2 pods (default/train-1, default/train-2)"
    assert d.idle_since is None and d.annotation_changes


def test_a_pending_pod_pinned_to_the_node_by_hostname_counts():
    pinned = pod("launching", None, phase="Pending")
    pinned["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "host-a"}
    d = decision(plan([managed_node("a", idle_since=NOW - 1800)], [pinned]), "a")
    assert d.verdict == IdleVerdict.BUSY and "default/launching" in d.reason


def test_a_live_reservation_blocks_an_expired_one_and_the_fence_do_not():
    nodes = [managed_node("a", idle_since=NOW - 1800), managed_node("b", idle_since=NOW - 1800)]
    reservations = [reservation("job-x", "a"), reservation("job-old", "b", expires_at=NOW - 1),
                    *fence_entries(["b"], NOW, 900)]
    p = plan(nodes, reservations=reservations)
    a, b = decision(p, "a"), decision(p, "b")
    assert a.verdict == IdleVerdict.RESERVED
    assert a.reason.startswith("reserved by job job-x (task job-x-0) until ")
    assert a.idle_since is None
    assert b.verdict == IdleVerdict.STOP


def test_pods_are_reported_before_reservations():
    d = decision(plan([managed_node("a")], [pod("p", "a")], reservations=[reservation("j", "a")]), "a")
    assert d.verdict == IdleVerdict.BUSY


# --- managed only ----------------------------------------------------------------------------

def test_unmanaged_nodes_never_get_a_decision_however_long_idle():
    cpu = node("cpu-1", gpus=0, instance=None)                 # not an ECS node at all
    plain = node("gpu-plain", labels={})                          # ECS node, not opted in
    plain["metadata"]["annotations"][ANNOTATION_IDLE_SINCE] = rfc3339(NOW - 10 * 86400)
    tagged = node("gpu-tagged", labels={})
    instances = [instance("gpu-plain", start=BOOTED),
                 instance("gpu-tagged", start=BOOTED, tags={"gpuboot:managed": "true"})]
    p = plan([cpu, plain, tagged], instances=instances)
    assert [d.node for d in p.decisions] == ["gpu-tagged"]       # the ECS tag opts in too
    assert p.unmanaged == ("cpu-1", "gpu-plain")
    assert p.lines()[-1] == "unmanaged, never touched: cpu-1, gpu-plain"
    assert [d.node for d in p.to_stop] == []


# --- idle-since books and the idle time --------------------------------------------------------

def test_first_seen_idle_starts_the_clock_now_and_does_not_stop():
    d = decision(plan([managed_node("a")]), "a")
    assert (d.verdict, d.reason) == (IdleVerdict.IDLE, "idle for 0.0 s < 10 min")
    assert d.idle_since == rfc3339(NOW) and d.idle_since_before is None and d.annotation_changes


@pytest.mark.parametrize(("idle_for", "verdict", "reason"), [
    (180, IdleVerdict.IDLE, "idle for 3 min 00 s < 10 min"),
    (599, IdleVerdict.IDLE, "idle for 9 min 59 s < 10 min"),
    (600, IdleVerdict.STOP, "idle for 10 min >= 10 min"),
    (720, IdleVerdict.STOP, "idle for 12 min >= 10 min"),
])
def test_stop_only_after_the_idle_time(idle_for, verdict, reason):
    d = decision(plan([managed_node("a", idle_since=NOW - idle_for)]), "a")
    assert (d.verdict, d.reason) == (verdict, reason)
    assert not d.annotation_changes                       # the recorded start of idleness is kept


# --- the fleet's spare (IdleRule) -----------------------------------------------------------

HOUR = 3600.0


@pytest.mark.parametrize(("idle_for", "verdict", "reason"), [
    (300, IdleVerdict.IDLE, "idle for 5 min 00 s < 10 min"),
    (720, IdleVerdict.SPARE, ("idle for 12 min, kept as the spare: the other running nodes have 0 free GPU(s), "
                             "fewer than its 1; stopped at 70 min idle at the latest")),
    (HOUR + 600, IdleVerdict.STOP, "idle for 70 min >= 70 min (kept as the spare)"),
])
def test_the_last_idle_gpu_node_is_the_spare_until_idle_plus_spare(idle_for, verdict, reason):
    busy = managed_node("busy")
    p = plan([managed_node("a", idle_since=NOW - idle_for), busy], pods=[pod("work", "busy", requests={GPU: "1"})],
             instances=[instance(name, start=NOW - 5 * HOUR) for name in ("a", "busy")], spare=HOUR)
    d = decision(p, "a")
    assert (d.verdict, d.reason) == (verdict, reason)
    assert d not in p.to_stop or verdict == IdleVerdict.STOP
    assert p.to_json()["spare_seconds"] == HOUR


def test_no_spare_is_kept_where_the_other_running_nodes_have_its_gpus_free():
    roomy = managed_node("roomy")      # 1 GPU, running, nothing on it yet: idle 5 min
    p = plan([managed_node("a", idle_since=NOW - 720), managed_node("roomy", idle_since=NOW - 300)], spare=HOUR)
    assert decision(p, "a").verdict == IdleVerdict.STOP and decision(p, "a").reason == "idle for 12 min >= 10 min"
    assert decision(p, roomy["metadata"]["name"]).verdict == IdleVerdict.IDLE


def test_of_several_idle_nodes_the_longest_idle_stop_and_the_last_stays_the_spare():
    nodes = [managed_node(name, idle_since=NOW - idle) for name, idle in (("a", 900), ("b", 3000), ("c", 1200))]
    p = plan(nodes, spare=HOUR)
    assert {d.node: d.verdict for d in p.decisions} == {
        "b": IdleVerdict.STOP, "c": IdleVerdict.STOP, "a": IdleVerdict.SPARE}


def test_reserved_gpus_elsewhere_are_not_free_and_a_cpu_node_is_never_the_spare():
    reserved = managed_node("reserved")
    cpu = node("cpu", gpus=0, labels=MANAGED)
    cpu["metadata"]["annotations"][ANNOTATION_IDLE_SINCE] = rfc3339(NOW - 720)
    p = plan([managed_node("a", idle_since=NOW - 720), reserved, cpu], reservations=[reservation("j", "reserved")],
             instances=[instance("a", start=BOOTED), instance("reserved", start=BOOTED),
                        instance("cpu", start=BOOTED, gpus=0)], spare=HOUR)
    assert decision(p, "a").verdict == IdleVerdict.SPARE
    assert decision(p, "cpu").verdict == IdleVerdict.STOP


def test_a_spare_gpuboot_cordoned_is_uncordoned_and_no_spare_without_spare_time():
    n = managed_node("a", idle_since=NOW - 720, cordoned_by_us=True)
    d = decision(plan([n], spare=HOUR), "a")
    assert d.verdict == IdleVerdict.SPARE and d.uncordon and d.reason.endswith("un-cordoning (gpuboot cordoned it)")
    assert decision(plan([n], spare=0), "a").verdict == IdleVerdict.STOP


@pytest.mark.parametrize("bad", [-1, 31 * 24 * HOUR, float("nan")])
def test_bad_spare_time_names_the_field(bad):
    with pytest.raises(ValueError, match="spare_seconds"):
        plan([managed_node("a")], spare=bad)
    with pytest.raises(ValueError, match=r"spare_seconds.*or 0 for none"):
        _as_seconds(bad, "spare_seconds", zero=True)
    assert _as_seconds("0", "spare_seconds", zero=True) == 0


def test_idle_since_from_an_earlier_boot_restarts_the_clock():
    n = managed_node("a", idle_since=NOW - 1800)          # written before the instance's last start
    d = decision(plan([n], instances=[instance("a", start=NOW - 120)]), "a")
    assert d.verdict == IdleVerdict.IDLE
    assert d.idle_since == rfc3339(NOW)


@pytest.mark.parametrize("bad", ["yesterday", rfc3339(NOW + 3600)])
def test_unreadable_or_future_idle_since_restarts_the_clock(bad):
    d = decision(plan([managed_node("a", idle_since=bad)]), "a")
    assert d.verdict == IdleVerdict.IDLE and d.idle_since == rfc3339(NOW)


# --- instance states and cordons ------------------------------------------------------------

def test_instances_not_running_are_not_stopped_and_lose_idle_since():
    nodes = [managed_node(n, idle_since=NOW - 1800) for n in ("stopped", "stopping", "starting")]
    instances = [instance("stopped", "Stopped"), instance("stopping", "Stopping"), instance("starting", "Starting")]
    p = plan(nodes, instances=instances)
    assert {d.node: d.verdict for d in p.decisions} == {
        "stopped": IdleVerdict.STOPPED, "stopping": IdleVerdict.STOPPING, "starting": IdleVerdict.STARTING}
    assert decision(p, "stopped").reason == "instance Stopped (StopCharging)"
    assert all(d.idle_since is None for d in p.decisions)
    assert p.to_stop == ()


def test_an_instance_stopped_in_keep_charging_mode_is_reported_as_still_billed():
    """Issue 35 #9: it read "instance Stopped (KeepCharging)" like any stopped node, though ECS bills it."""
    from gpuboot.core.inventory import build_inventory

    node = managed_node("kept", idle_since=NOW - 1800)
    kept = {**instance("kept", "Stopped"), "StoppedMode": "KeepCharging"}
    reason = decision(plan([node], instances=[kept]), "kept").reason
    assert reason.startswith("instance Stopped in KeepCharging mode: still billed for its compute while stopped")
    (view,) = build_inventory([node], [], [kept], {}, [], NOW)
    assert view.reason == reason                          # the fleet page and the candidate table say the same


def test_gpuboot_cordons_are_released_once_stopped_not_while_stopping():
    nodes = [managed_node("stopped", cordoned_by_us=True), managed_node("stopping", cordoned_by_us=True),
             managed_node("started", cordoned_by_us=True)]
    instances = [instance("stopped", "Stopped"), instance("stopping", "Stopping"), instance("started", "Pending")]
    p = plan(nodes, instances=instances)
    assert {d.node: d.uncordon for d in p.decisions} == {"stopped": True, "stopping": False, "started": True}
    assert "un-cordoning" in decision(p, "stopped").reason


def test_an_interrupted_run_cordon_is_released_when_the_node_is_busy_or_not_due():
    nodes = [managed_node("busy", idle_since=NOW - 1800, cordoned_by_us=True),
             managed_node("young", idle_since=NOW - 60, cordoned_by_us=True),
             managed_node("due", idle_since=NOW - 1800, cordoned_by_us=True)]
    p = plan(nodes, [pod("p", "busy")])
    assert {d.node: (d.verdict, d.uncordon) for d in p.decisions} == {
        "busy": (IdleVerdict.BUSY, True), "young": (IdleVerdict.IDLE, True), "due": (IdleVerdict.STOP, False)}


def test_a_node_cordoned_by_someone_else_is_left_alone():
    n = managed_node("a", idle_since=NOW - 1800, unschedulable=True)
    d = decision(plan([n]), "a")
    assert d.verdict == IdleVerdict.KEPT and not d.uncordon and not d.annotation_changes
    assert d.reason == "cordoned by someone else; left alone"


def test_a_node_whose_instance_is_gone_is_kept():
    d = decision(plan([managed_node("a")], instances=[]), "a")
    assert (d.verdict, d.reason) == (IdleVerdict.KEPT, "no ECS instance for its providerID")


# --- re-check, log lines, inputs -----------------------------------------------------------

def test_recheck_names_only_the_nodes_that_found_work():
    nodes = [managed_node("a"), managed_node("b"), managed_node("c")]
    found = recheck(nodes, ["a", "b", "c"], [pod("late", "b"), daemonset_pod("ds", "c")],
                    [reservation("job-y", "a"), *fence_entries(["a", "b", "c"], NOW, 60)], NOW)
    assert set(found) == {"a", "b"}
    assert "job-y" in found["a"] and found["b"] == "busy: 1 pod (default/late)"


def test_one_log_line_per_managed_node():
    nodes = [managed_node("busy"), managed_node("idle"), managed_node("reserved")]
    p = plan(nodes, [pod("p", "busy")], reservations=[reservation("job-x", "reserved")])
    lines = p.lines()
    assert len(lines) == 1 + 3 + 1
    assert lines[1].split()[:3] == ["busy", "i-busy", "busy"]
    assert "reserved by job job-x" in lines[3]
    assert p.to_json()["decisions"]["idle"] == {"verdict": "idle", "reason": "idle for 0.0 s < 10 min"}


def test_fence_entries_hold_no_resources():
    entries = fence_entries(["b", "a", "a"], NOW, 60)
    assert [(e.job_id, e.node, e.resources, e.expires_at) for e in entries] == [
        (FENCE_JOB, "a", Resources(), NOW + 60), (FENCE_JOB, "b", Resources(), NOW + 60)]


@pytest.mark.parametrize("bad", [0, -5, "ten", None, 31 * 86400])
def test_bad_idle_time_names_the_field(bad):
    with pytest.raises(ValueError, match="idle_seconds"):
        _as_seconds(bad, "idle_seconds")
    if isinstance(bad, (int, float)) or bad is None:
        with pytest.raises(ValueError, match="idle_seconds"):
            plan([managed_node("a")], idle=bad if bad is not None else float("nan"))


def test_flags_from_templates():
    assert [_as_bool(v, "dry_run") for v in (True, "True", "false", "0", "")] == [True, True, False, False, False]
    with pytest.raises(ValueError, match="dry_run"):
        _as_bool("maybe", "dry_run")

"""The GPU-readiness rule: never ready on a stale status, only after the kubelet's reset and the real count."""
import pytest

from gpuboot.core.readiness import BootBaseline, ReadinessTracker, extended_needs
from tests.builders import node

T0 = 1_700_000_000.0      # the start request
STALE_HB = T0 - 3600      # last heartbeat before the instance was stopped


def gpu_node(gpus, *, ready="True", boot_id="boot-2", heartbeat=None, transition=None, unschedulable=False,
             taints=(), extra=None):
    return node("g", gpus=gpus, ready=ready, boot_id=boot_id, heartbeat=heartbeat, transition=transition,
                unschedulable=unschedulable, taints=taints,
                allocatable={"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": str(gpus), **(extra or {})})


def tracker(gpus_needed=1, settle=5.0, started=T0, boot_before="boot-1", continuous=True, fallback=60.0,
            extended=None):
    """A tracker fed every write since before the start (a watch from the baseline's resourceVersion)."""
    baseline = BootBaseline("g", started, boot_before, gpus_needed, resource_version_before="100",
                            extended_needed=extended or {})
    return ReadinessTracker(baseline, settle_seconds=settle, fallback_seconds=fallback, continuous=continuous)


def reset(t, when, **kwargs):
    """Feed the kubelet's zeroing of the GPU count after the start."""
    v = t.observe(gpu_node(0, **{"heartbeat": when, "transition": when, **kwargs}), when)
    assert not v.ready
    return v


def test_stale_zero_real_sequence_is_ready_at_the_real_count_after_the_zero():
    """The fast path: the zero after the start was seen, so the real count needs no settle window."""
    t = tracker(settle=5.0)
    timeline = [
        # (time, node): the status left over from before the stop, then the new boot
        (T0 + 0.0, gpu_node(1, ready="Unknown", boot_id="boot-1", heartbeat=STALE_HB, transition=STALE_HB)),
        (T0 + 3.0, gpu_node(1, boot_id="boot-2", heartbeat=T0 + 3, transition=T0 + 3)),   # stale "1"
        (T0 + 4.0, gpu_node(0, boot_id="boot-2", heartbeat=T0 + 3, transition=T0 + 3)),   # kubelet zeroes
    ]
    for when, n in timeline:
        v = t.observe(n, when)
        assert not v.ready, (when - T0, v.reason)
    assert t.next_check_in(T0 + 4.0) is None          # nothing to time: waiting for the device plugin
    v = t.observe(gpu_node(1, boot_id="boot-2", heartbeat=T0 + 3, transition=T0 + 3), T0 + 6.0)   # device plugin
    assert v.ready, v.reason
    assert "fast path" in v.reason and v.evidence["path"] == "reset seen"
    assert v.evidence["boot_id_changed"] and v.evidence["gpus_allocatable"] == 1
    assert v.evidence["held_seconds"] == 0.0 and v.evidence["settle_seconds"] == 0.0


def test_stale_count_held_far_longer_than_the_settle_window_is_still_not_ready():
    """Holding is no evidence on the fast path: the stale value may last any time before the reset."""
    t = tracker(settle=5.0)
    stale = gpu_node(1, boot_id="boot-2", heartbeat=T0 + 3, transition=T0 + 3)
    for when in (T0 + 3, T0 + 8.1, T0 + 30):
        v = t.observe(stale, when)
        assert not v.ready and v.evidence["path"] == "waiting for the reset", v.reason
        assert t.next_check_in(when) is None


def test_the_stale_first_value_never_counts_when_settle_is_longer_than_it_lasts():
    t = tracker(settle=2.0)
    t.observe(gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3), T0 + 3)
    v = t.observe(gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3), T0 + 4.9)
    assert not v.ready
    v = t.observe(gpu_node(0, heartbeat=T0 + 3, transition=T0 + 3), T0 + 5.0)
    assert not v.ready and "nvidia.com/gpu is 0, 1 needed" in v.reason and t.next_check_in(T0 + 5) is None


def test_status_with_unchanged_boot_id_from_before_the_start_never_counts():
    t = tracker(settle=0)
    stale = gpu_node(1, boot_id="boot-1", heartbeat=STALE_HB, transition=STALE_HB)
    for when in (T0, T0 + 60, T0 + 3600):
        v = t.observe(stale, when)
        assert not v.ready and "predates the start" in v.reason
        assert v.evidence["fresh"] is False and v.evidence["heartbeat_age_seconds"] == pytest.approx(when - STALE_HB)


@pytest.mark.parametrize("heartbeat, transition, fresh_by", [
    (T0 + 10, STALE_HB, "heartbeat after the start"),
    (STALE_HB, T0 + 10, "Ready transition after the start"),
])
def test_heartbeat_or_transition_after_the_start_is_evidence(heartbeat, transition, fresh_by):
    t = tracker(settle=0, boot_before="boot-1")
    reset(t, T0 + 10, boot_id="boot-1")
    v = t.observe(gpu_node(1, boot_id="boot-1", heartbeat=heartbeat, transition=transition), T0 + 11)
    assert v.ready and v.evidence["fresh_by"] == fresh_by


def test_unknown_boot_id_before_needs_time_evidence():
    t = tracker(settle=0, boot_before=None)
    reset(t, T0 + 1, heartbeat=STALE_HB, transition=STALE_HB)
    assert not t.observe(gpu_node(1, heartbeat=STALE_HB, transition=STALE_HB), T0 + 5).ready
    assert t.observe(gpu_node(1, heartbeat=T0 + 4, transition=STALE_HB), T0 + 5).ready


def test_node_not_started_by_us_needs_no_boot_evidence():
    t = tracker(started=None, boot_before=None, settle=1.0)
    n = gpu_node(1, boot_id="boot-1", heartbeat=STALE_HB, transition=STALE_HB)
    assert not t.observe(n, T0).ready
    assert t.observe(n, T0 + 1).ready


def test_cpu_only_node_needs_no_gpu_count():
    t = tracker(gpus_needed=0, settle=0)
    v = t.observe(gpu_node(0, heartbeat=T0 + 2, transition=T0 + 2), T0 + 2)
    assert v.ready and "CPU-only" in v.reason


def test_more_gpus_needed_than_registered():
    t = tracker(gpus_needed=2, settle=0)
    reset(t, T0 + 1)
    v = t.observe(gpu_node(1, heartbeat=T0 + 2, transition=T0 + 2), T0 + 2)
    assert not v.ready and "is 1, 2 needed" in v.reason


def test_not_ready_or_cordoned_blocks_the_fast_path():
    t = tracker(settle=5)
    reset(t, T0 + 1)
    v = t.observe(gpu_node(1, ready="False", heartbeat=T0 + 3, transition=T0 + 3), T0 + 4)
    assert not v.ready and "NodeReady is False" in v.reason
    v = t.observe(gpu_node(1, heartbeat=T0 + 2, transition=T0 + 2, unschedulable=True), T0 + 8)
    assert not v.ready and "cordoned" in v.reason
    assert t.observe(gpu_node(1, heartbeat=T0 + 9, transition=T0 + 9), T0 + 9).ready


def test_the_settle_window_still_applies_to_a_node_this_run_did_not_start():
    t = tracker(started=None, boot_before=None, settle=5)
    good = gpu_node(1, boot_id="boot-1", heartbeat=T0 + 2, transition=T0 + 2)
    t.observe(good, T0 + 2)
    v = t.observe(gpu_node(1, ready="False", boot_id="boot-1", heartbeat=T0 + 3, transition=T0 + 3), T0 + 4)
    assert not v.ready and "NodeReady is False" in v.reason
    t.observe(good, T0 + 5)
    v = t.observe(good, T0 + 9.9)
    assert not v.ready and v.reason.startswith("settling")       # the clock restarted at T0 + 5
    assert t.observe(good, T0 + 10).ready


def test_a_new_boot_during_the_wait_needs_its_own_reset():
    t = tracker(settle=5)
    reset(t, T0 + 1)
    v = t.observe(gpu_node(0, boot_id="boot-2", heartbeat=T0 + 2, transition=T0 + 2), T0 + 2)
    assert not v.ready
    v = t.observe(gpu_node(1, boot_id="boot-3", heartbeat=T0 + 6, transition=T0 + 6), T0 + 6)
    assert not v.ready and "has not reset" in v.reason
    assert not t.observe(gpu_node(1, boot_id="boot-3", heartbeat=T0 + 6, transition=T0 + 6), T0 + 20).ready
    reset(t, T0 + 21, boot_id="boot-3")
    v = t.observe(gpu_node(1, boot_id="boot-3", heartbeat=T0 + 22, transition=T0 + 22), T0 + 22)
    assert v.ready and v.evidence["boot_id"] == "boot-3"


def test_missing_node_and_baseline_round_trip():
    t = tracker()
    v = t.observe(None, T0)
    assert not v.ready and "not found" in v.reason
    b = BootBaseline("g", T0, "boot-1", 2, resource_version_before="41", extended_needed={"aliyun.com/gpu-mem": 8})
    assert BootBaseline.from_json(b.to_json()) == b
    assert b.needs == {"nvidia.com/gpu": 2, "aliyun.com/gpu-mem": 8}
    assert BootBaseline.from_json({"node": "g", "start_requested_at": T0, "boot_id_before": None,
                                   "gpus_needed": 1}).resource_version_before is None   # older XCom
    with pytest.raises(ValueError, match="fallback_seconds"):
        ReadinessTracker(b, fallback_seconds=-1)
    with pytest.raises(ValueError, match="settle_seconds"):
        ReadinessTracker(b, settle_seconds=-1)


# --- the kubelet's reset, not a time window (issue: the reset arriving after the settle window) ----------

def test_a_reset_delayed_well_past_the_settle_window_never_lets_the_stale_count_through():
    t = tracker(settle=1.0)
    stale = gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3)     # new bootID, Ready, the count from before
    for when in (T0 + 3, T0 + 4.5, T0 + 8, T0 + 13, T0 + 300):
        v = t.observe(stale, when)
        assert not v.ready, (when - T0, v.reason)
        assert "has not reset nvidia.com/gpu" in v.reason and v.evidence["path"] == "waiting for the reset"
    reset(t, T0 + 301)
    v = t.observe(gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3), T0 + 302)
    assert v.ready and "reset after the start seen" in v.reason and v.evidence["reset_seen"] == ["nvidia.com/gpu"]


def test_a_device_plugin_that_never_registers_is_never_ready():
    t = tracker(settle=1.0)
    t.observe(gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3), T0 + 3)
    reset(t, T0 + 15)
    for when in (T0 + 16, T0 + 100, T0 + 1000):
        v = t.observe(gpu_node(0, heartbeat=when, transition=T0 + 3), when)
        assert not v.ready and "nvidia.com/gpu is 0, 1 needed" in v.reason


def test_the_kubelet_order_zero_with_the_old_boot_id_counts_as_the_reset():
    """A restarted kubelet zeroes the count in its registration patch, before it posts its new bootID."""
    t = tracker(settle=0)
    v = t.observe(gpu_node(0, boot_id="boot-1", ready="Unknown", heartbeat=STALE_HB, transition=STALE_HB), T0 + 3)
    assert not v.ready and v.evidence["reset_seen"] == ["nvidia.com/gpu"]
    v = t.observe(gpu_node(0, ready="False", heartbeat=T0 + 4, transition=T0 + 4), T0 + 4)
    assert not v.ready and "NodeReady is False" in v.reason
    assert not t.observe(gpu_node(0, heartbeat=T0 + 5, transition=T0 + 5), T0 + 5).ready
    assert t.observe(gpu_node(1, heartbeat=T0 + 5, transition=T0 + 5), T0 + 7).ready


def test_a_relist_before_the_reset_falls_back_to_the_long_window_and_still_waits_for_a_late_reset():
    t = tracker(settle=1.0, fallback=60)
    stale = gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3)
    t.observe(stale, T0 + 3)
    t.lost_continuity("the watch expired (410 Gone) and the Node was re-listed")
    for when in (T0 + 4, T0 + 5, T0 + 13, T0 + 62.9):      # reset 10 s late: still inside the fallback window
        v = t.observe(stale, when)
        assert not v.ready and v.reason.startswith("fallback, reset not observed"), v.reason
        assert v.evidence["path"] == "fallback" and "410 Gone" in v.evidence["warning"]
    reset(t, T0 + 13.5)
    real = gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3)
    t.observe(real, T0 + 15)
    v = t.observe(real, T0 + 16)
    assert v.ready and v.evidence["path"] == "reset seen" and "warning" not in v.evidence


def test_when_the_reset_can_never_be_seen_the_count_is_trusted_after_the_fallback_window_with_a_warning():
    t = tracker(settle=1.0, fallback=60, continuous=False)       # e.g. no resourceVersion to watch from
    n = gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3)
    t.observe(n, T0 + 3)
    assert t.next_check_in(T0 + 3) == pytest.approx(60)
    assert not t.observe(n, T0 + 62.9).ready
    v = t.observe(n, T0 + 63)
    assert v.ready and "fallback" in v.reason and "not observed" in v.evidence["warning"]


def test_continuity_needs_a_resource_version_from_before_the_start():
    baseline = BootBaseline("g", T0, "boot-1", 1, resource_version_before=None)
    t = ReadinessTracker(baseline, settle_seconds=1, continuous=True)
    assert not t.continuous and "no resourceVersion" in t.gap


def test_not_ready_and_unreachable_taints_block():
    t = tracker(settle=0)
    reset(t, T0 + 1)
    tainted = gpu_node(1, heartbeat=T0 + 2, transition=T0 + 2,
                       taints=[{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}])
    v = t.observe(tainted, T0 + 2)
    assert not v.ready and "tainted node.kubernetes.io/not-ready" in v.reason
    assert t.observe(gpu_node(1, heartbeat=T0 + 2, transition=T0 + 2), T0 + 3).ready


def test_every_requested_extended_resource_needs_its_own_reset_and_count():
    gpu_mem = "aliyun.com/gpu-mem"
    t = tracker(gpus_needed=0, settle=0, extended={gpu_mem: 8})
    v = t.observe(gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3, extra={gpu_mem: "16"}), T0 + 3)
    assert not v.ready and f"has not reset {gpu_mem}" in v.reason
    v = t.observe(gpu_node(1, heartbeat=T0 + 4, transition=T0 + 3, extra={gpu_mem: "0"}), T0 + 4)
    assert not v.ready and f"allocatable {gpu_mem} is 0, 8 needed" in v.reason
    v = t.observe(gpu_node(1, heartbeat=T0 + 5, transition=T0 + 3, extra={gpu_mem: "16"}), T0 + 5)
    assert v.ready and v.evidence["allocatable"] == {gpu_mem: 16}


def test_extended_needs_are_the_device_plugin_resources_besides_whole_gpus():
    requests = {"cpu": 4000, "memory": 2**34, "nvidia.com/gpu": 1, "aliyun.com/gpu-mem": 8, "rdma/hca": 1,
                "hugepages-2Mi": 0, "example.kubernetes.io/x": 1, "ephemeral-storage": 10}
    assert extended_needs(requests) == {"aliyun.com/gpu-mem": 8, "rdma/hca": 1}


def test_holding_in_fallback_is_what_may_stretch_a_boot_deadline():
    from gpuboot.core.gpu_wait import GpuWait

    t = tracker(settle=1.0, fallback=60, continuous=False)
    wait = GpuWait(t.baseline, t, deadline=T0 + 4)
    n = gpu_node(1, heartbeat=T0 + 3, transition=T0 + 3)
    wait.observe(n, T0 + 3)
    assert wait.holding_in_fallback(T0 + 4)                      # all in order but the missed reset
    assert not wait.expired(T0 + 4) and wait.stretched_by == 59  # so the deadline runs on to the window's end
    assert wait.deadline == T0 + 63 and wait.expired(T0 + 63)    # once: then it expires
    wait.observe(gpu_node(1, ready="False", heartbeat=T0 + 5, transition=T0 + 5), T0 + 5)
    assert not wait.holding_in_fallback(T0 + 5)                  # a real problem: no stretching
    t2 = tracker(settle=1.0)
    reset(t2, T0 + 1)
    wait2 = GpuWait(t2.baseline, t2, deadline=T0 + 2)
    wait2.observe(n, T0 + 2)
    assert not wait2.holding_in_fallback(T0 + 2)                 # the fast path never needs it
    assert wait2.expired(T0 + 2) and wait2.stretched_by is None


def test_every_finding_has_a_code_and_the_first_blocking_one_leads():
    t = tracker(settle=1.0)
    r = t.observe(gpu_node(0, ready="False", boot_id="boot-1", heartbeat=T0 - 50, transition=T0 - 50), T0 + 1)
    assert not r.ready and r.code == "StatusBeforeStart"
    assert [x.code for x in r.reasons] == ["StatusBeforeStart", "NodeNotReady", "NotRegistered"]
    assert r.reason.startswith("waiting: status predates the start") and "NodeReady is False" in r.reason


def test_the_state_a_resumed_step_carries_round_trips_as_json():
    import json

    from gpuboot.operators.capacity_wait import CapacityWait
    from gpuboot.sensors.gpu_ready import WaitProgress, WaitState

    state = WaitState({"job_id": "j"}, [{"node": "a"}, {"node": "b"}], ["x"])
    progress = WaitProgress(1, 2.0, {"a": {"ready": "True"}}, state)
    assert WaitProgress.from_json(json.loads(json.dumps(progress.to_json()))) == progress
    flat = {"index": 1, "settle": 2.0, "seen": {"a": {"ready": "True"}}, "plan": {"job_id": "j"},
            "baselines": [{"node": "a"}, {"node": "b"}], "tried": ["x"]}      # an echo written by 0.1
    assert WaitProgress.from_json(flat) == progress
    wait = CapacityWait(1_800_000_000.5, ["offering t in z: NoStock"])
    assert CapacityWait.from_json(json.loads(json.dumps(wait.to_json()))) == wait
    assert CapacityWait.from_json({"deadline": 5}).tried == []          # the place step's timer carries no list


def test_several_extended_resources_each_need_their_own_zero_and_the_late_one_holds_readiness():
    gpu_mem, rdma = "aliyun.com/gpu-mem", "rdma/hca"
    t = tracker(gpus_needed=1, settle=5.0, extended={gpu_mem: 8, rdma: 1})

    def state(gpus, mem, hca, when):
        return gpu_node(gpus, heartbeat=when, transition=T0 + 3, extra={gpu_mem: str(mem), rdma: str(hca)})

    steps = [(T0 + 3, state(1, 16, 1, T0 + 3), f"has not reset nvidia.com/gpu, {gpu_mem}, {rdma}"),  # all stale
             (T0 + 4, state(0, 0, 0, T0 + 4), "allocatable nvidia.com/gpu is 0"),                      # kubelet resets
             (T0 + 5, state(1, 0, 0, T0 + 5), f"allocatable {gpu_mem} is 0, 8 needed"),                # GPU plugin
             (T0 + 6, state(1, 0, 1, T0 + 6), f"allocatable {gpu_mem} is 0, 8 needed"),                # RDMA plugin
             (T0 + 40, state(1, 0, 1, T0 + 40), f"allocatable {gpu_mem} is 0, 8 needed")]              # gpu-mem late
    for when, n, why in steps:
        v = t.observe(n, when)
        assert not v.ready and why in v.reason, (when - T0, v.reason)
    v = t.observe(state(1, 4, 1, T0 + 41), T0 + 41)           # registered, but fewer than requested
    assert not v.ready and f"allocatable {gpu_mem} is 4, 8 needed" in v.reason
    v = t.observe(state(1, 16, 1, T0 + 42), T0 + 42)
    assert v.ready and v.evidence["allocatable"] == {"nvidia.com/gpu": 1, gpu_mem: 16, rdma: 1}
    assert v.evidence["reset_seen"] == sorted(["nvidia.com/gpu", gpu_mem, rdma])


def test_one_resource_whose_zero_was_missed_sends_the_whole_node_to_the_fallback_window():
    gpu_mem = "aliyun.com/gpu-mem"
    t = tracker(gpus_needed=1, settle=1.0, fallback=30.0, extended={gpu_mem: 8})
    t.observe(gpu_node(0, heartbeat=T0 + 3, transition=T0 + 3, extra={gpu_mem: "16"}), T0 + 3)   # GPU reset seen
    t.lost_continuity("the watch expired (410 Gone) and the Node was re-listed")
    n = gpu_node(1, heartbeat=T0 + 9, transition=T0 + 3, extra={gpu_mem: "16"})   # gpu-mem: stale or real?
    v = t.observe(n, T0 + 9)
    assert not v.ready and v.evidence["path"] == "fallback" and gpu_mem in v.evidence["warning"]
    assert "nvidia.com/gpu" not in v.evidence["warning"]
    assert not t.observe(n, T0 + 38.9).ready
    v = t.observe(n, T0 + 39)
    assert v.ready and "fallback" in v.reason


def test_a_boot_replayed_late_is_dated_by_the_nodes_own_writes():
    """The trigger started 30 s after the boot (Airflow scheduled the wait late) and reads the whole
    boot from the watch at once: each phase keeps the time the kubelet wrote it, "fired" the verdict's."""
    from gpuboot.core.gpu_wait import GpuWait

    t = tracker(settle=1.0)
    wait = GpuWait(t.baseline, t, deadline=T0 + 600)
    late = T0 + 40
    for state in (gpu_node(1, boot_id="boot-1", heartbeat=STALE_HB, transition=STALE_HB),    # before the start
                  gpu_node(1, ready="False", heartbeat=T0 + 4, transition=T0 + 4),           # the new boot writes
                  gpu_node(0, heartbeat=T0 + 9, transition=T0 + 9),                          # Ready, count reset
                  gpu_node(1, heartbeat=T0 + 14, transition=T0 + 9)):                        # GPUs registered
        verdict = wait.observe(state, late)
    assert verdict.ready
    assert wait.clock.marks == {"up": T0 + 4, "ready": T0 + 9, "registered": T0 + 14, "fired": late}
    # the stale count is dated no earlier than the start; the reset and the real count by their writes
    assert wait.clock.gpus == [[T0, 1], [T0 + 9, 0], [T0 + 14, 1]]
    # a node up when the job chose it has no boot to date: what the trigger saw, when it saw it
    up = tracker(settle=1.0, started=None)
    already = GpuWait(up.baseline, up, deadline=T0 + 600)
    already.observe(gpu_node(1, heartbeat=T0 - 100, transition=T0 - 3600), T0 + 2)
    assert already.clock.gpus == [[T0 + 2, 1]]

"""The GPU-readiness rule: never ready on a stale status, only after the real count held."""
import pytest

from gpuboot.readiness import BootBaseline, ReadinessTracker

from .builders import node

T0 = 1_700_000_000.0      # the start request
STALE_HB = T0 - 3600      # last heartbeat before the instance was stopped


def gpu_node(gpus, *, ready="True", boot_id="boot-2", heartbeat=None, transition=None, unschedulable=False):
    return node("g", gpus=gpus, ready=ready, boot_id=boot_id, heartbeat=heartbeat, transition=transition,
                unschedulable=unschedulable, allocatable={"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": str(gpus)})


def tracker(gpus_needed=1, settle=5.0, started=T0, boot_before="boot-1"):
    return ReadinessTracker(BootBaseline("g", started, boot_before, gpus_needed), settle_seconds=settle)


def test_stale_zero_real_sequence_is_ready_only_after_the_real_count_held():
    t = tracker()
    timeline = [
        # (time, node): the status left over from before the stop, then the new boot
        (T0 + 0.0, gpu_node(1, ready="Unknown", boot_id="boot-1", heartbeat=STALE_HB, transition=STALE_HB)),
        (T0 + 3.0, gpu_node(1, boot_id="boot-2", heartbeat=T0 + 3, transition=T0 + 3)),   # stale "1"
        (T0 + 4.0, gpu_node(0, boot_id="boot-2", heartbeat=T0 + 3, transition=T0 + 3)),   # kubelet zeroes
        (T0 + 6.0, gpu_node(1, boot_id="boot-2", heartbeat=T0 + 3, transition=T0 + 3)),   # device plugin
    ]
    for when, n in timeline:
        v = t.observe(n, when)
        assert not v.ready, (when - T0, v.reason)
    assert t.next_check_in(T0 + 6.0) == pytest.approx(5.0)
    for when in (T0 + 7.0, T0 + 9.0, T0 + 10.9):
        v = t.observe(timeline[-1][1], when)
        assert not v.ready and v.reason.startswith("settling")
    v = t.observe(timeline[-1][1], T0 + 11.0)
    assert v.ready, v.reason
    assert v.evidence["boot_id_changed"] and v.evidence["gpus_allocatable"] == 1
    assert v.evidence["held_seconds"] == pytest.approx(5.0)
    assert t.next_check_in(T0 + 11.0) == 0.0


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
    v = t.observe(gpu_node(1, boot_id="boot-1", heartbeat=heartbeat, transition=transition), T0 + 11)
    assert v.ready and v.evidence["fresh_by"] == fresh_by


def test_unknown_boot_id_before_needs_time_evidence():
    t = tracker(settle=0, boot_before=None)
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
    v = t.observe(gpu_node(1, heartbeat=T0 + 2, transition=T0 + 2), T0 + 2)
    assert not v.ready and "is 1, 2 needed" in v.reason


def test_not_ready_or_cordoned_breaks_the_hold():
    t = tracker(settle=5)
    good = gpu_node(1, heartbeat=T0 + 2, transition=T0 + 2)
    t.observe(good, T0 + 2)
    v = t.observe(gpu_node(1, ready="False", heartbeat=T0 + 3, transition=T0 + 3), T0 + 4)
    assert not v.ready and "NodeReady is False" in v.reason
    t.observe(good, T0 + 5)
    v = t.observe(gpu_node(1, heartbeat=T0 + 2, transition=T0 + 2, unschedulable=True), T0 + 8)
    assert not v.ready and "cordoned" in v.reason
    t.observe(good, T0 + 9)
    assert not t.observe(good, T0 + 13).ready       # the clock restarted at T0 + 9
    assert t.observe(good, T0 + 14).ready


def test_a_new_boot_during_the_hold_restarts_the_clock():
    t = tracker(settle=5)
    t.observe(gpu_node(1, boot_id="boot-2", heartbeat=T0 + 2, transition=T0 + 2), T0 + 2)
    t.observe(gpu_node(1, boot_id="boot-3", heartbeat=T0 + 6, transition=T0 + 6), T0 + 6)
    assert not t.observe(gpu_node(1, boot_id="boot-3", heartbeat=T0 + 6, transition=T0 + 6), T0 + 8).ready
    assert t.observe(gpu_node(1, boot_id="boot-3", heartbeat=T0 + 6, transition=T0 + 6), T0 + 11).ready


def test_missing_node_and_baseline_round_trip():
    t = tracker()
    v = t.observe(None, T0)
    assert not v.ready and "not found" in v.reason
    b = BootBaseline("g", T0, "boot-1", 2)
    assert BootBaseline.from_json(b.to_json()) == b
    with pytest.raises(ValueError, match="settle_seconds"):
        ReadinessTracker(b, settle_seconds=-1)

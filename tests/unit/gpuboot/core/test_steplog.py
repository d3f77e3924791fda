"""The lines a person reads in each step's log (gpuboot.core.steplog): times, durations, the boot's
phases from the readiness verdicts, the evidence block."""
from __future__ import annotations

import datetime as dt

from gpuboot.core.model import NodeState
from gpuboot.core.placement import Assignment, Outcome, Plan
from gpuboot.core.readiness import READY, BootBaseline, Readiness, ReadinessTracker, Reason
from gpuboot.core.resources import Resources
from gpuboot.core.steplog import BootClock, boot_summary, evidence_block, place_summary, start_summary
from gpuboot.core.timefmt import utc

T0 = 1796117211.17          # 2026-12-01 ... the epoch float the issue found in a log


def iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node(boot_id: str, ready: str, gpus: str, at: str = "2026-12-01T16:00:00Z") -> dict:
    return {"metadata": {"name": "gpu-1", "resourceVersion": "9"},
            "status": {"nodeInfo": {"bootID": boot_id}, "allocatable": {"nvidia.com/gpu": gpus, "memory": "8Gi"},
                       "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": at,
                                       "lastHeartbeatTime": at}]}}


def test_times_and_durations_read_at_a_glance():
    assert utc(T0) == "2026-12-01 09:26:51 UTC" and utc(None) == "-"


def test_a_boot_is_told_by_its_phases_as_the_tracker_saw_them():
    baseline = BootBaseline("gpu-1", T0, "old", 1, resource_version_before="8")
    stale = iso(T0 - 600)
    boot = ((T0 + 1, node("old", "True", "1", stale)),              # stale: before the boot
            (T0 + 3.1, node("new", "False", "1", iso(T0 + 3))),     # the new boot writes
            (T0 + 7.1, node("new", "True", "0", iso(T0 + 7))),      # Ready, count reset
            (T0 + 12.2, node("new", "True", "1", iso(T0 + 7))),     # GPUs registered
            (T0 + 17.2, node("new", "True", "1", iso(T0 + 7))))     # held since (the fallback's window)
    fast, fallback = BootClock(T0), BootClock(T0)
    seen = ReadinessTracker(baseline, settle_seconds=5, continuous=True)
    missed = ReadinessTracker(baseline, settle_seconds=5, fallback_seconds=5, continuous=False)
    for at, state in boot:
        fast.observe(seen.observe(state, at), at)
        if state["status"]["allocatable"]["nvidia.com/gpu"] != "0":      # a re-list that missed the reset
            fallback.observe(missed.observe(state, at), at)
    # the reset seen: it fires as the GPUs register; not seen: once the count held for the window
    assert boot_summary("gpu-1", fast) == "booted gpu-1 in 12.2 s (instance up 3.1 s, kubelet Ready 4.0 s, GPUs registered 5.1 s)"
    assert boot_summary("gpu-1", fallback) == ("booted gpu-1 in 17.2 s (instance up 3.1 s, kubelet Ready 9.1 s, "
                                               "GPUs registered 0.0 s, settled 5.0 s)")     # Ready and GPUs seen at once
    assert BootClock.from_json(fast.to_json()).marks == fast.marks
    # the GPU count's steps as the watch saw them: the stale count, the kubelet's reset, the real count
    assert fast.gpus == [[T0 + 1, 1], [T0 + 7.1, 0], [T0 + 12.2, 1]]
    assert BootClock.from_json(fast.to_json()).gpus == fast.gpus


def test_a_node_already_up_says_so():
    clock = BootClock(None)
    clock.observe(Readiness(True, (Reason(READY, "ready"),), {"fresh": True, "ready": "True", "held_seconds": 5.0}), T0)
    assert boot_summary("gpu-run", clock) == "gpu-run was already up: GPU-ready at 2026-12-01 09:26:51 UTC"


def test_the_evidence_is_a_short_aligned_block_in_human_units():
    tracker = ReadinessTracker(BootBaseline("gpu-1", T0, "old-boot-id-123456", 1, resource_version_before="8"),
                               settle_seconds=5, continuous=True)
    tracker.observe(node("new-boot-id-654321", "True", "0"), T0 + 5)
    evidence = tracker.observe(node("new-boot-id-654321", "True", "1"), T0 + 6).evidence
    block = evidence_block(evidence)
    lines = block.splitlines()
    assert len(lines) <= 10 and len({line.index(line.split()[-1]) for line in lines}) >= 1
    assert "  Ready            True since 2026-12-01 16:00:00 UTC" in lines
    assert "  nvidia.com/gpu   1 allocatable, 1 needed, reset after the start seen" in lines
    assert "  start requested  2026-12-01 09:26:51 UTC" in lines
    assert str(T0) not in block and "8589934592" not in block and "{" not in block


def test_place_and_start_summaries():
    a = Assignment("train", "gpu-1", "gpu-1", "i-1", NodeState.STOPPED,
                   Resources({"nvidia.com/gpu": 2, "cpu": 2000, "memory": 8 * 2 ** 30}))
    plan = Plan("job", Outcome.FITS, "fits", (a,), ("gpu-1",))
    assert place_summary("train", plan, 0.42) == ("placed train in 0.4 s: train on gpu-1 (stopped) with cpu=2 "
                                                  "memory=8Gi nvidia.com/gpu=2; to start: gpu-1")
    assert start_summary([{"node": "gpu-1", "start_requested_at": T0}, {"node": "gpu-run"}], ["i-1"], 0.3) == (
        "start requested for gpu-1 at 2026-12-01 09:26:51 UTC; already up: gpu-run "
        "(1 StartInstances accepted in this try, 0.3 s)")


def test_the_triggerer_logs_an_event_as_its_summary_not_its_payload():
    from gpuboot.triggers.events import ShortEvent

    payload = {"status": "ready", "summary": "booted gpu-1 in 17.2 s", "echo": {"plan": {"memory": 8589934592}}}
    event = ShortEvent(payload)
    assert repr(event) == str(event) == "TriggerEvent<ready: booted gpu-1 in 17.2 s>"
    assert event.payload == payload

"""The boot fall-back (gpuboot.lifecycle.boot.JobBoot) on in-memory fakes of Kubernetes and ECS: capacity
errors re-placed within the same call, boot timeouts failed over, abandoned nodes stopped again
unless another job claims them, the release of a run that failed before its launch. The ledger
is the real one on the fake's ConfigMap; the clock is fixed, nothing sleeps.
tests/integration/test_resilience.py runs the same paths through the operators on the
local cloud."""
from __future__ import annotations

import logging

import pytest

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import Unavailable
from gpuboot.core.placement import Plan
from gpuboot.lifecycle.booking import FENCE_REASON, Booker
from gpuboot.lifecycle.boot import (
    DEFAULT_UNAVAILABLE_TTL_SECONDS,
    BootError,
    CapacityBusy,
    CapacityUnavailable,
    JobBoot,
    wait_deadline,
)
from tests.builders import instance_id, pod
from tests.fakes import T4, T4X2, ZONE, Cloud, cloud

LOG = logging.getLogger("test-boot")
SPEC = JobSpec.from_dict({"name": "train", "image": "python:3.11", "command": ["true"], "gpus": 1, "cpu": "1",
                          "memory": "1Gi", "boot_timeout_seconds": 300})
RUN, STOP, STOP2 = instance_id("gpu-run"), instance_id("gpu-stop"), instance_id("gpu2-stop")


def job(c: Cloud, job_id: str = "job", **kwargs) -> JobBoot:
    return JobBoot(c.cluster, c.ecs, c.ledger(), LOG, spec=SPEC, job_id=job_id, clock=c.clock, **kwargs)


def reserve(c: Cloud, job_id: str) -> list[str]:
    """Place and reserve another job (no start): the nodes it holds."""
    plan = Booker(c.cluster, c.ecs, c.ledger(), LOG, clock=c.clock).book(SPEC, job_id).plan
    return [a.node for a in plan.assignments]


def nodes(plan: Plan) -> list[str]:
    return [a.node for a in plan.assignments]


def held(c: Cloud, job_id: str) -> list[str]:
    return sorted(r.node for r in c.ledger().snapshot().held(job_id, c.clock()))


def marks(c: Cloud) -> list[Unavailable]:
    return c.ledger().snapshot().live_unavailable(c.clock())


def booted_job(c: Cloud, **kwargs):
    """The running 1-GPU node taken by a hog, "job" placed on stopped gpu-stop and started there."""
    assert reserve(c, "hog") == ["gpu-run"]
    boot = job(c, **kwargs)
    up = boot.bring_up(boot.rebook())
    assert nodes(up.plan) == ["gpu-stop"] and up.started == [STOP] and c.ecs.status(STOP) == "Starting"
    return boot, up


# -- capacity fall-back --------------------------------------------------------------------------
def test_no_stock_marks_the_offering_and_re_places_onto_another_node_within_the_same_call():
    c = cloud()
    assert reserve(c, "hog") == ["gpu-run"]
    boot = job(c)
    plan = boot.rebook()
    assert plan.nodes_to_start == ("gpu-stop",)                   # the 1-GPU node wastes least
    c.ecs.no_stock = {T4}

    up = boot.bring_up(plan)

    assert nodes(up.plan) == ["gpu2-stop"] and up.started == [STOP2]
    assert [b["node"] for b in up.baselines] == ["gpu2-stop"]
    assert c.ecs.calls_to("start") == [(STOP,), (STOP2,)]
    assert c.ecs.status(STOP) == "Stopped" and c.ecs.status(STOP2) == "Starting"
    (mark,) = marks(c)
    assert (mark.node, mark.instance_type, mark.zone) == (None, T4, ZONE)
    assert mark.reason == f"OperationDenied.NoStock starting {STOP}"
    assert mark.expires_at == c.clock() + DEFAULT_UNAVAILABLE_TTL_SECONDS
    assert up.tried == [f"offering {T4} in {ZONE}: OperationDenied.NoStock starting {STOP}"]
    assert held(c, "job") == ["gpu2-stop"] and held(c, "hog") == ["gpu-run"]   # the move took the old one
    record = c.ledger().snapshot().record("job", c.clock())
    assert [s.node for s in record.started] == ["gpu2-stop"]        # gpu-stop never started: let go
    c.ecs.no_stock = set()                  # stock is back, but the shared mark stands until it expires
    assert reserve(c, "second") == ["gpu2-stop"]                    # not gpu-stop, which wastes less


def test_when_no_offering_has_stock_the_job_holds_nothing_and_names_each_one():
    c = cloud()
    assert reserve(c, "hog") == ["gpu-run"]
    boot = job(c)
    plan = boot.rebook()
    c.ecs.no_stock = {T4, T4X2}
    with pytest.raises(CapacityBusy) as err:                        # the rest (gpu-run) is only busy
        boot.bring_up(plan)
    assert err.value.tried == [f"offering {T4} in {ZONE}: OperationDenied.NoStock starting {STOP}",
                               f"offering {T4X2} in {ZONE}: OperationDenied.NoStock starting {STOP2}"]
    assert held(c, "job") == [] and held(c, "hog") == ["gpu-run"]
    assert c.ecs.status(STOP) == c.ecs.status(STOP2) == "Stopped"


def test_capacity_attempts_are_bounded():
    c = cloud()
    assert reserve(c, "hog") == ["gpu-run"]
    boot = job(c, max_attempts=1)
    plan = boot.rebook()
    c.ecs.no_stock = {T4}
    with pytest.raises(CapacityUnavailable, match=r"gave up after 1 failure\(s\) \(max_attempts=1\)"):
        boot.bring_up(plan)
    assert held(c, "job") == [] and c.ecs.calls_to("start") == [(STOP,)]


def test_a_hard_start_error_is_no_capacity_error():
    c = cloud()
    assert reserve(c, "hog") == ["gpu-run"]
    boot = job(c)
    plan = boot.rebook()
    c.ecs.start_errors[STOP] = "InvalidAccountStatus.NotEnoughBalance"
    with pytest.raises(BootError, match=r"InvalidAccountStatus.NotEnoughBalance"):
        boot.bring_up(plan)
    assert marks(c) == [] and held(c, "job") == ["gpu-stop"]       # no re-placement: the step fails


def test_an_instance_caught_stopping_is_started_once_stopped():
    c = cloud({"gpu-a": ("Stopping", T4)})
    boot = job(c)
    plan = boot.rebook()
    assert plan.assignments[0].state.value == "stopping" and plan.nodes_to_start == ("gpu-a",)
    up = boot.bring_up(plan)
    iid = instance_id("gpu-a")
    assert up.started == [iid] and c.ecs.calls == [("start", (iid,)), ("wait", (iid,)), ("start", (iid,))]
    assert c.ecs.status(iid) == "Starting"


def test_a_start_retry_starts_nothing_twice_and_keeps_the_first_start_as_the_baseline():
    c = cloud()
    _boot, up = booted_job(c)
    c.clock.advance(30)
    again = job(c).ensure_up(up.plan)                               # a retry of the start step
    assert again.started == [] and c.ecs.calls_to("start")[-1] == (STOP,)
    assert again.baselines[0]["start_requested_at"] == up.baselines[0]["start_requested_at"] == c.clock() - 30


def test_a_start_known_only_to_the_minute_counts_the_boot_timeout_from_the_latest_it_can_have_been():
    """A node another job started: ECS's StartTime says the minute (floored), so the start is taken as
    then (every Ready after it counts) but the boot timeout runs from the latest the start can have been,
    or a job adopting a node booted 45 s into a minute lost 45 s of its timeout."""
    c = cloud()
    assert c.clock() % 60 == 0
    _boot, up = booted_job(c)                                       # started on the minute ...
    c.clock.advance(45)
    as_seen = up.plan.to_json()
    as_seen.update(assignments=[{**a, "state": "booting"} for a in as_seen["assignments"]], nodes_to_start=[])
    adopting = Plan.from_json(as_seen)         # ... placed 45 s later by a job that sees it booting
    baseline = job(c, job_id="other").bring_up(adopting).baselines[0]
    assert baseline["start_requested_at"] == c.clock() - 45 and baseline["start_window_seconds"] == 45
    assert wait_deadline(baseline, 300, 5, c.clock()) == c.clock() - 45 + 45 + 300
    c.clock.advance(120)                                            # a start seen minutes later: at most a minute
    assert job(c, job_id="third").bring_up(adopting).baselines[0]["start_window_seconds"] == 60
    assert "start_window_seconds" not in up.baselines[0]           # its own start: known to the second


# -- boot timeout ------------------------------------------------------------------------------
@pytest.mark.parametrize("conflicts", [0, 4], ids=["quiet-ledger", "contended-ledger"])
def test_a_node_not_gpu_ready_by_its_boot_timeout_is_stopped_again_and_the_job_moves(conflicts):
    c = cloud()
    boot, up = booted_job(c)
    c.clock.advance(SPEC.boot_timeout_seconds)
    c.cluster.conflict_next_writes(conflicts)              # other writers win the fail-over's first commits
    why = "not GPU-ready within 300s"
    evidence = {"gpu-stop": {**up.baselines[0], "boot_id": "boot-2", "ready": "False"}}

    moved = boot.fail_over(up.plan, {"gpu-stop": why}, up.tried, evidence)

    assert nodes(moved.plan) == ["gpu2-stop"] and moved.started == [STOP2]
    assert moved.tried == [f"node gpu-stop: {why}"]
    # gpu-stop was still Starting: waited for Running (ECS refuses to stop it before), then stopped
    assert [call for call in c.ecs.calls if STOP in call[1]] == [("start", (STOP,)), ("wait", (STOP,)),
                                                                  ("stop", (STOP,))]
    assert c.ecs.status(STOP) == "Stopping" and c.ecs.status(STOP2) == "Starting"
    state = c.ledger().snapshot()
    record = state.record("job", c.clock())
    assert record.failed == (("gpu-stop", why),)                    # the job's own verdict
    assert [s.node for s in record.started] == ["gpu2-stop"]
    (mark,) = state.live_unavailable(c.clock())                    # for everyone, with the failed boot
    assert (mark.node, mark.boot_id, mark.reason) == ("gpu-stop", "boot-2", why)
    assert not any(m.reason.startswith(FENCE_REASON) for m in state.unavailable)
    assert held(c, "job") == ["gpu2-stop"]


def test_the_job_never_goes_back_to_a_node_that_failed_for_it():
    c = cloud()
    boot, up = booted_job(c)
    boot.fail_over(up.plan, {"gpu-stop": "not GPU-ready"}, up.tried, {})
    assert reserve(c, "other") == ["gpu2-stop"]                      # the mark keeps everyone off gpu-stop
    c.clock.advance(DEFAULT_UNAVAILABLE_TTL_SECONDS + 1)
    assert marks(c) == []                                            # until it expires
    assert nodes(boot.rebook()) == ["gpu2-stop"]                     # this job's own verdict stays
    assert reserve(c, "third") == ["gpu-stop"]                       # another job may use it again


def test_a_node_that_was_up_when_chosen_fails_only_for_this_job():
    c = cloud()
    boot = job(c)
    up = boot.bring_up(boot.rebook())
    assert nodes(up.plan) == ["gpu-run"] and up.started == [] and up.baselines[0]["start_requested_at"] is None
    moved = boot.fail_over(up.plan, {"gpu-run": "GPUs not registered"}, up.tried, {"gpu-run": up.baselines[0]})
    assert nodes(moved.plan) == ["gpu-stop"] and marks(c) == []
    assert c.ecs.calls_to("stop") == [] and c.ecs.status(RUN) == "Running"     # not this job's to stop


def test_boot_attempts_are_bounded_and_the_last_failure_leaves_nothing_behind():
    c = cloud()
    boot, up = booted_job(c, max_attempts=2)
    moved = boot.fail_over(up.plan, {"gpu-stop": "not GPU-ready"}, up.tried, {})
    with pytest.raises(CapacityUnavailable) as err:
        boot.fail_over(moved.plan, {"gpu2-stop": "not GPU-ready"}, moved.tried, {})
    assert "gave up after 2 failure(s) (max_attempts=2)" in str(err.value)
    assert "node gpu-stop: not GPU-ready; node gpu2-stop: not GPU-ready" in str(err.value)
    assert held(c, "job") == [] and c.ecs.calls_to("stop") == [(STOP,), (STOP2,)]
    assert c.ledger().snapshot().record("job", c.clock()).started == ()


# -- claimed nodes and the release ----------------------------------------------------------------
def test_a_node_another_job_claims_is_kept_running_when_the_job_fails_over(caplog):
    """Jobs a and b share the 2-GPU node; a gives up on it, b still holds it: it keeps running."""
    c = cloud()
    assert reserve(c, "hog") == ["gpu-run"] and reserve(c, "hog2") == ["gpu-stop"]
    a = job(c, "a", max_attempts=1)
    plan = a.rebook()
    assert nodes(plan) == ["gpu2-stop"] and reserve(c, "b") == ["gpu2-stop"]
    up = a.bring_up(plan)
    assert up.started == [STOP2]
    with caplog.at_level(logging.INFO, logger=LOG.name), pytest.raises(CapacityUnavailable, match="gave up"):
        a.fail_over(up.plan, {"gpu2-stop": "not GPU-ready"}, up.tried, {})
    assert "not stopping it, another job claims it: reserved by job b" in caplog.text
    assert c.ecs.calls_to("stop") == [] and c.ecs.status(STOP2) == "Starting"
    assert held(c, "a") == [] and held(c, "b") == ["gpu2-stop"]


def test_release_after_a_failure_before_launch_stops_the_node_the_job_started():
    c = cloud()
    boot, _up = booted_job(c)
    c.ecs.settle()                                                 # Running, never launched on
    released = boot.finish()
    assert [r.node for r in released] == ["gpu-stop"]
    assert c.ecs.calls_to("stop") == [(STOP,)] and c.ecs.status(STOP) == "Stopping"
    state = c.ledger().snapshot()
    assert [r.job_id for r in state.reservations] == ["hog"] and state.jobs == () and state.unavailable == ()


def test_release_keeps_running_a_node_the_job_ran_on_or_another_job_claims():
    c = cloud()
    boot, _ = booted_job(c)
    c.ecs.settle()
    boot.finish(used={"gpu-stop"})                                  # its pod ran there: idle scale-down's
    assert c.ecs.calls_to("stop") == [] and c.ecs.status(STOP) == "Running"
    assert c.ledger().snapshot().jobs == ()

    c = cloud()
    boot, _up = booted_job(c)
    c.ecs.settle()
    c.cluster.add_pod(pod("other", "gpu-stop", requests={"cpu": "1"}))  # a workload pod of someone else
    boot.finish()
    assert c.ecs.calls_to("stop") == [] and c.ecs.status(STOP) == "Running"

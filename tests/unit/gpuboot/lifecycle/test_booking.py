"""The booking transaction (gpuboot.lifecycle.booking.Booker) on in-memory fakes of Kubernetes and ECS:
read the ledger, survey, place, commit with compare-and-swap, re-place on a conflict. The ledger
is the real one, on the fake's ConfigMap; no process, no socket, no sleep (a fixed clock).
tests/integration/test_ledger.py races the same transaction on the local cloud."""
from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import Unavailable
from gpuboot.core.placement import Outcome
from gpuboot.lifecycle.booking import FENCE_REASON, Booker, LedgerContended
from gpuboot.lifecycle.ledger import StartedNode
from tests.builders import instance_id, node
from tests.fakes import T4, Cloud, cloud

LOG = logging.getLogger("test-booking")
SPEC = JobSpec.from_dict({"name": "train", "image": "python:3.11", "command": ["true"], "gpus": 1, "cpu": "1",
                          "memory": "1Gi", "boot_timeout_seconds": 300})


def booker(c: Cloud, **kwargs) -> Booker:
    """One worker's booker: its own ledger client on the shared fake cluster."""
    return Booker(c.cluster, c.ecs, c.ledger(), LOG, clock=c.clock, **kwargs)


def held(c: Cloud) -> dict[str, list[str]]:
    """job -> nodes it holds, from the ledger as stored."""
    out: dict[str, list[str]] = {}
    for r in c.ledger().snapshot().reservations:
        out.setdefault(r.job_id, []).append(r.node)
    return out


def test_a_commit_that_meets_conflicts_is_re_placed_and_holds_exactly_one_reservation():
    c = cloud()
    booker(c).book(SPEC, "hog")                       # the ledger exists: the conflicts move its version
    c.cluster.conflict_next_writes(3)
    booking = booker(c).book(SPEC, "job")
    assert booking.committed and booking.plan.outcome == Outcome.FITS
    assert held(c) == {"hog": ["gpu-run"], "job": ["gpu-stop"]}
    assert c.cluster.refused == 3 and c.cluster.writes == 3   # the root's creation, hog's commit, the fourth try


def test_the_first_commit_creates_the_ledger_through_conflicts_too():
    c = cloud()
    c.cluster.conflict_next_writes(2)
    assert booker(c).book(SPEC, "job").committed
    assert held(c) == {"job": ["gpu-run"]}


def test_a_ledger_contended_past_the_attempt_bound_fails_and_writes_nothing():
    c = cloud()
    c.cluster.conflict_next_writes(3)
    with pytest.raises(LedgerContended, match="3 attempts"):
        booker(c, max_commit_attempts=3).book(SPEC, "job")
    assert held(c) == {} and c.cluster.writes == 0


def test_two_bookers_racing_for_one_node_never_both_get_it():
    """B's whole transaction runs between A's read and A's write: A's write is refused, A reads
    again, sees B's reservation and finds the one node busy."""
    c = cloud({"gpu-run": ("Running", T4)})
    b_result = []
    c.cluster.before_next_write(lambda: b_result.append(booker(c).book(SPEC, "b")))
    a = booker(c).book(SPEC, "a")
    (b,) = b_result
    assert b.committed and [x.node for x in b.plan.assignments] == ["gpu-run"]
    assert not a.committed and a.plan.outcome == Outcome.BUSY
    assert held(c) == {"b": ["gpu-run"]} and c.cluster.refused == 1


def test_the_booker_that_loses_the_race_is_placed_on_what_is_left():
    c = cloud()
    c.cluster.before_next_write(lambda: booker(c).book(SPEC, "b"))
    a = booker(c).book(SPEC, "a")
    assert a.committed and a.plan.nodes_to_start == ("gpu-stop",)       # re-placed after the refusal
    assert held(c) == {"a": ["gpu-stop"], "b": ["gpu-run"]}


def test_many_bookers_at_once_never_promise_a_gpu_twice():
    """8 one-GPU jobs on 8 threads for the fleet's 4 GPUs (1 running, 1 + 2 stopped), with conflicts."""
    c = cloud()
    c.cluster.conflict_next_writes(5)
    barrier = threading.Barrier(8)
    jobs = [f"job-{i}" for i in range(8)]

    def run(job: str) -> Outcome:
        mine = booker(c)
        barrier.wait()
        return mine.book(SPEC, job).plan.outcome

    with ThreadPoolExecutor(len(jobs)) as pool:          # an error in a thread is raised here
        outcomes = dict(zip(jobs, pool.map(run, jobs)))
    assert Counter(outcomes.values()) == {Outcome.FITS: 4, Outcome.BUSY: 4}
    state = c.ledger().snapshot()
    assert sorted(r.job_id for r in state.reservations) == sorted(j for j, o in outcomes.items() if o == Outcome.FITS)
    assert Counter(r.node for r in state.reservations) == {"gpu-run": 1, "gpu-stop": 1, "gpu2-stop": 2}  # 1 GPU each


def test_a_job_that_does_not_fit_writes_nothing_unless_it_releases():
    c = cloud({"gpu-run": ("Running", T4)})
    booker(c).book(SPEC, "hog")
    writes = c.cluster.writes
    assert booker(c).book(SPEC, "job").plan.outcome == Outcome.BUSY
    assert c.cluster.writes == writes
    mark = Unavailable(reason="test", expires_at=c.clock() + 60, instance_type=T4, zone="z")
    released = booker(c).book(SPEC, "job", marks=[mark], release_unplaced=True)
    assert released.committed and released.plan.outcome == Outcome.BUSY
    assert c.ledger().snapshot().unavailable == (mark,)                 # the marks are kept either way


def test_a_node_the_job_started_and_leaves_is_fenced_in_that_commit_then_stopped_and_unfenced():
    c = cloud()
    ledger = c.ledger()
    assert booker(c).book(SPEC, "job").plan.assignments[0].node == "gpu-run"
    iid = instance_id("gpu-stop")
    ledger.record_starts("job", [StartedNode("gpu-stop", iid, c.clock())], c.clock() + 600)
    c.ecs.instances[iid]["Status"] = "Running"                     # the job started it (an earlier try)
    fenced = []                                                    # fences in the ledger when ECS is asked to stop
    c.ecs.on_call(lambda action, ids: fenced.extend(
        m.node for m in c.ledger().snapshot().unavailable if action == "stop" and m.reason.startswith(FENCE_REASON)))
    booking = booker(c).book(SPEC, "job", release_unplaced=True)       # re-placed: still on gpu-run
    assert booking.committed and fenced == ["gpu-stop"]
    assert c.ecs.status(iid) == "Stopping" and c.ecs.instances[iid]["StoppedMode"] == "StopCharging"
    state = c.ledger().snapshot()
    assert state.unavailable == () and state.record("job", c.clock()).started == ()


def test_a_boot_failure_mark_goes_once_the_node_is_ready_with_its_gpus():
    c = cloud({"gpu-run": ("Running", T4)})
    ledger = c.ledger()
    booker(c).book(None, "gave-up", marks=[Unavailable(reason="not GPU-ready in time", expires_at=c.clock() + 600,
                                                       node="gpu-run", boot_id="boot-1")],
                   release_unplaced=True, place_job=False)            # marked as a job giving up marks it
    c.cluster.put_node(node("gpu-run", ready="False", labels={"gpuboot.io/managed": "true"}))
    assert booker(c).book(SPEC, "job").plan.outcome == Outcome.BUSY    # the only node is marked and down
    assert len(ledger.snapshot().unavailable) == 1
    c.cluster.put_node(node("gpu-run", labels={"gpuboot.io/managed": "true"}))       # Ready, 1 GPU
    booking = booker(c).book(SPEC, "job")
    assert booking.committed and [a.node for a in booking.plan.assignments] == ["gpu-run"]
    assert ledger.snapshot().unavailable == ()

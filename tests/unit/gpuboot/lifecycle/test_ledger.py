"""The ledger's pure rules (issue 9, defects 2-4, 8): how long a reservation lives, until when a
node is waited for, which boot-failure marks still stand, the job record, the failure hints.
The ledger's compare-and-swap runs against an in-memory ConfigMap here (tests/fakes.py,
behind gpuboot.core.ports.ConfigMapStore); tests/integration/test_ledger.py races it on the local cloud."""
from __future__ import annotations

import threading

import pytest

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import NodeState, NodeView, Reservation, Unavailable
from gpuboot.core.resources import Resources
from gpuboot.lifecycle.booking import LAUNCH_MARGIN_SECONDS, outdated_marks, reservation_ttl
from gpuboot.lifecycle.boot import ALREADY_UP_GRACE_SECONDS, wait_deadline
from gpuboot.lifecycle.ledger import JobRecord, ReservationLedger, StartedNode
from gpuboot.sensors.gpu_ready import where_to_look
from tests.fakes import FakeCluster
from tests.shared import run_threads

BASE = {"name": "t", "image": "i", "command": ["true"]}


@pytest.mark.parametrize("ttl, boot, expected", [
    (None, 900, 900 + LAUNCH_MARGIN_SECONDS),
    (1, 60, 60 + LAUNCH_MARGIN_SECONDS),          # a user TTL never undercuts what the run needs
    (7200, 60, 7200),                             # but may lengthen it
])
def test_reservation_ttl_is_never_shorter_than_boot_timeout_plus_launch(ttl, boot, expected):
    spec = JobSpec.from_dict({**BASE, "boot_timeout_seconds": boot,
                              **({"reservation_ttl_seconds": ttl} if ttl else {})})
    assert reservation_ttl(spec) == expected


def test_wait_deadline_counts_a_boot_from_its_first_start_and_spares_a_node_already_up():
    assert wait_deadline({"start_requested_at": 1000.0}, 30, 5, now=1010) == 1030      # not restarted by a retry
    assert wait_deadline({"start_requested_at": 1000.0}, 30, 5, now=2000) == 2006      # late: one settle window
    assert wait_deadline({"start_requested_at": None}, 1, 5, now=0) == 5 + ALREADY_UP_GRACE_SECONDS


def view(name: str, state: NodeState) -> NodeView:
    return NodeView(name=name, hostname=name, state=state, reason="", allocatable=Resources(), allocated=Resources())


def node(name: str, boot_id: str) -> dict:
    return {"metadata": {"name": name}, "status": {"nodeInfo": {"bootID": boot_id}}}


def test_only_boot_failure_marks_whose_evidence_is_gone_are_outdated():
    m = lambda n, b: Unavailable(reason="r", expires_at=9e9, node=n, boot_id=b)  # noqa: E731
    ready_now, rebooted, still_bad, no_boot_seen = m("a", "b1"), m("b", "b1"), m("c", "b1"), m("d", "")
    fence = Unavailable(reason="being stopped", expires_at=9e9, node="a")          # no evidence: kept
    offering = Unavailable(reason="NoStock", expires_at=9e9, instance_type="t", zone="z")
    marks = [ready_now, rebooted, still_bad, no_boot_seen, fence, offering]
    nodes = [node("a", "b1"), node("b", "b2"), node("c", "b1"), node("d", "b9")]
    views = [view("a", NodeState.READY), view("b", NodeState.STOPPED), view("c", NodeState.BOOTING),
             view("d", NodeState.STOPPED)]
    assert outdated_marks(marks, nodes, views) == [ready_now, rebooted]


def test_a_job_record_keeps_the_first_start_of_a_node_and_round_trips():
    first, again = StartedNode("n", "i-1", 10.0, "b0"), StartedNode("n", "i-1", 20.0, "b1")
    rec = JobRecord("j", 99.0).with_started([first]).with_started([again, StartedNode("m", "i-2", 30.0)])
    rec = rec.with_failed({"n": "timeout"})
    assert rec.started_on("n") == first and rec.failed_nodes == {"n": "timeout"}
    assert JobRecord.from_json(rec.to_json()) == rec


def test_where_to_look_names_the_kubelet_or_the_device_plugin():
    assert "kubelet on n never reported Ready" in where_to_look("n", {"ready": "Unknown", "fresh": False})
    hint = where_to_look("n", {"ready": "True", "fresh": True, "gpus_needed": 2, "gpus_allocatable": 0})
    assert "device plugin never registered" in hint and "spec.nodeName=n" in hint


def test_renewals_and_start_records_of_many_jobs_at_once_lose_no_write():
    ledger = ReservationLedger(FakeCluster(), clock=lambda: 1000.0)
    gpu = Resources.parse({"nvidia.com/gpu": 1})
    jobs = [f"j{i}" for i in range(12)]
    for j in jobs:
        state = ledger.snapshot()
        ledger.commit(j, [Reservation(j, "t", f"n-{j}", gpu, 2000.0)], state.version)
    barrier = threading.Barrier(len(jobs) * 2)
    errors = []

    def renew(j):
        try:
            barrier.wait()
            ledger.renew(j, 5000.0)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def record(j):
        try:
            barrier.wait()
            ledger.record_starts(j, [StartedNode(f"n-{j}", f"i-{j}", 1000.0)], 3000.0)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=f, args=(j,)) for j in jobs for f in (renew, record)]
    run_threads(threads, 30)
    assert not errors, errors
    state = ledger.snapshot()
    assert {r.job_id: r.expires_at for r in state.reservations} == dict.fromkeys(jobs, 5000.0)
    assert {j.job_id: j.started[0].instance_id for j in state.jobs} == {j: f"i-{j}" for j in jobs}
    # a record lasts as long as what the job holds, whichever write came first
    assert all(rec.expires_at == 5000.0 for rec in state.jobs)
    assert ledger.renew("j0", 10.0)[0].expires_at == 5000.0          # never shortens

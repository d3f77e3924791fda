"""The reservation ledger on the local Kubernetes API: compare-and-swap, expiry, and
concurrent placements that never promise the same GPU twice."""
from __future__ import annotations

import threading
from collections import Counter

import pytest

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import Reservation
from gpuboot.core.placement import Outcome
from gpuboot.core.resources import Resources
from gpuboot.exceptions import LedgerContended
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.ledger import LedgerConflict, ReservationLedger
from gpuboot.operators.place import PlaceGpuJobOperator
from tests.shared import run_threads

ONE_GPU = Resources.parse({"nvidia.com/gpu": 1, "cpu": "1"})


def reservation(job: str, node: str, expires_at: float = 4e9) -> Reservation:
    return Reservation(job_id=job, task=f"{job}-t", node=node, resources=ONE_GPU, expires_at=expires_at)


def test_commit_is_compare_and_swap_and_release_is_idempotent(cloud):
    ledger = ReservationLedger(KubeClient())
    entries, version = ledger.read()
    assert entries == [] and version is None
    ledger.commit("a", [reservation("a", "gpu-run")], version)
    with pytest.raises(LedgerConflict):                       # placed on a stale read
        ledger.commit("b", [reservation("b", "gpu-run")], version)
    entries, version = ledger.read()
    ledger.commit("b", [reservation("b", "gpu-stop")], version)
    assert sorted(r.job_id for r in ledger.live()) == ["a", "b"]
    assert [r.node for r in ledger.release("a")] == ["gpu-run"]
    assert ledger.release("a") == []
    assert [r.job_id for r in ledger.live()] == ["b"]


def test_expired_entries_do_not_count_and_are_pruned_on_write(cloud):
    ledger = ReservationLedger(KubeClient())
    ledger.commit("old", [reservation("old", "gpu-run", expires_at=1.0)], None)
    assert ledger.live() == []
    _, version = ledger.read()
    ledger.commit("new", [reservation("new", "gpu-stop")], version)
    assert [r.job_id for r in ledger.read()[0]] == ["new"]


@pytest.mark.simcloud_only(reason="injects 409 bursts (k8s_conflict_burst), a fault of simcloud's own API server")
def test_release_retries_through_409_bursts(cloud):
    ledger = ReservationLedger(KubeClient())
    ledger.commit("a", [reservation("a", "gpu-run")], None)
    cloud.set_faults(k8s_conflict_burst=3)
    assert len(ledger.release("a")) == 1
    assert ledger.live() == []


def test_concurrent_placements_never_promise_a_gpu_twice(cloud):
    """10 one-GPU jobs race for the fleet's 4 GPUs (1 running, 1 + 2 stopped) through the
    operator's real read -> place -> commit loop, with 409 bursts injected (on the real API server,
    the 409s are the race's own)."""
    if cloud.kube == "simcloud":
        cloud.set_faults(k8s_conflict_burst=6)
    spec = JobSpec.from_dict({"name": "race", "image": "python:3.11", "command": ["true"], "gpus": 1,
                              "cpu": "1", "memory": "1Gi"})
    outcomes: dict[str, Outcome] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(10)

    def run(i: int) -> None:
        try:
            op = PlaceGpuJobOperator(task_id=f"place_{i}", job=spec.to_dict())
            barrier.wait()
            outcomes[f"job-{i}"] = op.place_and_reserve(spec, f"job-{i}").outcome
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    run_threads(threads, 120)
    assert not errors, errors
    assert Counter(outcomes.values()) == {Outcome.FITS: 4, Outcome.BUSY: 6}
    live = ReservationLedger(KubeClient()).live()
    assert sorted(r.job_id for r in live) == sorted(j for j, o in outcomes.items() if o == Outcome.FITS)
    gpus_promised = Counter()
    for r in live:
        gpus_promised[r.node] += r.resources.gpus
    assert gpus_promised == {"gpu-run": 1, "gpu-stop": 1, "gpu2-stop": 2}


def test_placements_renewals_start_records_and_marks_race_without_a_lost_write(cloud):
    """On the local API server with 409 bursts: 4 jobs placing, 4 renewing what they hold, 4
    recording starts and 4 marking offerings, all at once. Every write lands, and no GPU is
    promised twice."""
    from gpuboot.core.model import Unavailable
    from gpuboot.lifecycle.ledger import StartedNode
    from tests.integration.test_resilience import mark

    ledger = ReservationLedger(KubeClient())
    holders = [f"holder-{i}" for i in range(4)]
    for i, job in enumerate(holders):
        _, version = ledger.read()
        ledger.commit(job, [reservation(job, f"fake-{i}", expires_at=4e9 - 10)], version)
    if cloud.kube == "simcloud":     # on the real API server, the 409s are the race's own
        cloud.set_faults(k8s_conflict_burst=6)
    spec = JobSpec.from_dict({"name": "race", "image": "python:3.11", "command": ["true"], "gpus": 1,
                              "cpu": "1", "memory": "1Gi"})
    barrier = threading.Barrier(16)
    errors: list[BaseException] = []
    deferred: list[LedgerContended] = []     # a place step's deferrals, nothing held (the 409 burst can cause one)
    outcomes: dict[str, Outcome] = {}

    def actor(kind: str, i: int) -> None:
        try:
            op = PlaceGpuJobOperator(task_id=f"place_{i}", job=spec.to_dict())
            barrier.wait()
            if kind == "place":
                for _ in range(3):      # a step that cannot even queue (its patches met the 409 burst) defers,
                    try:                # holding nothing, and places again: what its WakeUpTrigger does
                        outcomes[f"job-{i}"] = op.place_and_reserve(spec, f"job-{i}").outcome
                        break
                    except LedgerContended as exc:
                        deferred.append(exc)
            elif kind == "renew":
                ReservationLedger(KubeClient()).renew(holders[i], 4e9)
            elif kind == "record":
                ReservationLedger(KubeClient()).record_starts(f"starter-{i}", [StartedNode(f"n{i}", f"i-{i}", 1.0)],
                                                              4e9)
            else:
                mark(Unavailable(reason="NoStock", expires_at=4e9, instance_type=f"type-{i}", zone="z"),
                     job_id=f"marker-{i}")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=actor, args=(kind, i)) for kind in ("place", "renew", "record", "mark")
               for i in range(4)]
    run_threads(threads, 120)
    assert not errors, errors
    state = ledger.snapshot()
    assert {r.job_id: r.expires_at for r in state.reservations if r.job_id in holders} == dict.fromkeys(holders, 4e9)
    assert sorted(j.job_id for j in state.jobs) == [f"starter-{i}" for i in range(4)]
    assert {m.instance_type for m in state.unavailable} == {f"type-{i}" for i in range(4)}
    assert Counter(outcomes.values()) == {Outcome.FITS: 4}, deferred
    promised = Counter()
    for r in state.reservations:
        if r.job_id.startswith("job-"):
            promised[r.node] += r.resources.gpus
    assert promised == {"gpu-run": 1, "gpu-stop": 1, "gpu2-stop": 2}

"""The job queue on the local Kubernetes API: the place step's turn through the real operator and
clients (an older waiter goes before a newcomer), and many writers enqueuing and releasing at once."""
from __future__ import annotations

import threading

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.placement import Outcome
from gpuboot.core.queue import Entry
from gpuboot.core.resources import GPU, Resources
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.jobqueue import CONFIGMAP, JobQueue
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.operators.place import PlaceGpuJobOperator
from tests.shared import run_threads

SPEC = JobSpec.from_dict({"name": "q", "image": "python:3.11", "command": ["true"], "gpus": 1, "cpu": "1",
                          "memory": "1Gi"})


def place(job_id: str) -> PlaceGpuJobOperator:
    op = PlaceGpuJobOperator(task_id=f"place_{job_id}", job=SPEC.to_dict())
    op.place_and_reserve(SPEC, job_id)
    return op


def test_an_older_waiter_gets_the_freed_gpu_before_a_newcomer(cloud):
    for i in range(4):                                   # the fleet's 4 GPUs (1 running, 1 + 2 stopped)
        assert place(f"fill-{i}").turn.plan.outcome is Outcome.FITS
    older = place("older")
    assert older.turn.plan.outcome is Outcome.BUSY and older.turn.line().startswith("queue position 1 of 1")
    newcomer = place("newcomer")
    assert "queue position 2 of 2; ahead: older" in newcomer.turn.line()
    ReservationLedger(KubeClient()).release("fill-0")
    JobQueue(KubeClient()).drop("fill-0")                # what the release step does
    assert place("newcomer").turn.plan.outcome is Outcome.BUSY      # polls first, but older is owed the GPU
    assert place("older").turn.plan.outcome is Outcome.FITS
    state = JobQueue(KubeClient()).snapshot()
    assert [w.entry.job_id for w in state.waiting] == ["newcomer"]
    assert sorted(a.job_id for a in state.running) == ["fill-1", "fill-2", "fill-3", "older"]
    assert KubeClient().read_configmap("default", CONFIGMAP)["metadata"]["resourceVersion"]


def test_many_runs_enqueue_and_release_at_once_and_the_queue_loses_none(cloud):
    if cloud.kube == "simcloud":
        cloud.set_faults(k8s_conflict_burst=6)
    barrier = threading.Barrier(12)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            queue = JobQueue(KubeClient())
            barrier.wait()
            queue.enqueue(Entry(f"job-{i}", Resources({GPU: 1}), enqueued_at=float(i)))
            if i % 2:
                queue.drop(f"job-{i}")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    run_threads([threading.Thread(target=run, args=(i,)) for i in range(12)], 120)
    assert errors == []
    state = JobQueue(KubeClient()).snapshot()
    assert sorted(w.entry.job_id for w in state.waiting) == sorted(f"job-{i}" for i in range(12) if i % 2 == 0)
    assert {w.entry.job_id: w.entry.enqueued_at for w in state.waiting}["job-4"] == 4.0

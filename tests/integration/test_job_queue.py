"""The job queue on the local Kubernetes API: the place step's turn through the real operator and
clients (an older waiter goes before a newcomer), a waiter woken by a release rather than its timer,
and many writers enqueuing and releasing at once."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from airflow.sdk.exceptions import TaskDeferred

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.placement import Outcome
from gpuboot.core.queue import Entry
from gpuboot.core.resources import GPU, Resources
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.jobqueue import CONFIGMAP, JobQueue
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.operators.place import PlaceGpuJobOperator
from gpuboot.triggers.wake_up import WakeUpTrigger
from tests.builders import step_context
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
    assert "queue position 2 of 2; ahead: q (older)" in newcomer.turn.line()       # the job's name, then its id
    ReservationLedger(KubeClient()).release("fill-0")
    JobQueue(KubeClient()).drop("fill-0")                # what the release step does
    assert place("newcomer").turn.plan.outcome is Outcome.BUSY      # polls first, but older is owed the GPU
    assert place("older").turn.plan.outcome is Outcome.FITS
    state = JobQueue(KubeClient()).snapshot()
    assert [w.entry.job_id for w in state.waiting] == ["newcomer"]
    assert sorted(a.job_id for a in state.running) == ["fill-1", "fill-2", "fill-3", "older"]
    assert KubeClient().read_configmap("default", CONFIGMAP)["metadata"]["resourceVersion"]


def first_event(trigger: WakeUpTrigger) -> dict:
    async def first():
        async for event in trigger.run():
            return event.payload
    return asyncio.run(first())


def test_a_waiter_is_woken_by_a_release_not_by_its_timer_and_places_at_once(cloud):
    for i in range(4):                                   # the fleet's 4 GPUs
        assert place(f"fill-{i}").turn.plan.outcome is Outcome.FITS
    waiter, ctx = PlaceGpuJobOperator(task_id="place", job=SPEC.to_dict(), job_id="waiter",
                                      busy_poll_seconds=600), step_context()
    with pytest.raises(TaskDeferred) as deferred:
        waiter.execute(ctx)
    trigger = deferred.value.trigger
    assert isinstance(trigger, WakeUpTrigger) and trigger.changes_seen is not None
    assert trigger.moment >= time.time() + 500           # its timer is ten minutes away

    def release() -> None:                               # what fill-0's release step does
        ReservationLedger(KubeClient()).release("fill-0")
        JobQueue(KubeClient()).drop("fill-0")
        released.append(time.monotonic())

    released: list[float] = []
    releasing = threading.Thread(target=release)
    releasing.start()
    event = first_event(trigger)
    woke = time.monotonic()
    releasing.join()
    assert event["woken"] == "queue" and woke - released[0] < 2 * trigger.poll_seconds + 5, event
    assert waiter.resume(ctx, event)["outcome"] == "fits"


def test_only_a_release_wakes_the_waiters_and_a_plain_timer_ignores_the_queue(cloud):
    queue = JobQueue(KubeClient())
    seen = queue.enqueue(Entry("a", Resources({GPU: 1}))).changes
    assert queue.enqueue(Entry("a", Resources({GPU: 1}))).changes == seen          # a renewal
    assert queue.enqueue(Entry("b", Resources({GPU: 1}))).changes == seen          # an arrival
    queue.admit("a", "default", "T4", 1)
    assert queue.snapshot().changes == seen                                         # an admission
    queue.drop("a")
    assert queue.snapshot().changes == seen + 1                                     # a release
    started = time.time()
    event = first_event(WakeUpTrigger(started + 3, {"n": 1}, queue=("default", CONFIGMAP), changes_seen=seen,
                                      poll_seconds=0.5))
    assert event["woken"] == "queue" and time.time() - started < 3                  # a left after `seen`
    event = first_event(WakeUpTrigger(time.time() + 1.5, {"n": 2}))
    assert event == {"status": "wake", "echo": {"n": 2}, "woken": "timer", "summary": "woke up to try again"}


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

"""The job queue across processes (issue 32 #8), on the local Kubernetes API (and the real control
plane with --kube=real): each run's place step in a process of its own, as Airflow workers are, half
of them through one deployment's connection and half through another's, all on one queue and
one ledger.

Each process runs the place step's turn (`book_in_order`, the batch path when nobody waits) and,
while it waits, the place step's trigger (WakeUpTrigger on the queue's change counter, a short
timer behind it), until its job is admitted; then it runs (until the test lets it end) and is released as its
release step does. One waiter is killed (SIGKILL) at the front of the line: it must lose its
place within one lease and block no one after. The decisions must never disagree: one team, one
class, so the order is age only, and no two decisions (of either deployment) put two jobs in
opposite orders.
"""
from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import os
import queue as queues
import signal
import time

import pytest

from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.jobqueue import CONFIGMAP, JobQueue
from simcloud.harness import wait_until

LEASE = 15.0             # the waiters' lease here (LEASE_SECONDS in production): a killed waiter's is out in 15 s
FILLERS = 4              # the test fleet's GPUs (tests/integration/conftest.py FLEET)
WAITERS = 6
MP = mp.get_context("fork")      # the parent's imports are shared, as in a Celery prefork worker
# 11 processes each building its clients and placing, on a shared 2-core machine: minutes
pytestmark = pytest.mark.timeout(2400)


def spec(name: str):
    from gpuboot.core.jobspec import JobSpec

    return JobSpec.from_dict({"name": name, "image": "python:3.11", "command": ["true"], "gpus": 1, "cpu": "1",
                              "memory": "1Gi"})


def first_event(trigger) -> dict:
    async def first():
        async for event in trigger.run():
            return event.payload
    return asyncio.run(first())


def run_step(job: str, deployment: str, out, go, finish) -> None:
    """One run's place step, waiting as the deferred step does, then (once `finish` is set: its job's
    run) its release."""
    try:
        _run_step(job, deployment, out, go, finish)
    except BaseException as exc:          # reported to the parent, which fails the test with it
        out.put(("error", job, f"{type(exc).__name__}: {exc}"))


def _run_step(job: str, deployment: str, out, go, finish) -> None:
    from gpuboot.core.placement import Outcome
    from gpuboot.core.queue import QueueConfig
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.lifecycle.batching import book_first
    from gpuboot.lifecycle.booking import Booker
    from gpuboot.lifecycle.jobqueue import book_in_order
    from gpuboot.lifecycle.ledger import ReservationLedger
    from gpuboot.triggers.wake_up import WakeUpTrigger

    conn = f"kubernetes_{deployment}"
    kube = KubeClient(conn)
    booker = Booker(kube, EcsHook(), ReservationLedger(kube), logging.getLogger(job))
    line = JobQueue(kube, lease_seconds=LEASE)
    job_spec = spec(job)
    go.wait()
    deadline = time.time() + 600
    while time.time() < deadline:
        began = time.time()            # the decision's clock reads come after this
        turn = book_in_order(booker, line, job_spec, job, QueueConfig(), lambda: book_first(booker, job_spec, job),
                             deadline)
        if turn.step is not None:      # the pass's verdict: who is ahead, and the job's enqueue time as stored
            stored = turn.step.entry.enqueued_at if turn.step.ahead else None
            out.put(("decided", job, deployment, list(turn.step.ahead), began, stored))
        if turn.plan.outcome is Outcome.FITS:
            out.put(("admitted", job, time.time()))
            finish.wait(600)                # the job's run, as long as the test says
            ReservationLedger(kube).release(job)
            JobQueue(kube).drop(job)
            out.put(("released", job, time.time()))
            return
        if turn.plan.outcome is Outcome.NEVER:
            out.put(("error", job, f"never: {turn.plan.message}"))
            return
        out.put(("waiting", job, time.time()))
        first_event(WakeUpTrigger(time.time() + 1.5, queue=("default", CONFIGMAP), changes_seen=turn.wake_after,
                                  kubernetes_conn_id=conn, poll_seconds=0.3))
    out.put(("error", job, "still waiting after 600 s"))


class Runs:
    """The processes and what they report."""

    def __init__(self) -> None:
        self.out, self.procs, self.events = MP.Queue(), {}, []

    def start(self, job: str, deployment: str, runs_until_told: bool = False) -> mp.Process:
        go, finish = MP.Event(), MP.Event()
        if not runs_until_told:
            finish.set()
        proc = MP.Process(target=run_step, args=(job, deployment, self.out, go, finish), daemon=True)
        proc.start()
        self.procs[job] = (proc, go, finish)
        return proc

    def go(self, *jobs: str) -> None:
        for job in jobs:
            self.procs[job][1].set()

    def finish(self, *jobs: str) -> None:
        for job in jobs:
            self.procs[job][2].set()

    def read(self) -> None:
        while True:
            try:
                event = self.out.get_nowait()
            except queues.Empty:
                return
            assert event[0] != "error", event
            self.events.append(event)

    def seen(self, kind: str, job: str | None = None) -> list:
        self.read()
        return [e for e in self.events if e[0] == kind and (job is None or e[1] == job)]

    def stop(self) -> None:
        for proc, *_ in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(10)


def test_runs_in_many_processes_of_two_deployments_queue_agree_and_a_killed_waiter_blocks_no_one(cloud, monkeypatch):
    for deployment in ("a", "b"):          # two deployments: each its own connection to the one cluster
        monkeypatch.setenv(f"AIRFLOW_CONN_KUBERNETES_{deployment.upper()}", os.environ["AIRFLOW_CONN_KUBERNETES_DEFAULT"])
    runs = Runs()
    try:
        fillers = [f"fill-{i}" for i in range(FILLERS)]
        waiters = [f"wait-{i}" for i in range(WAITERS)]
        for i, job in enumerate([*fillers, "victim", *waiters]):
            runs.start(job, "ab"[i % 2], runs_until_told=job in fillers)
        runs.go(*fillers)                    # the fleet's GPUs taken, all at once, until the test says
        # (each process's first placement builds its clients: seconds on a loaded machine)
        wait_until(lambda: len(runs.seen("admitted")) == FILLERS, timeout=600, interval=0.2)
        runs.go("victim")                    # first in line, then killed mid-wait
        wait_until(lambda: runs.seen("waiting", "victim"), timeout=300, interval=0.1)
        os.kill(runs.procs["victim"][0].pid, signal.SIGKILL)
        killed = time.time()
        runs.go(*waiters)                    # a burst of arrivals behind it, across both deployments
        wait_until(lambda: len({e[1] for e in runs.seen("waiting")}) == 1 + WAITERS, timeout=600, interval=0.2)
        runs.finish(*fillers)                # then the GPUs free, one release after another

        # every other job runs; the victim's place is gone within one lease
        wait_until(lambda: len(runs.seen("released")) == FILLERS + WAITERS, timeout=600, interval=0.5)
        line = JobQueue(KubeClient()).snapshot()
        assert not runs.seen("admitted", "victim")
        assert line.live(killed + LEASE) == [] and line.running == ()     # the victim's lease ran out by then
        # blocked by no one: no decision begun a lease after the kill still counts the victim ahead (on a
        # fast backend there may be none: the victim takes one slot of the pass, the others cycle through)
        late = [(job, ahead) for _, job, _, ahead, at, _ in runs.seen("decided") if at >= killed + LEASE]
        assert not [job for job, ahead in late if "victim" in ahead], late
        assert runs.seen("decided", "victim")                     # it was in line, first, when killed

        # one order for everyone: no decision, of either deployment, puts two jobs the other way round.
        # (A waiter whose poll outlasted its lease came back as a newcomer, with a new enqueue time:
        # it may rightly change places, so only jobs that kept one enqueue time are compared.)
        decisions = runs.seen("decided")
        assert {d for _, _, d, _, _, _ in decisions} == {"a", "b"}
        times: dict[str, set[float]] = {}
        for _, job, _, _, _, stored in decisions:
            if stored is not None:
                times.setdefault(job, set()).add(stored)
        kept = {job for job, seen in times.items() if len(seen) == 1}
        assert len(kept) >= 2, times
        before: set[tuple[str, str]] = set()
        for _, job, _, ahead, _, _ in decisions:
            before.update((a, job) for a in ahead if {a, job} <= kept)
        flipped = sorted((a, b) for a, b in before if (b, a) in before)
        assert before and flipped == [], json.dumps(flipped)
    finally:
        runs.stop()

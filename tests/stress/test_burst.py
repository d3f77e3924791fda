"""A burst (issue 11): 40 GPU jobs placed at the same instant on a 10-GPU fleet, with API latency
and bursts of 409 Conflicts on the ledger. Every job is placed (the ones that do not fit wait
and are placed as GPUs free up), none fails for contention, no node is ever promised more than
it has (chaos.monitor watches every change of pods and the ledger), and the ledger ends empty.

Each job is the place transaction of the place step (`gpuboot.lifecycle.batching.book_first`: a first
placement queues in the ledger and one leader places the whole queue from one cluster read;
through the real hooks, in its own thread): contended -> it waits a little and books again, as the step defers; busy ->
it waits and books again, as the busy wait does. Once placed, the job's pod is bound to the
planned node and its reservation released at once (earlier than the release step does it):
that is the race the tombstones exist for, a reservation gone while other placers still work
from a pod listing that predates the bind.
"""
from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from chaos.harness import ConflictBursts, api_client_factory, cloud_connections
from chaos.monitor import Monitor
from simcloud.harness import SimCloud, small_fleet, wait_until

T4, T4X2, V100X4 = "ecs.gn6i-c4g1.xlarge", "ecs.gn6i-c24g1.12xlarge", "ecs.gn6v-c8g1.8xlarge"
FLEET = small_fleet([
    {"name": "t4-a", "instance_type": T4, "status": "Running"},
    {"name": "t4-b", "instance_type": T4, "status": "Running"},
    {"name": "t4x2-a", "instance_type": T4X2, "status": "Running"},
    {"name": "t4x2-b", "instance_type": T4X2, "status": "Running"},
    {"name": "v100x4", "instance_type": V100X4, "status": "Running"},
])
GPUS = 10
JOBS = 40
BUDGET_SECONDS = 90


def job(n: int) -> dict:
    return {"name": f"burst-{n:02d}", "image": "busybox", "command": ["true"], "gpus": 1, "cpu": "1",
            "memory": "1Gi", "queue_timeout_seconds": BUDGET_SECONDS}


def pod_for(job_id: str, assignment) -> dict:
    from gpuboot.core.model import LABEL_JOB, LABEL_TASK

    resources = {k: str(v) for k, v in assignment.requests.to_k8s().items()}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{job_id}-{assignment.task}", "labels": {LABEL_JOB: job_id, LABEL_TASK: assignment.task}},
            "spec": {"nodeName": assignment.node, "restartPolicy": "Never",
                     "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", "sleep 1"],
                                     "resources": {"requests": resources, "limits": resources}}]}}


def run_job(n: int, go: threading.Barrier, core, contended_seconds: float = 3) -> dict:
    from gpuboot.core.jobspec import JobSpec
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.batching import book_first
    from gpuboot.lifecycle.booking import Booker, LedgerContended
    from gpuboot.lifecycle.ledger import ReservationLedger

    kube = KubeClient()
    spec, job_id = JobSpec.from_dict(job(n)), f"burst-{n:02d}"
    booker = Booker(kube, EcsHook(), ReservationLedger(kube), logging.getLogger(f"burst.{n}"),
                    contended_seconds=contended_seconds)
    rng = random.Random(n)
    out = {"job": job_id, "placed": False, "contended": 0, "busy": 0, "reads_when_placed": [], "reads": 0}
    go.wait()
    deadline = time.monotonic() + BUDGET_SECONDS
    while time.monotonic() < deadline:
        before = booker.full_reads
        try:
            booking = book_first(booker, spec, job_id)
        except LedgerContended:
            out["contended"] += 1
            time.sleep(rng.uniform(0.2, 1.0))       # the place step defers
            continue
        if booking.plan.outcome.value == "busy":
            out["busy"] += 1
            time.sleep(rng.uniform(0.3, 0.8))       # the busy wait
            continue
        assert booking.plan.outcome.value == "fits", booking.plan.message
        out["placed"], out["reads_when_placed"] = True, booker.full_reads - before
        out["reads"] = booker.full_reads
        (a,) = booking.plan.assignments
        core.create_namespaced_pod("default", pod_for(job_id, a))
        booker.ledger.release(job_id)                # the pod counts now; the tombstone covers stale placers
        wait_until(lambda: core.read_namespaced_pod(f"{job_id}-{a.task}", "default").status.phase
                   in ("Succeeded", "Failed"), timeout=60)
        out["phase"] = core.read_namespaced_pod(f"{job_id}-{a.task}", "default").status.phase
        break
    return out


class Placers:
    """Two placers (gpuboot.lifecycle.placer, HA) in threads, each with its own clients and view; `kill_leader`
    stops the one holding the lease without stepping down, as a killed process leaves it."""

    def __init__(self) -> None:
        from gpuboot.hooks.ecs import EcsHook
        from gpuboot.hooks.kube import KubeClient
        from gpuboot.lifecycle.booking import Booker
        from gpuboot.lifecycle.ledger import ReservationLedger
        from gpuboot.lifecycle.placer import Placer
        from gpuboot.lifecycle.view import ClusterView

        self.placers, self.stops, self.threads = [], [], []
        for n in range(2):
            kube, ecs = KubeClient(), EcsHook()
            log = logging.getLogger(f"placer.{n}")
            booker = Booker(kube, ecs, ReservationLedger(kube), log)
            self.placers.append(Placer(booker, ClusterView(kube, ecs, log=log), name=f"p{n}"))
            self.stops.append(threading.Event())

    def __enter__(self) -> Placers:
        for placer, stop in zip(self.placers, self.stops):
            self.threads.append(threading.Thread(target=placer.run, args=(stop,), daemon=True))
            self.threads[-1].start()
        return self

    def kill_leader(self) -> str | None:
        from gpuboot.hooks.kube import KubeClient
        from gpuboot.lifecycle.ledger import ReservationLedger

        leader = ReservationLedger(KubeClient()).snapshot().batch.led_by(time.time())
        for placer, stop in zip(self.placers, self.stops):
            if placer.me == leader:
                stop.set()
        return leader

    def full_reads(self) -> int:
        return sum(p.booker.full_reads for p in self.placers)

    def __exit__(self, *exc) -> None:
        for stop in self.stops:
            stop.set()
        for t in self.threads:
            t.join(30)


@pytest.fixture(scope="module", params=["place steps lead", "placers lead"])
def outcome(request, tmp_path_factory):
    from gpuboot.lifecycle.booking import CONTENDED_SECONDS

    with SimCloud.start(FLEET, tmp_path_factory.mktemp("burst"), ready_timeout=120) as cloud, \
            cloud_connections(cloud.connections_file):
        cloud.set_faults(k8s_latency_ms=10)
        core = cloud.core_v1()
        go = threading.Barrier(JOBS + 1)            # every actor ready, then all released in one instant
        placers = Placers() if request.param == "placers lead" else None
        with Monitor(api_client_factory(cloud.kubeconfig)) as monitor, ConflictBursts(cloud, size=3) as bursts, \
                placers or contextlib.nullcontext(), ThreadPoolExecutor(max_workers=JOBS) as pool:
            if isinstance(placers, Placers):        # a placer leads before the burst
                wait_until(_led, timeout=120)
            # with placers, a waiter waits for their answer as the place step does (a busy verdict waits for the
            # view's pod stream to pass the ledger: a few seconds), rather than placing on its own after 3 s
            # (the place step's own budget, CONTENDED_SECONDS: longer than the dead leader's lease, which lapses first)
            futures = [pool.submit(run_job, n, go, core, 3 if placers is None else CONTENDED_SECONDS)
                       for n in range(JOBS)]
            go.wait(timeout=120)
            began = time.monotonic()
            if isinstance(placers, Placers):        # mid-burst, once it answered a batch, the leading placer dies
                wait_until(_answered, timeout=120)     # (the other takes over)
                killed = placers.kill_leader()
            results = [f.result() for f in futures]
            wall = time.monotonic() - began
            if isinstance(placers, Placers):        # a burst over before the kill took effect: the lease lapses
                survivors = [p.me for p in placers.placers if p.me != killed]    # and the surviving placer takes it
                wait_until(lambda: _leader() in survivors, timeout=120)
        from gpuboot.hooks.kube import KubeClient
        from gpuboot.lifecycle.ledger import ReservationLedger

        state = ReservationLedger(KubeClient()).snapshot()
        extra = {}
        if isinstance(placers, Placers):
            extra = {"killed": killed, "placer_reads": placers.full_reads(),
                     "placers": [p.me for p in placers.placers]}
        yield {"results": results, "report": monitor.report, "bursts": bursts.bursts, "wall": wall, "ledger": state,
               "mode": request.param, **extra}


def _leader() -> str | None:
    """Who holds a live batch lease now (None: nobody)."""
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.ledger import ReservationLedger

    return ReservationLedger(KubeClient()).snapshot().batch.led_by(time.time())


def _led() -> bool:
    return _leader() is not None


def _answered() -> bool:
    """Has a batch answered anyone yet?"""
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.ledger import ReservationLedger

    return bool(ReservationLedger(KubeClient()).snapshot().batch.decided)


def test_every_job_of_the_burst_is_placed_and_runs(outcome):
    assert [r["job"] for r in outcome["results"] if not r["placed"]] == []
    assert {r["job"]: r.get("phase") for r in outcome["results"] if r.get("phase") != "Succeeded"} == {}
    assert outcome["bursts"] > 0                       # the 409 bursts really hit it


def test_no_node_is_ever_promised_more_than_it_has(outcome):
    report = outcome["report"]
    assert report.checks > 40
    assert report.overcommits == [] and report.max_overcommit == {}
    assert report.max_promised_gpus <= GPUS
    assert report.admission_failures == []


def test_the_ledger_ends_empty_and_the_burst_shares_its_cluster_reads(outcome):
    state = outcome["ledger"]
    assert state.reservations == () and state.jobs == ()
    assert outcome["report"].leaked() == []
    # the try that placed a job read the cluster for a whole batch, if at all: below one read per placement
    reads = [r["reads_when_placed"] for r in outcome["results"] if r["placed"]]
    assert sum(reads) / len(reads) < (1 if outcome["mode"] == "place steps lead" else 0.5), reads
    if outcome["mode"] == "place steps lead":
        assert state.batch.leader is None
        return
    # placers: the surviving one leads, from its view (a full read only if its stream could not catch up); a
    # place step led only in the gap the killed leader's lease left (tests/integration/test_cluster_view.py: 410)
    assert outcome["killed"] in outcome["placers"]
    assert state.batch.leader in outcome["placers"] and state.batch.leader != outcome["killed"]
    assert outcome["placer_reads"] <= 2

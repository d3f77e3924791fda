"""Bursts: N place transactions at the same instant, each in its own process, on one ledger.

What a burst of `gpu_job` runs does to the place step, without Airflow's scheduling noise:
the parent imports everything (as a Celery prefork worker does), forks one process per job,
and releases them all at once; each runs the place step's transaction (`gpuboot.lifecycle.batching.book_first`,
a first placement through a batch) for a 1-GPU job (each with its own job id) through the real
hooks against simcloud. A transaction
that gives up for contention (`LedgerContended`) is what makes the place step defer: the
process then waits a short, jittered while, as the deferral would, and books again, until the
job's queue timeout; a job that never commits by then is failed. The fleet is the placement
bench's (bench.placement_cost.fleet: four GPU types, 80 % running with 10 pods each), with room
for every job, so every job should be placed.

Figures per run: jobs placed, failed (and why), wall time from the release to the last
commit, placements per second, full cluster reads (the Nodes + Pods + ECS `survey`) per
placement, median and max, ledger conflicts seen, and the ledger ConfigMap's size at its
peak (polled; and at the end, when it holds every job's reservation).

Everything shares the machine's cores: the simcloud process (the API servers, which in production
have machines of their own) competes with the job processes, so the figures are pessimistic.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import random
import statistics
import threading
import time
from pathlib import Path

from .common import local_cloud
from .placement_cost import fleet

SIZES = (100, 1000)
BURSTS = (50, 200)
QUEUE_TIMEOUT_SECONDS = 600
DEFER_SECONDS = (1.0, 3.0)      # how long a contended place step stays deferred (WakeUpTrigger), jittered
# GPUBOOT_BURST_NO_DEFER=1: a LedgerContended fails the job, as the place step did before it deferred
# (how the "before" figures were measured, on the code of that time)
DEFERS = os.environ.get("GPUBOOT_BURST_NO_DEFER") != "1"


def job(n: int) -> dict:
    return {"name": f"burst-{n:03d}", "image": "busybox", "command": ["true"], "gpus": 1, "cpu": "1", "memory": "1Gi",
            "queue_timeout_seconds": QUEUE_TIMEOUT_SECONDS}


def _place(n: int, go, ready, results) -> None:
    """One place step (in a forked process): book until committed or the queue timeout."""
    try:
        _book(n, go, ready, results)
    except BaseException as exc:
        results.put({"n": n, "outcome": None, "error": f"{type(exc).__name__}: {exc}", "reads": 0, "conflicts": 0,
                     "deferrals": 0, "began": time.time(), "ended": time.time()})


def _book(n: int, go, ready, results) -> None:
    from gpuboot.core.jobspec import JobSpec
    from gpuboot.hooks.ecs import EcsError, EcsHook
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle import batching, booking
    from gpuboot.lifecycle.ledger import LedgerConflict, ReservationLedger

    reads, conflicts = [0], [0]
    real_survey = booking.survey

    def counted_survey(*args, **kwargs):
        reads[0] += 1
        return real_survey(*args, **kwargs)

    booking.survey = batching.survey = counted_survey

    class Counting(logging.Handler):
        def emit(self, record):
            if "re-plac" in record.getMessage() or "conflict" in record.getMessage() or "batch kept" in record.getMessage():
                conflicts[0] += 1

    log = logging.getLogger(f"burst.{n}")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(Counting())
    kube, ecs = KubeClient(), EcsHook()
    kube.core, ecs.get_conn()       # client set-up, as a worker has it before the step
    spec = JobSpec.from_dict(job(n))
    booker = booking.Booker(kube, ecs, ReservationLedger(kube), log)
    rng = random.Random(n)
    ready.put(n)
    go.wait()
    began = time.time()
    deadline = began + spec.queue_timeout_seconds
    outcome, error, deferrals = None, None, 0
    while True:
        try:
            outcome = batching.book_first(booker, spec, f"burst-{n:03d}").plan.outcome.value
            break
        except (booking.LedgerContended, LedgerConflict, EcsError) as exc:
            if isinstance(exc, EcsError) and exc.kind != "transient":
                raise
            if not DEFERS or time.time() >= deadline:
                error = f"{type(exc).__name__}: {exc}"
                break
            deferrals += 1
            time.sleep(rng.uniform(*DEFER_SECONDS))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            break
    results.put({"n": n, "outcome": outcome, "error": error, "reads": reads[0], "conflicts": conflicts[0],
                 "deferrals": deferrals, "began": began, "ended": time.time()})


def _ledger_size(kube) -> int:
    """Bytes of the largest ledger object (root or shard): what the 1 MiB limit applies to."""
    from gpuboot.lifecycle.ledger import ReservationLedger

    return max(ReservationLedger(kube).sizes().values(), default=0)


def burst(jobs: int, kube) -> dict:
    """`jobs` place transactions released at once, each in its own (forked) process."""
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.lifecycle.ledger import ReservationLedger

    kube.core, EcsHook().get_conn()     # the clients' modules imported before the fork, as in a prefork worker
    ctx = mp.get_context("fork")
    go, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_place, args=(n, go, ready, results), daemon=True) for n in range(jobs)]
    for p in procs:
        p.start()
    waiting = 0
    with contextlib.suppress(queue.Empty):
        while waiting < jobs:           # every process set up (its clients made) and waiting
            ready.get(timeout=300)
            waiting += 1
    peak, stop = [0], threading.Event()

    def watch_size():
        while not stop.wait(0.5):
            with contextlib.suppress(Exception):
                peak[0] = max(peak[0], _ledger_size(kube))

    watcher = threading.Thread(target=watch_size, daemon=True)
    watcher.start()
    released = time.time()
    go.set()
    rows, give_up = [], released + QUEUE_TIMEOUT_SECONDS + 60
    while len(rows) < jobs and time.time() < give_up:
        try:
            rows.append(results.get(timeout=5))
        except queue.Empty:
            continue
    for p in procs:
        p.join(timeout=max(0.1, give_up - time.time()))
        if p.is_alive():
            p.kill()
    seen = {r["n"] for r in rows}
    rows += [{"n": n, "outcome": None, "error": "no answer before the queue timeout", "reads": 0, "conflicts": 0,
              "deferrals": 0, "began": released, "ended": time.time()} for n in range(jobs) if n not in seen]
    stop.set()
    watcher.join(timeout=5)
    end_size = _ledger_size(kube)
    placed = [r for r in rows if r["outcome"] == "fits"]
    failed = [r for r in rows if r["outcome"] != "fits"]
    wall = max(r["ended"] for r in rows) - released
    reads = [r["reads"] for r in rows]
    for name in ReservationLedger(kube).sizes():        # the next burst starts from an empty ledger
        kube.core.delete_namespaced_config_map(name, "default")
    return {"jobs": jobs, "placed": len(placed), "failed": len(failed),
            "failures": sorted({r["error"] or r["outcome"] for r in failed})[:5],
            "wall_s": round(wall, 1), "placements_per_s": round(len(placed) / wall, 2) if wall else None,
            "reads_per_placement_mean": round(sum(reads) / max(1, len(placed)), 2),
            "reads_median": statistics.median(reads), "reads_max": max(reads),
            "conflicts": sum(r["conflicts"] for r in rows), "deferrals": sum(r["deferrals"] for r in rows),
            "ledger_peak_bytes": max(peak[0], end_size), "ledger_end_bytes": end_size}


def run(workdir: Path, quick: bool = False, sizes=None, bursts=None) -> dict:
    from gpuboot.hooks.kube import KubeClient

    sizes = sizes or ((100,) if quick else SIZES)
    bursts = bursts or ((50,) if quick else BURSTS)
    rows = []
    for size in sizes:
        with local_cloud(fleet(size), workdir / f"cloud-{size}", ready_timeout=600):
            kube = KubeClient()
            for jobs in bursts:
                rows.append({"nodes": size, **burst(jobs, kube)})
                print(f"burst: {rows[-1]}", flush=True)
    return {"rows": rows, "queue_timeout_s": QUEUE_TIMEOUT_SECONDS, "cores": os.cpu_count(),
            "note": "each place transaction in its own forked process, all released at once; "
                    "reads = full cluster reads (Nodes + Pods + ECS) per placement"}

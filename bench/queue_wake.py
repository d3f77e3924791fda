"""From a release to the waiter placed: how long freed capacity sits idle while a job waits for it.

    .venv/bin/python -m bench.queue_wake [--runs 6] [--seed 0] [--json results/bench/queue_wake.json]

One running 1-GPU node on simcloud (its Kubernetes API and ECS), every run: a job takes the GPU,
a second job's place step (the real operator, through the real hooks) finds it busy and defers
on the trigger its code chooses, with the gpu_job default poll (busy_poll_seconds=30); a moment
later (uniform over the poll, seeded: a release comes at any point of a waiter's poll) the first
job is released as its release step does (ledger, then the job queue); the trigger runs in this
process's event loop, as the triggerer would; its event resumes the step, which places the job.
Measured: release -> the step's plan committed (FITS), per run, and the trigger's read count.

Before (the timer only, main before issue 32 #1), on the same machine: run this file against the
older code, e.g. `git worktree add /tmp/before 33b4d57` then
`PYTHONPATH=/tmp/before/plugins:. .venv/bin/python -m bench.queue_wake`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "airflow" not in sys.modules:     # the operator imports Airflow: a throwaway home, never the user's
    _home = tempfile.mkdtemp(prefix="gpuboot-bench-airflow-")
    os.environ.setdefault("AIRFLOW_HOME", _home)
    os.environ.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{_home}/airflow.db")

POLL_SECONDS = 30.0      # gpu_job's busy_poll_seconds
JOB = {"image": "python:3.11", "command": ["true"], "gpus": 1, "cpu": "1", "memory": "1Gi",
       "queue_timeout_seconds": 3600}


def fleet() -> dict:
    from simcloud.harness import small_fleet

    return small_fleet([{"name": "gpu-run", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Running"}])


def first_event(trigger) -> dict:
    async def first():
        async for event in trigger.run():
            return event.payload
    return asyncio.run(first())


def one_run(n: int, offset: float) -> dict:
    """Hog placed, waiter deferred, the hog released `offset` s after the deferral; the waiter's times."""
    from airflow.sdk.exceptions import TaskDeferred

    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.jobqueue import JobQueue
    from gpuboot.lifecycle.ledger import ReservationLedger
    from gpuboot.operators.place import PlaceGpuJobOperator
    from tests.builders import step_context

    hog = PlaceGpuJobOperator(task_id="place", job={**JOB, "name": f"hog-{n}"}, job_id=f"hog-{n}")
    assert hog.execute(step_context())["outcome"] == "fits"
    waiter = PlaceGpuJobOperator(task_id="place", job={**JOB, "name": f"waiter-{n}"}, job_id=f"waiter-{n}",
                                 busy_poll_seconds=POLL_SECONDS)
    ctx = step_context()
    try:
        waiter.execute(ctx)
        raise AssertionError("the waiter should have deferred: the only GPU is taken")
    except TaskDeferred as deferred:
        trigger = deferred.trigger
    deferred_at = time.monotonic()
    released: list[float] = []

    def release() -> None:
        time.sleep(max(0.0, deferred_at + offset - time.monotonic()))   # sleep-ok: when the release comes
        ReservationLedger(KubeClient()).release(f"hog-{n}")
        JobQueue(KubeClient()).drop(f"hog-{n}")
        released.append(time.monotonic())

    releasing = threading.Thread(target=release)
    releasing.start()
    event = first_event(trigger)
    woke = time.monotonic()
    releasing.join()
    plan = waiter.resume(ctx, event)
    placed = time.monotonic()
    ReservationLedger(KubeClient()).release(f"waiter-{n}")
    JobQueue(KubeClient()).drop(f"waiter-{n}")
    return {"offset": round(offset, 3), "woken": event.get("woken", "timer"), "outcome": plan["outcome"],
            "release_to_wake": round(woke - released[0], 3), "release_to_placed": round(placed - released[0], 3),
            "trigger": type(trigger).__name__}


def run(runs: int, seed: int) -> dict:
    from bench.common import local_cloud, stats

    rng = random.Random(seed)
    offsets = [rng.uniform(1.0, POLL_SECONDS - 1.0) for _ in range(runs)]
    with tempfile.TemporaryDirectory(prefix="gpuboot-queue-wake-") as workdir, local_cloud(fleet(), Path(workdir)):
        results = [one_run(n, offset) for n, offset in enumerate(offsets)]
    placed = [r["release_to_placed"] for r in results]
    return {"poll_seconds": POLL_SECONDS, "runs": results, "release_to_placed": stats(placed),
            "mean_release_to_placed": round(statistics.fmean(placed), 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args.runs, args.seed)
    for r in result["runs"]:
        print(f"release {r['offset']:5.1f} s into the poll: woken by {r['woken']:5}, placed "
              f"{r['release_to_placed']:6.2f} s after the release ({r['outcome']})")
    s = result["release_to_placed"]
    print(f"release -> waiter placed: median {s['median']} s, mean {result['mean_release_to_placed']} s, "
          f"max {s['max']} s over {s['n']} runs (poll {POLL_SECONDS:g} s)")
    if args.json:
        from bench.common import write_json

        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

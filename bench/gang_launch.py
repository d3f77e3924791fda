"""Gang launch: the launch step called -> every rank's pod created -> every rank Running, and
at the other end the last rank done -> the gang's trigger fired (its verdict).

A 4-rank gang on 4 running 1-GPU nodes of one local cloud: the place step reserves them, then
`GpuPodOperator` (deferrable, as in a worker: execute returns by deferring once every pod
exists) launches the gang. Rank 0 goes first and the others are created once its pod IP is
known (their MASTER_ADDR), so "rank 0 created -> last rank created" is the hop spent waiting
for that IP. Stamps: the call and its deferral in this process, pods by a watch in this process.
The deferral's GangTrigger then runs in this process until its first event, which it fires once
every rank has ended (each runs 3 s, so the trigger is already following them) and their log
streams have delivered their last lines.
Every repeat is a new job; its pods finish and its reservations are released before the next.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from .common import local_cloud, stats
from .overhead import PodsRunning

T4 = "ecs.gn6i-c4g1.xlarge"
RANKS = 4
TIMINGS = {"pod_start_seconds": 0.5}
JOB = {"name": "bench-gang", "image": "python:3.11-slim", "command": ["python", "-c", "import time; time.sleep(3); print('rank ok')"],
       "gpus": 1, "cpu": "1", "memory": "1Gi", "replicas": RANKS}


def run(workdir: Path, quick: bool = False, repeats: int = 10) -> dict:
    from airflow.sdk.exceptions import TaskDeferred

    from gpuboot.operators.launch import GpuPodOperator
    from gpuboot.operators.place import PlaceGpuJobOperator
    from gpuboot.operators.release import ReleaseReservationOperator
    from simcloud.harness import small_fleet, wait_until
    from tests.builders import step_context

    repeats = 2 if quick else repeats
    fleet = small_fleet([{"name": f"t4-{i}", "instance_type": T4, "status": "Running"} for i in range(RANKS)],
                        timings=TIMINGS)
    created, first_to_last, running, verdict = [], [], [], []
    with local_cloud(fleet, workdir / "cloud") as cloud, PodsRunning(cloud) as pods:
        wait_until(lambda: all(cloud.node_ready(f"t4-{i}") for i in range(RANKS)), timeout=60, interval=0.1,
                   message="the gang's nodes did not come up")
        for i in range(repeats):
            job_id = f"gang-{i}"
            context = step_context()
            plan = PlaceGpuJobOperator(task_id="place", job=JOB, job_id=job_id).execute(context)
            if plan["outcome"] != "fits" or plan["nodes_to_start"]:
                raise RuntimeError(f"repeat {i}: the gang should fit the running nodes, got {plan['outcome']}")
            launch = GpuPodOperator(task_id="launch", job=context["ti"].pushed["job"], plan=plan)
            began = time.time()
            try:
                launch.execute(step_context())
                raise RuntimeError(f"repeat {i}: launch did not defer")
            except TaskDeferred as deferred:
                trigger, names = deferred.trigger, list(deferred.trigger.pods)
            created.append(time.time() - began)
            wait_until(lambda: all(n in pods.at for n in names) and all(n in pods.seen for n in names),
                       timeout=60, interval=0.05, message=f"repeat {i}: the gang's pods did not all run")
            first_to_last.append(max(pods.seen[n] for n in names[1:]) - pods.seen[names[0]])
            running.append(max(pods.at[n] for n in names) - began)
            event = asyncio.run(asyncio.wait_for(_first_event(trigger), timeout=120))
            fired = time.time()
            if event.payload["status"] != "succeeded":
                raise RuntimeError(f"repeat {i}: the gang should succeed, its trigger said {event.payload}")
            wait_until(lambda: all(n in pods.ended for n in names), timeout=60, interval=0.05,
                       message=f"repeat {i}: the watch did not see every rank end")
            verdict.append(fired - max(pods.ended[n] for n in names))
            ReleaseReservationOperator(task_id="release", job_id=job_id).execute(step_context())
    return {"ranks": RANKS, "repeats": repeats, "timings": TIMINGS,
            "launch_to_created_s": stats(created), "rank0_to_last_created_s": stats(first_to_last),
            "launch_to_all_running_s": stats(running), "last_done_to_verdict_s": stats(verdict),
            "notes": ["launch_to_created: execute() called -> it defers with every pod created (in this process).",
                      "rank0_to_last_created: rank 0's pod first seen -> the last rank's pod first seen (a watch).",
                      "launch_to_all_running: execute() called -> the last rank seen Running.",
                      "last_done_to_verdict: the last rank seen Succeeded (the watch) -> the trigger fired."]}


async def _first_event(trigger):
    async for event in trigger.run():
        return event

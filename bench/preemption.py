"""Live preemption, timed: how long a high job waits for a preemptible job's node, and how soon the
victim runs again once the node is free.

    .venv/bin/python -m bench.preemption [--runs 3] [--kube simcloud|real] [--json results/bench/preemption.json]
    .venv/bin/python -m bench --parts preemption --kube simcloud,real      # both backends side by side

One running 8-GPU node on simcloud (its ECS, and its own Kubernetes API or, with `--kube real`, the
real control plane from `make controlplane`), every run: a low, preemptible 8-GPU
job is placed and launched (the real place and launch operators; its pod runs); a high 8-GPU job's
place step (the real operator) preempts it and places on the node; the victim's launch resumes from
its gang trigger's event (run in this process, as the triggerer would), is told, requeues and defers
in the queue; the high job is released as its release step does; the victim's queue trigger, node
readiness trigger and relaunch follow. Measured per run:

- place_with_preemption: the high job's place step, from its start to its plan committed (the queue
  write, the victim's pod deleted and gone, its reservation dropped, the placement);
- victim_told: from that commit to the victim's launch logging its preemption (its gang trigger's
  event: the pod's deletion seen, then the wait for the rank's log stream to end);
- release_to_relaunched: from the high job's release to the victim's pods created again.

Before this (no live preemption), the high job waited for the low job to end on its own: its whole
remaining runtime, however long.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

if "airflow" not in sys.modules:     # the operators import Airflow: a throwaway home, never the user's
    _home = tempfile.mkdtemp(prefix="gpuboot-bench-airflow-")
    os.environ.setdefault("AIRFLOW_HOME", _home)
    os.environ.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{_home}/airflow.db")

from bench.report import PREEMPTION_FIGURES

V100X8 = "ecs.gn6v-c10g1.20xlarge"
JOB = {"image": "python:3.11", "gpus": 8, "cpu": "1", "memory": "1Gi", "settle_seconds": 1,
       "boot_timeout_seconds": 300}
LOW = {**JOB, "priority_class": "low", "preemptible": True,
       "command": ["python", "-c", "import time\ntime.sleep(600)"]}   # sleep-ok: the pod's own workload
HIGH = {**JOB, "priority_class": "high", "command": ["true"]}


def fleet() -> dict:
    from simcloud.harness import MANAGED, small_fleet

    out = small_fleet([{"name": "gpu8", "instance_type": V100X8, "status": "Running", **MANAGED}])
    out["instance_types"][V100X8] = {"cpu": 82, "memory_gib": 336, "gpu": 8, "gpu_spec": "NVIDIA V100",
                                     "price_per_hour": 26.0}
    return out


def event_of(deferred) -> dict:
    async def first():
        async for event in deferred.trigger.run():
            return event.payload
    return asyncio.run(first())


def one_run(n: int) -> dict:
    from airflow.sdk.exceptions import TaskDeferred

    from gpuboot.core.model import LABEL_JOB
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.jobqueue import JobQueue
    from gpuboot.lifecycle.ledger import ReservationLedger
    from gpuboot.operators.launch import GpuPodOperator
    from gpuboot.operators.place import PlaceGpuJobOperator
    from simcloud.harness import wait_until
    from tests.builders import step_context

    kube = KubeClient()
    low, high = f"low-{n}", f"high-{n}"
    ctx = step_context()
    plan = PlaceGpuJobOperator(task_id="place", job={**LOW, "name": low}, job_id=low).execute(ctx)
    launch = GpuPodOperator(task_id="launch", job=ctx["ti"].pushed["job"], plan=plan, env_source={**LOW, "name": low},
                            startup_timeout_seconds=30, busy_poll_seconds=30)
    launch_ctx = step_context()
    try:
        launch.execute(launch_ctx)
        raise AssertionError("launch should defer on its gang")
    except TaskDeferred as deferred:
        gang = deferred
    wait_until(lambda: any(p["status"].get("phase") == "Running" for p in kube.list_pods(f"{LABEL_JOB}={low}")),
               timeout=120, message="the low job's pod did not start")

    began = time.monotonic()
    placed = PlaceGpuJobOperator(task_id="place", job={**HIGH, "name": high}, job_id=high).execute(step_context())
    committed = time.monotonic()
    assert placed["outcome"] == "fits", placed["message"]
    event = event_of(gang)
    told = time.monotonic()
    try:
        launch.execute_complete(launch_ctx, event)
        raise AssertionError("the victim should wait in the queue: the high job holds the node")
    except TaskDeferred as deferred:
        waiting = deferred
    ReservationLedger(kube).release(high)
    JobQueue(kube).drop(high)
    released = time.monotonic()
    step, woken = waiting, None
    while True:                     # the queue's trigger, then the node's readiness, then the gang again
        event = event_of(step)
        woken = woken or event.get("woken") or "timer"
        try:
            getattr(launch, step.method_name)(launch_ctx, event)
        except TaskDeferred as deferred:
            if deferred.method_name == "execute_complete":
                break
            step = deferred
    relaunched = time.monotonic()
    for p in kube.list_pods(f"{LABEL_JOB}={low}"):
        kube.delete_pod(p["metadata"]["namespace"], p["metadata"]["name"], grace_seconds=0)
    ReservationLedger(kube).release(low)
    JobQueue(kube).drop(low)
    return {"place_with_preemption": round(committed - began, 3), "victim_told": round(told - committed, 3),
            "release_to_relaunched": round(relaunched - released, 3), "woken": woken}


def run(runs: int) -> dict:
    from bench.common import local_cloud, stats

    with tempfile.TemporaryDirectory(prefix="gpuboot-preemption-") as workdir, local_cloud(fleet(), Path(workdir)):
        results = [one_run(n) for n in range(runs)]
    return {"runs": results, **{key: stats([r[key] for r in results]) for key in PREEMPTION_FIGURES}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kube", choices=("simcloud", "real"), default=None,
                        help="Kubernetes backend (default: $GPUBOOT_KUBE, else simcloud's own API server)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.kube:
        os.environ["GPUBOOT_KUBE"] = args.kube      # every SimCloud started here uses it (simcloud.harness)
    result = run(args.runs)
    for r in result["runs"]:
        print(f"high job placed with preemption in {r['place_with_preemption']:5.2f} s; victim told "
              f"{r['victim_told']:5.2f} s later; relaunched {r['release_to_relaunched']:5.2f} s after the release "
              f"(woken by {r['woken']})")
    for key in PREEMPTION_FIGURES:
        s = result[key]
        print(f"{key}: median {s['median']} s, max {s['max']} s over {s['n']} runs")
    if args.json:
        from bench.common import write_json

        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

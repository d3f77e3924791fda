"""Launch holds no worker slot (issue 13): three jobs run at the same time through ONE Celery
worker slot on the distributed stack.

Each job's pod drops a marker file into a shared folder and waits until all three markers are
there before it exits 0 (else it gives up and exits 1). If launch held its worker slot while
its pod ran, the second job's launch could never start while the first pod waits: the three
pods would never meet and every run would fail. They meet only because each launch hands its
wait to the triggerer (GangTrigger) and frees the slot.
"""
from __future__ import annotations

import time

import pytest

from simcloud.harness import small_fleet, wait_until
from tests.distributed.test_gpu_job_burst import AIRFLOW_ENV as BURST_ENV
from tests.distributed.test_gpu_job_distributed import DAG_ID, TIMINGS, distributed, short  # noqa: F401

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]

NODES = [{"name": f"t4-{n}", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Running"} for n in "abc"]
FLEET = small_fleet(NODES, timings=TIMINGS)
AIRFLOW_ENV = {**BURST_ENV, "AIRFLOW__CELERY__WORKER_CONCURRENCY": "1"}     # ONE task slot
JOBS = 3
MEET = ("import os, pathlib, sys, time\n"
        "d = pathlib.Path(os.environ['MEET_DIR']); (d / os.environ['HOSTNAME']).touch()\n"
        "print('waiting for the others', flush=True)\n"
        "deadline = time.monotonic() + 900\n"
        f"while len(list(d.iterdir())) < {JOBS}:\n"
        "    if time.monotonic() > deadline:\n"
        "        print('never met the others', flush=True); sys.exit(1)\n"
        "    time.sleep(0.5)\n"  # sleep-ok: the workload's own poll
        "print('met', sorted(p.name for p in d.iterdir()), flush=True)\n")


def test_three_jobs_run_at_once_through_one_worker_slot(distributed, tmp_path):
    _cloud, airflow, procs = distributed
    api = airflow.api
    meet = tmp_path / "meet"
    meet.mkdir()
    wait_until(lambda: procs.check_alive() or api.dag_loaded(DAG_ID), timeout=180, interval=1,
               message=lambda: f"{DAG_ID} not parsed by the dag-processor in 180s")
    api.http.patch(f"/api/v2/dags/{DAG_ID}", json={"is_paused": False}).raise_for_status()
    run_ids = []
    for n in range(JOBS):
        job = {"name": f"slot-{n}", "image": "python:3.11-slim", "command": ["python", "-c", MEET],
               "env": {"MEET_DIR": str(meet)}, "gpus": 1, "cpu": "1", "memory": "1Gi", "settle_seconds": 1,
               "boot_timeout_seconds": 120, "queue_timeout_seconds": 600}
        r = api.http.post(f"/api/v2/dags/{DAG_ID}/dagRuns", json={"logical_date": None, "conf": job}, timeout=180)
        assert r.status_code < 300, (r.status_code, r.text[:500])
        run_ids.append(r.json()["dag_run_id"])

    launch_states: dict[str, set] = {r: set() for r in run_ids}

    def all_ended():
        procs.check_alive()
        states = {}
        for run_id in run_ids:
            for ti in api.task_instances(DAG_ID, run_id):
                if short(ti["task_id"]) == "launch" and ti["state"]:
                    launch_states[run_id].add(ti["state"])
            states[run_id] = api.run_state(DAG_ID, run_id)
        return states if all(s in ("success", "failed") for s in states.values()) else None

    started = time.monotonic()
    states = wait_until(all_ended, timeout=1500, interval=1,
                        message=lambda: f"runs not finished: {launch_states}")
    print(f"{JOBS} runs through one worker slot ended in {time.monotonic() - started:.0f}s", flush=True)
    assert set(states.values()) == {"success"}, (states, launch_states)
    assert len(list(meet.iterdir())) == JOBS                       # the three pods ran at the same time
    assert all("deferred" in seen for seen in launch_states.values()), launch_states

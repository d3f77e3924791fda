"""Issue 9, defect 3, as it was found: through the REST API on the distributed stack.

A 1-GPU job boots `t4-stopped`, which never becomes Ready; `wait_gpu_ready` fails over to
`t4x2-stopped`, whose device plugin never registers, and defers. Then the step is cleared with
POST /api/v2/dags/gpu_job/clearTaskInstances (which also re-runs `place`, the setup of
`release`). The retry must resume from the ledger: wait on `t4x2-stopped` (never again on
`t4-stopped`) give up, and leave no instance running, no
reservation and no record behind. Short: boot timeouts of 20 s, on the shared `distributed` stack."""
from __future__ import annotations

import pytest

from gpuboot.core.model import Reservation
from gpuboot.core.resources import Resources
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.ledger import ReservationLedger
from scripts.demo import conn_env
from simcloud.harness import wait_until
from tests.distributed.test_gpu_job_distributed import DAG_ID, distributed, follow, short  # noqa: F401 (fixture)
from tests.shared import live_reservations

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

JOB = {"name": "failover", "image": "python:3.11-slim", "command": ["python", "-c", "print('never runs')"],
       "gpus": 1, "cpu": "1", "memory": "1Gi", "settle_seconds": 2, "boot_timeout_seconds": 20,
       "queue_timeout_seconds": 30}
BOOTED = ("t4-stopped", "t4x2-stopped")


def statuses(cloud) -> dict[str, str]:
    return {i["name"]: i["status"] for i in cloud.state()["instances"]}


def wait_task(api, run_id: str) -> dict:
    (ti,) = [t for t in api.task_instances(DAG_ID, run_id) if short(t["task_id"]) == "wait_gpu_ready"]
    return ti


def test_clearing_wait_gpu_ready_mid_failover_leaves_no_instance_running(distributed, monkeypatch):
    cloud, airflow, procs = distributed
    api = airflow.api
    for name, value in conn_env(cloud.connections_file).items():
        monkeypatch.setenv(name, value)
    ledger = ReservationLedger(KubeClient())
    # another job holds the running 1-GPU node, so this job must boot one
    ledger.commit("hog", [Reservation("hog", "hog", "t4-running", Resources.parse({"nvidia.com/gpu": 1}), 4e9)],
                  ledger.snapshot().version)
    cloud.set_faults(never_ready=["t4-stopped"], device_plugin_never=["t4x2-stopped"])

    wait_until(lambda: procs.check_alive() or api.dag_loaded(DAG_ID), timeout=180, interval=1,
               message=lambda: f"{DAG_ID} not parsed by the dag-processor in 180s")
    run_id = api.trigger(DAG_ID, JOB)
    from gpuboot.operators.base import job_id_for  # imports Airflow: not at collection (tests/conftest.py)

    job_id = job_id_for(DAG_ID, run_id, "gpu_job")

    def failed_over_and_deferred() -> bool:
        procs.check_alive()
        on = [r.node for r in live_reservations(cloud) if r.job_id == job_id]
        return on == ["t4x2-stopped"] and wait_task(api, run_id)["state"] == "deferred"

    wait_until(failed_over_and_deferred, timeout=240, interval=0.5,
               message=lambda: f"no fail-over to t4x2-stopped: {wait_task(api, run_id)}, {statuses(cloud)}")
    assert ledger.snapshot().record(job_id, 0).started_on("t4x2-stopped") is not None

    r = api.http.post(f"/api/v2/dags/{DAG_ID}/clearTaskInstances",
                      json={"dry_run": False, "dag_run_id": run_id, "task_ids": ["gpu_job.wait_gpu_ready"],
                            "only_failed": False, "include_downstream": True})
    assert r.status_code == 200, r.text
    state, seen = follow(api, run_id, procs, timeout=300)

    assert state == "failed", seen
    ti = wait_task(api, run_id)
    assert ti["try_number"] >= 2, ti
    retry_log = "\n".join(api.log_events(DAG_ID, run_id, ti))
    assert "waiting for node t4x2-stopped" in retry_log and "waiting for node t4-stopped" not in retry_log, retry_log
    assert "device plugin never registered the GPUs on t4x2-stopped" in retry_log, retry_log[-3000:]
    assert "left running" not in retry_log
    assert ledger.snapshot().record(job_id, 0) is None, "the job's record outlived the run"
    wait_until(lambda: all(statuses(cloud)[n] == "Stopped" for n in BOOTED), timeout=60,
               message=lambda: f"instances left running: {statuses(cloud)}")
    assert [r.job_id for r in live_reservations(cloud)] == ["hog"]

"""A burst of `gpu_job` runs triggered through the REST API at once on the distributed stack (issue 11).

Twenty 1-GPU jobs are posted in the same instant (a barrier) to Airflow on CeleryExecutor
(the stack of test_gpu_job_distributed.py). The fleet has 16 GPUs, one node of them running:
the place steps race for the ledger from Celery worker processes, most jobs boot a stopped
node, and the DAG's max_active_runs (16) holds the last runs queued until earlier ones end.
Promised: every run succeeds (none fails for ledger contention), no node was ever promised
more than it has and the kubelet refused no pod (chaos.monitor, watching the whole burst),
every pod ran to completion, the ledger ends with nothing promised, and once the idle
scale-down has run no instance is left running idle.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from chaos.harness import api_client_factory
from chaos.monitor import Monitor
from scripts.demo import SCALEDOWN_DAG_ID, instance_statuses, scale_down
from simcloud.harness import small_fleet, wait_until
from tests.distributed.test_gpu_job_distributed import DAG_ID, distributed, short  # noqa: F401
from tests.shared import live_reservations

pytestmark = [pytest.mark.distributed, pytest.mark.distributed_burst, pytest.mark.timeout(2000)]

V100X4, T4X2, T4 = "ecs.gn6v-c8g1.8xlarge", "ecs.gn6i-c24g1.12xlarge", "ecs.gn6i-c4g1.xlarge"
STOPPED = {"v100x4-a": V100X4, "v100x4-b": V100X4, "t4x2-a": T4X2, "t4-a": T4, "t4-b": T4}
NODES = [{"name": "v100x4-running", "instance_type": V100X4, "status": "Running"},
         *({"name": name, "instance_type": kind, "status": "Stopped"} for name, kind in STOPPED.items())]
FLEET = small_fleet(NODES, timings={"boot_seconds": 3, "stale_seconds": 1, "device_plugin_seconds": 1})
# Every task try parses the DAG file in a process forked from a Celery worker process, and most of
# that parse is importing the Kubernetes provider (seconds of CPU each time): the worker imports it
# once at start (Celery's `imports`), so its forks inherit it. More task slots than the default 2,
# so twenty runs' steps do not queue behind one another; a longer DAG import timeout for a loaded machine.
AIRFLOW_ENV = {"AIRFLOW__CELERY__WORKER_CONCURRENCY": "6",
               "AIRFLOW__CELERY__EXTRA_CELERY_CONFIG": json.dumps(
                   {"imports": ["airflow.providers.cncf.kubernetes.operators.pod"]}),
               "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120"}
BURST = 20
# About 120 task tries (six per run) through 6 worker slots: minutes on an idle 2-core machine, and a
# bound for a loaded one (seen: 4 of 20 runs done after 600 s at a load average of 20 on 2 cores).
BURST_TIMEOUT = 1200
FINISHED = {"success", "failed"}


def job(n: int) -> dict:
    name = f"burst-{n:02d}"
    return {"name": name, "image": "busybox", "command": ["sh", "-c", f"echo {name} done"],
            "gpus": 1, "cpu": "1", "memory": "1Gi", "settle_seconds": 1,
            "boot_timeout_seconds": 120, "queue_timeout_seconds": 600}


def trigger_burst(api, count: int) -> list[str]:
    """POST `count` runs, all released in the same instant."""
    api.http.patch(f"/api/v2/dags/{DAG_ID}", json={"is_paused": False}).raise_for_status()
    gate = threading.Barrier(count)

    def one(n: int) -> str:
        gate.wait()
        # Twenty POSTs at once to one api-server worker: on a loaded machine some took over the
        # client's 30 s. A longer wait, not a retry (a POST retried could start a run twice).
        r = api.http.post(f"/api/v2/dags/{DAG_ID}/dagRuns", json={"logical_date": None, "conf": job(n)},
                          timeout=180)
        assert r.status_code < 300, (r.status_code, r.text[:500])
        return r.json()["dag_run_id"]

    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="trigger") as pool:
        return list(pool.map(one, range(count)))


def run_states(api) -> dict[str, str]:
    listing = api.get(f"/dags/{DAG_ID}/dagRuns", limit=100)
    listing.raise_for_status()
    return {r["dag_run_id"]: r["state"] for r in listing.json()["dag_runs"]}


def why_failed(api, run_id: str) -> str:
    """The failed tasks of a run and the end of each one's last log."""
    out = []
    for ti in api.task_instances(DAG_ID, run_id):
        if ti["state"] not in ("success", "skipped"):
            tail = "\n".join(api.log_events(DAG_ID, run_id, ti))[-1500:]
            out.append(f"--- {run_id} {short(ti['task_id'])}: {ti['state']} ---\n{tail}")
    return "\n".join(out)


def test_a_burst_of_runs_over_rest_all_succeed_on_nodes_with_room(distributed):
    cloud, airflow, procs = distributed
    api = airflow.api
    wait_until(lambda: procs.check_alive() or (api.dag_loaded(DAG_ID) and api.dag_loaded(SCALEDOWN_DAG_ID)),
               timeout=180, interval=1, message=lambda: f"{DAG_ID} not parsed by the dag-processor in 180s")
    before = instance_statuses(cloud)

    monitor = Monitor(api_client_factory(cloud.kubeconfig))
    monitor.start(timeout=180)    # its first listings take long on a loaded machine (30 s seen short)
    try:
        started = time.monotonic()
        run_ids = trigger_burst(api, BURST)
        assert len(set(run_ids)) == BURST

        def all_ended():
            procs.check_alive()
            states = run_states(api)
            return states if all(states.get(r) in FINISHED for r in run_ids) else None

        states = wait_until(all_ended, timeout=BURST_TIMEOUT, interval=2,
                            message=lambda: f"burst not finished in {BURST_TIMEOUT}s: {run_states(api)}")
        print(f"burst of {BURST} runs ended in {time.monotonic() - started:.0f}s", flush=True)
    finally:
        monitor.stop(timeout=180)
    failed = [r for r in run_ids if states[r] != "success"]
    assert failed == [], f"{len(failed)} of {BURST} runs failed:\n" + "\n".join(why_failed(api, r) for r in failed)

    # Every pod ran to completion on a node that had room for it: the monitor saw no node promised
    # more than it has at any point of the burst, and the kubelet refused no pod.
    report = monitor.report
    assert report.overcommits == [], [o.line() for o in report.overcommits]
    assert report.admission_failures == []
    pods = [p for p in cloud.core_v1().list_pod_for_all_namespaces().items
            if (p.metadata.labels or {}).get("gpuboot.io/job")]
    assert len(pods) == BURST and {p.status.phase for p in pods} == {"Succeeded"}, \
        [(p.metadata.name, p.spec.node_name, p.status.phase) for p in pods]
    assert {p.spec.node_name for p in pods} <= {n["name"] for n in NODES}

    # Nothing stays promised.
    assert live_reservations(cloud) == []

    # The idle scale-down stops every instance the burst left up; none stays running idle.
    up = sorted(name for name, status in instance_statuses(cloud).items() if status != "Stopped")
    assert set(up) > {n for n, s in before.items() if s == "Running"}, up       # the burst booted nodes
    assert scale_down(api, cloud, up, idle_minutes=0.1, timeout=300)
    assert {name: s for name, s in instance_statuses(cloud).items() if s != "Stopped"} == {}

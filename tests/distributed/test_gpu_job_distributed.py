"""`gpu_job` on a real distributed Airflow: CeleryExecutor, PostgreSQL, Redis, separate processes.

What only this test shows: the plugin works when every step runs in another process
than the one that parsed the DAG (a Celery worker runs the tasks through the execution
API, the sensor's trigger runs in the triggerer, which loads plugins but no DAGs), with
a real metadata database, and the run is started the way users start it: the REST API.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from simcloud.harness import SimCloud, small_fleet, wait_until
from tests.distributed.processes import Processes
from tests.distributed.stack import REPO, start_airflow, start_postgres, start_redis
from tests.shared import live_reservations, two_gpu_training_job

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1500)]

DAG_ID = "gpu_job"
# A running 1-GPU node too small for the job, a stopped 1-GPU node (never to be chosen:
# per-node fit) and the stopped 2-GPU node that alone can hold it.
NODES = [
    {"name": "t4-running", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Running"},
    {"name": "t4-stopped", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Stopped"},
    {"name": "t4x2-stopped", "instance_type": "ecs.gn6i-c24g1.12xlarge", "status": "Stopped"},
]
TWO_GPU_NODE = "t4x2-stopped"
# A boot of a few seconds (not the unit tests' one second), so the sensor visibly defers.
TIMINGS = {"boot_seconds": 3, "stale_seconds": 1, "device_plugin_seconds": 1}
JOB = two_gpu_training_job("dist")
STEPS = ("place", "start", "wait_gpu_ready", "launch", "release")


@pytest.fixture
def distributed(request):
    """(cloud, airflow, procs): the local cloud and the whole Airflow stack, torn down always;
    on failure the end of every process log is printed first. A test module may set FLEET (a
    simcloud fleet; default NODES with TIMINGS) and AIRFLOW_ENV (more environment for every
    Airflow component)."""
    fleet = getattr(request.module, "FLEET", None) or small_fleet(NODES, timings=TIMINGS)
    base = Path(tempfile.mkdtemp(prefix="gpuboot-distributed-"))
    base.chmod(0o755)  # PostgreSQL runs as the `postgres` user and must reach its directory
    started = time.monotonic()
    try:
        with SimCloud.start(fleet, base / "cloud") as cloud, \
                Processes(base / "logs") as procs:
            procs.extra_logs["simcloud"] = cloud.log_path
            try:
                pg = start_postgres(procs, base / "pg")
                broker = start_redis(procs, base / "redis")
                airflow = start_airflow(procs, base / "airflow", pg, broker, REPO / "dags",
                                        cloud.gpuboot_connections(),   # the product as its ServiceAccount
                                        extra_env=getattr(request.module, "AIRFLOW_ENV", None))
            except BaseException:
                print(procs.tails(80), flush=True)
                raise
            print(f"stack up in {time.monotonic() - started:.0f}s", flush=True)
            yield cloud, airflow, procs
            airflow.api.http.close()  # no idle keep-alive connection for the api-server to wait on
            report = getattr(request.node, "rep_call", None)
            if report is None or report.failed:
                print(procs.tails(80), flush=True)
    finally:
        if os.environ.get("GPUBOOT_DISTRIBUTED_KEEP") == "1":
            print(f"kept {base} (GPUBOOT_DISTRIBUTED_KEEP=1)", flush=True)
        else:
            shutil.rmtree(base, ignore_errors=True)
        print(f"distributed test took {time.monotonic() - started:.0f}s (stack up and down)", flush=True)


def short(task_id: str) -> str:
    return task_id.rsplit(".", 1)[-1]


def follow(api, run_id: str, procs: Processes, timeout: float) -> tuple[str, dict[str, list[str]]]:
    """Poll the run until it ends; returns its state and every state each task was seen in."""
    seen: dict[str, list[str]] = {}

    def finished():
        procs.check_alive()
        for ti in api.task_instances(DAG_ID, run_id):
            states = seen.setdefault(short(ti["task_id"]), [])
            if not states or states[-1] != ti["state"]:
                states.append(ti["state"])
        state = api.run_state(DAG_ID, run_id)
        return state if state in {"success", "failed"} else None

    state = wait_until(finished, timeout=timeout, interval=0.25,
                       message=lambda: f"run {run_id} not finished in {timeout}s; task states seen: {seen}")
    return state, seen


def xcoms(api, run_id: str) -> dict[tuple[str, str, int], object]:
    """Every XCom value of the run, by (short task id, key, map index), through the REST API."""
    listing = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/~/xcomEntries", limit=100)
    listing.raise_for_status()
    values = {}
    for entry in listing.json()["xcom_entries"]:
        r = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{entry['task_id']}/xcomEntries/{entry['key']}",
                    map_index=entry["map_index"], deserialize="true")
        r.raise_for_status()
        value = r.json()["value"]
        values[short(entry["task_id"]), entry["key"], entry["map_index"]] = (
            json.loads(value) if isinstance(value, str) and value[:1] in "[{" else value)
    return values


def secrets_of(cloud) -> dict[str, str]:
    """The credentials the plugin is handed: the ECS AccessKey secret and its ServiceAccount's token."""
    connection = json.loads(cloud.gpuboot_connections().read_text())["kubernetes_default"]
    kubeconfig = yaml.safe_load(Path(connection["extra"]["kube_config_path"]).read_text())
    return {"ECS AccessKey secret": cloud.ecs["access_key_secret"],
            "Kubernetes token": kubeconfig["users"][0]["user"]["token"]}


def files_mentioning(folders: list[Path], secret: str) -> list[str]:
    return [str(f) for folder in folders for f in folder.rglob("*")
            if f.is_file() and secret in f.read_text(errors="replace")]


def task_log(api, run_id: str, step: str) -> str:
    """The text of a step's first try log through the REST API (every step is one task instance)."""
    (ti,) = [t for t in api.task_instances(DAG_ID, run_id) if short(t["task_id"]) == step]
    r = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{ti['task_id']}/logs/1",
                map_index=ti["map_index"], full_content="true")
    r.raise_for_status()
    return "\n".join(str(e.get("event", "")) if isinstance(e, dict) else str(e) for e in r.json()["content"])


def trigger_log_events(home: Path, run_id: str, step: str) -> list[dict]:
    """What triggers logged for a task: only the triggerer writes `<task log>.trigger.<triggerer id>.log`."""
    run_dir = home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}" / f"task_id=gpu_job.{step}"
    files = sorted(run_dir.glob("attempt=*.log.trigger.*.log"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]


def test_gpu_job_runs_across_celery_worker_and_triggerer(distributed):
    cloud, airflow, procs = distributed
    api = airflow.api
    boot_id_before = cloud.core_v1().read_node(TWO_GPU_NODE).status.node_info.boot_id

    wait_until(lambda: procs.check_alive() or api.dag_loaded(DAG_ID), timeout=180, interval=1,
               message=lambda: f"{DAG_ID} not parsed by the dag-processor in 180s")
    run_id = api.trigger(DAG_ID, JOB)
    state, seen = follow(api, run_id, procs, timeout=600)

    assert state == "success", f"task states seen: {seen}\n" + "\n".join(
        f"--- {step} ---\n{task_log(api, run_id, step)[-3000:]}" for step in STEPS if seen.get(step, [""])[-1] != "success")
    assert {step: seen[step][-1] for step in STEPS} == dict.fromkeys(STEPS, "success")

    # The sensor gave its worker slot back (deferred), its trigger ran in the triggerer process,
    # and the task resumed on a worker with the trigger's event.
    wait_log = task_log(api, run_id, "wait_gpu_ready")
    assert "Pausing task as DEFERRED" in wait_log, wait_log[-3000:]
    assert f"node {TWO_GPU_NODE} is GPU-ready" in wait_log, wait_log[-3000:]
    trigger_events = trigger_log_events(airflow.home, run_id, "wait_gpu_ready")
    messages = [e["event"] for e in trigger_events]
    assert any(m.startswith(f"trigger {DAG_ID}/{run_id}/gpu_job.wait_gpu_ready/") and m.endswith("starting")
               for m in messages), messages
    assert any(e.get("logger", "").endswith("NodeGpuReadyTrigger") and TWO_GPU_NODE in e["event"]
               for e in trigger_events), messages
    fired = [e["result"] for e in trigger_events if e["event"] == "Trigger fired event"]
    # the triggerer logs the event by its one-line summary (gpuboot.triggers.events.ShortEvent), not the payload
    assert len(fired) == 1 and fired[0].startswith("TriggerEvent<ready: ") and TWO_GPU_NODE in fired[0], fired

    # The pod ran to completion on the node the plan chose, which this run booted.
    values = xcoms(api, run_id)
    plan = values["place", "return_value", -1]
    assert [a["node"] for a in plan["assignments"]] == [TWO_GPU_NODE]
    assert TWO_GPU_NODE in plan["nodes_to_start"]
    assert cloud.core_v1().read_node(TWO_GPU_NODE).status.node_info.boot_id != boot_id_before
    pods = [p for p in cloud.core_v1().list_pod_for_all_namespaces().items
            if (p.metadata.labels or {}).get("gpuboot.io/job")]
    assert [(p.spec.node_name, p.status.phase) for p in pods] == [(TWO_GPU_NODE, "Succeeded")]
    launch_log = task_log(api, run_id, "launch")
    assert "dist-epoch 1/3" in launch_log and "dist-training-done" in launch_log

    # Nothing stays promised.
    assert live_reservations(cloud) == []

    # No credential reached a log of any Airflow process, a task or trigger log, or an XCom.
    for name, secret in secrets_of(cloud).items():
        assert files_mentioning([procs.log_dir, airflow.home / "logs"], secret) == [], f"{name} in logs"
        assert [k for k, v in values.items() if secret in json.dumps(v, default=str)] == [], f"{name} in XCom"

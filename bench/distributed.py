"""End to end on the real stack: GPUs registered -> job pod Running, with where the seconds go.

The distributed stack of tests/distributed (PostgreSQL, Redis, Airflow 3 on CeleryExecutor:
api-server, scheduler, dag-processor, triggerer, one Celery worker, as separate processes) and the
local cloud. `runs` one-GPU `gpu_job` runs are posted one after another through the REST API, each
booting a stopped node (the bench stops it again afterwards, so the next run boots too). Stamps:

- registered: a watch in this process on the Nodes, the node's first real GPU count after its zero;
- trigger fired: the triggerer's "Trigger fired event" line in the trigger log of wait_gpu_ready;
- task resumed: the first line the resumed wait_gpu_ready logs from its worker (execute_complete);
- launch started: the first line of the launch task's log;
- pod created / Running: a watch in this process on the job's pods.

Every process runs on this one machine, so their clocks agree. Slow (the stack takes minutes to come
up), so it is its own target: `make bench-distributed`.
"""
from __future__ import annotations

import datetime as dt
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

from .common import stats

GPU = "nvidia.com/gpu"
T4 = "ecs.gn6i-c4g1.xlarge"
DAG_ID = "gpu_job"
TIMINGS = {"boot_seconds": 3, "stale_seconds": 1, "device_plugin_seconds": 1}
STAGES = ("trigger fired", "task resumed", "launch started", "pod created", "pod Running")
# Always: a loaded 2-core machine needs more than the 30 s default to parse gpu_job.py in a task process.
BASE_ENV = {"AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120"}
# Operator settings that shorten the hops (README, "End to end on the real stack"); --untuned leaves them out.
TUNED_ENV = {
    # every task try parses gpu_job.py in a process forked from the Celery worker: import the Kubernetes
    # provider and gpuboot once in the worker, so each fork inherits them instead of importing for seconds
    "AIRFLOW__CELERY__EXTRA_CELERY_CONFIG": json.dumps(
        {"imports": ["airflow.providers.cncf.kubernetes.operators.pod", "gpuboot.task_groups.gpu_job"]}),
    # the scheduler's sleep when a loop found nothing to do (default 1 s): the wait before a resumed or
    # downstream task is queued
    "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.25",
}


def job(n: int) -> dict:
    return {"name": f"lat-{n:02d}", "image": "busybox", "command": ["sh", "-c", "echo done"],
            "gpus": 1, "cpu": "1", "memory": "1Gi", "boot_timeout_seconds": 120, "queue_timeout_seconds": 120}


class Watcher:
    """Node and Pod watches in a thread: when each node's GPUs were registered, each job pod seen and Running."""

    def __init__(self, cloud):
        self.cloud = cloud
        self.zeroed: set[str] = set()
        self.registered: dict[str, list[float]] = {}
        self.pods: dict[str, dict[str, float]] = {}
        self.gpu_counts: dict[str, list[tuple[float, int]]] = {}   # every allocatable change seen, for diagnosis
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(kind,), daemon=True) for kind in ("nodes", "pods")]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)

    def _loop(self, kind: str) -> None:
        from kubernetes import watch

        v1 = self.cloud.core_v1()
        lister = v1.list_node if kind == "nodes" else v1.list_pod_for_all_namespaces
        version = None   # carried across re-watches, so no write between two streams is missed
        while not self._stop.is_set():
            try:
                for event in watch.Watch().stream(lister, timeout_seconds=5, **({"resource_version": version} if version else {})):
                    obj, now = event["raw_object"], time.time()
                    version = obj["metadata"].get("resourceVersion") or version
                    (self._node if kind == "nodes" else self._pod)(obj, now)
                    if self._stop.is_set():
                        return
            except Exception as exc:
                if getattr(exc, "status", None) == 410:
                    version = None       # compacted: a fresh list replays the current states
                self.errors.append(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}")
                time.sleep(0.2)  # sleep-ok: back-off before re-watching

    def _node(self, node: dict, now: float) -> None:
        name = node["metadata"]["name"]
        gpus = int(((node.get("status") or {}).get("allocatable") or {}).get(GPU, 0) or 0)
        counts = self.gpu_counts.setdefault(name, [])
        if not counts or counts[-1][1] != gpus:
            counts.append((round(now, 3), gpus))
        if gpus == 0:
            self.zeroed.add(name)
        elif name in self.zeroed:
            self.zeroed.discard(name)
            self.registered.setdefault(name, []).append(now)

    def _pod(self, pod: dict, now: float) -> None:
        if not (pod["metadata"].get("labels") or {}).get("gpuboot.io/job"):
            return
        seen = self.pods.setdefault(pod["metadata"]["name"], {"created": now, "node": None})
        seen["node"] = seen["node"] or pod["spec"].get("nodeName")   # pinned by affinity: bound a moment later
        if (pod.get("status") or {}).get("phase") == "Running":
            seen.setdefault("running", now)


def _stamp(value: str) -> float:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _log_entries(path_glob: list[Path]) -> list[dict]:
    out = []
    for f in path_glob:
        for line in f.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("timestamp"):
                out.append(entry)
    return sorted(out, key=lambda e: e["timestamp"])


def _breakdown(home: Path, run_id: str, watcher: Watcher, pod_before: set[str]) -> dict:
    run_dir = home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}"
    trig = _log_entries(sorted((run_dir / "task_id=gpu_job.wait_gpu_ready").glob("attempt=*.log.trigger.*.log")))
    fired = next(_stamp(e["timestamp"]) for e in trig if e.get("event") == "Trigger fired event")
    wait = _log_entries(sorted(f for f in (run_dir / "task_id=gpu_job.wait_gpu_ready").glob("attempt=*.log")
                               if ".log.trigger." not in f.name))
    resumed = next(_stamp(e["timestamp"]) for e in wait if _stamp(e["timestamp"]) > fired)
    launch = _log_entries(sorted(run_dir.glob("task_id=gpu_job.launch*/**/attempt=*.log"))
                          + sorted(run_dir.glob("task_id=gpu_job.launch*/attempt=*.log")))
    launched = _stamp(launch[0]["timestamp"])
    (pod_name,) = [p for p in watcher.pods if p not in pod_before]
    pod = watcher.pods[pod_name]
    seen = [t for t in watcher.registered.get(pod["node"], []) if t <= pod["created"]]
    if not seen:
        raise RuntimeError(f"no GPU registration of {pod['node']} seen before its pod {pod_name} "
                           f"(fired {fired:.3f}, pod created {pod['created']:.3f}); GPU counts seen: "
                           f"{watcher.gpu_counts.get(pod['node'])}; watch errors: {watcher.errors[-5:]}")
    registered = max(seen)
    stamps = {"registered": registered, "trigger fired": fired, "task resumed": resumed,
              "launch started": launched, "pod created": pod["created"], "pod Running": pod["running"]}
    steps, previous = {}, "registered"
    for stage in STAGES:
        steps[f"{previous} -> {stage}"] = round(stamps[stage] - stamps[previous], 3)
        previous = stage
    return {"run_id": run_id, "node": pod["node"], "pod": pod_name,
            "registered_to_running_s": round(stamps["pod Running"] - registered, 3), "steps_s": steps}


def run(workdir: Path, quick: bool = False, runs: int = 5, tuned: bool = True) -> dict:
    from scripts.demo import DemoError  # noqa: F401  (the stack's API client lives there)
    from simcloud.harness import SimCloud, small_fleet, wait_until
    from tests.distributed.processes import Processes
    from tests.distributed.stack import REPO, start_airflow, start_postgres, start_redis

    count = 2 if quick else runs
    extra_env = {**BASE_ENV, **(TUNED_ENV if tuned else {})}
    nodes = [{"name": f"t4-{i}", "instance_type": T4, "status": "Stopped"} for i in range(count)]
    fleet = small_fleet(nodes, timings=TIMINGS)
    base = Path(tempfile.mkdtemp(prefix="gpuboot-bench-distributed-"))
    base.chmod(0o755)     # PostgreSQL runs as `postgres` when we are root
    rows, began = [], time.monotonic()
    try:
        with SimCloud.start(fleet, base / "cloud") as cloud, Processes(base / "logs") as procs:
            pg = start_postgres(procs, base / "pg")
            broker = start_redis(procs, base / "redis")
            airflow = start_airflow(procs, base / "airflow", pg, broker, REPO / "dags", cloud.gpuboot_connections(),
                                    extra_env=extra_env)
            stack_up = time.monotonic() - began
            api = airflow.api
            wait_until(lambda: procs.check_alive() or _patient(api.dag_loaded, DAG_ID), timeout=300, interval=1)
            with Watcher(cloud) as watcher:
                for n in range(count):
                    before = set(watcher.pods)
                    run_id = api.trigger(DAG_ID, job(n))
                    state = wait_until(lambda: procs.check_alive() or (
                        s if (s := _patient(api.run_state, DAG_ID, run_id)) in ("success", "failed") else None),
                        timeout=300, interval=0.5)
                    if state != "success":
                        raise RuntimeError(f"run {run_id} ended {state}")
                    wait_until(lambda: len(set(watcher.pods) - before) == 1, timeout=10)
                    row = _breakdown(airflow.home, run_id, watcher, before)
                    rows.append(row)
                    _stop_node(cloud, row["node"])
            airflow.api.http.close()
    finally:
        logs = base / "airflow" / "logs"          # the stamps' sources, kept for whoever reads a figure or an error
        if logs.is_dir():
            shutil.copytree(logs, workdir / "airflow-logs", dirs_exist_ok=True)
            print(f"distributed: the Airflow logs are kept in {workdir / 'airflow-logs'}", flush=True)
        shutil.rmtree(base, ignore_errors=True)
    totals = [r["registered_to_running_s"] for r in rows]
    return {
        "runs": len(rows), "timings": TIMINGS, "stack_up_s": round(stack_up, 1),
        "registered_to_running_s": stats(totals),
        "steps_s": {step: stats([r["steps_s"][step] for r in rows]) for step in rows[0]["steps_s"]} if rows else {},
        "per_run": rows,
        "tuned": tuned, "airflow_settings": extra_env,
        "notes": [("registered and pod stamps: watches in the bench process; the others: the Airflow logs' "
                  "timestamps (triggerer and worker on the same machine).")],
    }


def _patient(call, *args):
    """`call(*args)`, or None when the api-server did not answer in time (a loaded machine): ask again later."""
    import httpx

    try:
        return call(*args)
    except httpx.TransportError:
        return None


def _stop_node(cloud, node: str) -> None:
    """Stop the node the run booted, so the next run boots one too (running nodes are preferred)."""
    from alibabacloud_ecs20140526 import models as ecs_models

    from simcloud.harness import wait_until

    iid = cloud.instance_id(node)
    cloud.ecs_client().stop_instances(ecs_models.StopInstancesRequest(
        region_id=cloud.region, instance_id=[iid], stopped_mode="StopCharging"))
    wait_until(lambda: next(i["status"] for i in cloud.state()["instances"] if i["instance_id"] == iid) == "Stopped",
               timeout=60)

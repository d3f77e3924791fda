"""End-to-end overhead: DAG run triggered -> pod Running, minus the emulated physical boot.

In one local cloud and one process, with dag.test():
- the `gpu_job` DAG (place -> start -> wait_gpu_ready -> launch -> release) for a
  2-GPU job that only a stopped 2-GPU node can hold, so it needs a boot;
- a plain KubernetesPodOperator pinned to an already running 1-GPU node.
"Running" is when a watch on pods sees the job's pod reach phase Running. Overhead of
the boot case = that time minus the emulated start + boot + stale + device-plugin
delays; the node is stopped again between repeats so every run needs a boot.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import Sampler, local_cloud

T4, T4X2 = "ecs.gn6i-c4g1.xlarge", "ecs.gn6i-c24g1.12xlarge"
# simcloud's default physical delays; kubelet heartbeat at its real default (10 s)
TIMINGS = {"start_seconds": 2.0, "boot_seconds": 3.0, "stale_seconds": 1.0, "device_plugin_seconds": 2.0,
           "heartbeat_seconds": 10.0, "stop_seconds": 1.0, "pod_start_seconds": 0.5}
PHYSICAL = sum(TIMINGS[k] for k in ("start_seconds", "boot_seconds", "stale_seconds", "device_plugin_seconds"))
JOB = {"name": "bench-boot", "image": "python:3.11-slim", "command": ["python", "-c", "print('bench pod ran', flush=True)"], "gpus": 2, "cpu": "2",
       "memory": "8Gi", "settle_seconds": 5, "boot_timeout_seconds": 120, "queue_timeout_seconds": 60}
RUNNING_NODE, STOPPED_NODE = "t4-running", "t4x2-stopped"   # t4-running: see bench/dags/bench_plain_kpo.py


class PodsRunning(Sampler):
    """A watch on all pods, in a thread: when each pod was first seen at all (`seen`), first seen
    Running or done (`at`) and first seen done (`ended`), epoch seconds, and its last phase (`phase`)."""

    def __init__(self, cloud):
        super().__init__()
        self.cloud, self.at, self.seen, self.ended, self.phase = cloud, {}, {}, {}, {}

    def sample(self):
        from kubernetes import watch

        core = self.cloud.core_v1()
        while not self._stop.is_set():
            for event in watch.Watch().stream(core.list_pod_for_all_namespaces, timeout_seconds=2):
                pod = event["object"]
                self.seen.setdefault(pod.metadata.name, time.time())
                self.phase[pod.metadata.name] = pod.status.phase
                if pod.status.phase in ("Running", "Succeeded", "Failed"):
                    self.at.setdefault(pod.metadata.name, time.time())
                if pod.status.phase in ("Succeeded", "Failed"):
                    self.ended.setdefault(pod.metadata.name, time.time())

    def first_after(self, since: float, match) -> tuple[str, float] | None:
        found = [(t, n) for n, t in self.at.items() if t >= since and match(n)]
        return (min(found)[1], min(found)[0]) if found else None


def _migrate_db() -> None:
    import airflow.configuration
    from airflow.configuration import conf

    env = {**__import__("os").environ, "AIRFLOW_HOME": airflow.configuration.AIRFLOW_HOME,
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": conf.get("database", "sql_alchemy_conn")}
    done = subprocess.run([str(Path(sys.executable).with_name("airflow")), "db", "migrate"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed: {done.stderr[-2000:]}")


def _dags() -> dict:
    """gpu_job and the plain-KPO baseline, from the scratch DAG folder `python -m bench` set up."""
    from airflow.configuration import conf
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=conf.get("core", "dags_folder"), safe_mode=False)
    if bag.import_errors:
        raise RuntimeError(f"DAGs do not import: {bag.import_errors}")
    return bag.dags


def _check(dag_run, name: str, log_path: Path) -> None:
    """Every work task must have succeeded (the run's own state follows its leaf, the release step)."""
    states = {ti.task_id.rsplit(".", 1)[-1]: ti.state for ti in dag_run.get_task_instances()}
    bad = {k: v for k, v in states.items() if v != "success"}
    if bad:
        raise RuntimeError(f"{name}: tasks not successful: {bad}; see {log_path}")


def _task_seconds(dag_run) -> dict[str, float]:
    out = {}
    for ti in dag_run.get_task_instances():
        if ti.start_date and ti.end_date:
            out[ti.task_id.rsplit(".", 1)[-1]] = round((ti.end_date - ti.start_date).total_seconds(), 2)
    return out


def _stop(cloud, node: str) -> None:
    from gpuboot.hooks.ecs import EcsHook
    from simcloud.harness import wait_until

    ecs, instance_id = EcsHook(), cloud.instance_id(node)
    ecs.stop_instances([instance_id])
    wait_until(lambda: ecs.statuses([instance_id]).get(instance_id) == "Stopped" and not cloud.node_ready(node),
               timeout=60, interval=0.2, message=f"node {node} did not stop within 60 s")


def run(workdir: Path, quick: bool = False, repeats: int = 3) -> dict:
    from simcloud.harness import small_fleet

    repeats = 1 if quick else repeats
    _migrate_db()
    fleet = small_fleet([{"name": RUNNING_NODE, "instance_type": T4, "status": "Running"},
                         {"name": STOPPED_NODE, "instance_type": T4X2, "status": "Stopped"}], timings=TIMINGS)
    boot, plain, phases = [], [], []
    log_path = Path(os.environ.get("GPUBOOT_BENCH_LOG", "the bench log"))
    with local_cloud(fleet, workdir / "cloud") as cloud, PodsRunning(cloud) as pods:
        dags = _dags()
        gpu_dag, plain_dag = dags["gpu_job"], dags["bench_plain_kpo"]
        plain_dag.test(conn_file_path=str(cloud.connections_file))   # warm-up: first DB/bundle sync, not counted
        for i in range(repeats):
            began = time.time()
            run_ = plain_dag.test(conn_file_path=str(cloud.connections_file))
            hit = pods.first_after(began, lambda n: n.startswith("bench-plain"))
            _check(run_, f"plain KubernetesPodOperator run {i}", log_path)
            if hit is None:
                raise RuntimeError(f"plain KubernetesPodOperator run {i}: no pod seen Running; see {log_path}")
            plain.append(hit[1] - began)

            began = time.time()
            run_ = gpu_dag.test(conn_file_path=str(cloud.connections_file), run_conf=JOB)
            hit = pods.first_after(began, lambda n: n.startswith(JOB["name"]))
            _check(run_, f"gpu_job run {i}", log_path)
            if hit is None:
                raise RuntimeError(f"gpu_job run {i}: no pod seen Running; see {log_path}")
            boot.append(hit[1] - began)
            phases.append(_task_seconds(run_))
            _stop(cloud, STOPPED_NODE)
    median = statistics.median
    rows = [
        {"case": "gpu_job, needs a boot", "trigger_to_running_s": round(median(boot), 2),
         "emulated_physical_s": PHYSICAL, "overhead_s": round(median(boot) - PHYSICAL, 2)},
        {"case": "plain KubernetesPodOperator, running node", "trigger_to_running_s": round(median(plain), 2),
         "emulated_physical_s": 0.0, "overhead_s": round(median(plain), 2)},
        {"case": "difference: what gpuboot adds beyond the physical boot",
         "overhead_s": round(median(boot) - PHYSICAL - median(plain), 2)},
    ]
    per_task = {task: round(median(p[task] for p in phases if task in p), 2) for task in phases[0]}
    return {"repeats": repeats, "timings": TIMINGS, "settle_seconds": JOB["settle_seconds"], "rows": rows,
            "boot_runs_s": [round(x, 2) for x in boot], "plain_runs_s": [round(x, 2) for x in plain],
            "gpu_job_task_seconds": phases, "gpu_job_task_seconds_median": per_task,
            "notes": [(f"medians of {repeats} runs each, alternating, same cloud and process (dag.test(), after one "
                      "unmeasured warm-up run); both include dag.test()'s own per-run DAG sync."),
                      "gpu_job task durations (median s): " + ", ".join(f"{k} {v:g}" for k, v in per_task.items()),
                      (f"the boot case takes the readiness fast path: the trigger sees the kubelet's reset, so the "
                      f"job's settle window ({JOB['settle_seconds']} s) is not held.")]}

"""Pieces shared by the stress test and `make chaos`: a GPU job DAG, the cloud's connections
for the hooks, many runs at once, injected 409 bursts, and what pods and instances are left."""
from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from chaos.runner import DagRunner, RunResult
from gpuboot.core.model import LABEL_JOB


@contextlib.contextmanager
def cloud_connections(connections_file: Path) -> Iterator[None]:
    """The cloud's Airflow connections as AIRFLOW_CONN_* (what the hooks read), for the block."""
    saved = dict(os.environ)
    for conn_id, conn in json.loads(Path(connections_file).read_text()).items():
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(conn)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("AIRFLOW_CONN_")]:
            if key in saved:
                os.environ[key] = saved[key]
            else:
                del os.environ[key]


def api_client_factory(kubeconfig: Path) -> Callable:
    def new_client():
        from kubernetes import config
        return config.new_client_from_config(config_file=str(kubeconfig))
    return new_client


def job_dag(dag_id: str = "gpu_job", **group_kwargs):
    """A DAG that is just the product's task group, taking the job from the run's params (as
    dags/gpu_job.py does; built here so tests can shorten timings such as busy_poll_seconds)."""
    from airflow.sdk import DAG

    from gpuboot.task_groups.gpu_job import gpu_job_group

    with DAG(dag_id=dag_id, schedule=None, catchup=False) as dag:
        gpu_job_group(**group_kwargs)
    return dag


def run_all(runner: DagRunner, confs: Sequence[dict], prefix: str = "run", burst: bool = False) -> list[RunResult]:
    """Start every run (one thread each) and wait for all of them. Without `burst` each run
    starts as soon as its thread is up, one after another; with it every run waits at a barrier
    until all threads are up and all are released in the same instant (their place steps race)."""
    gate = threading.Barrier(len(confs)) if burst else None

    def one(run_id: str, conf: dict) -> RunResult:
        if gate is not None:
            gate.wait()
        return runner.run(run_id, conf)

    with ThreadPoolExecutor(max_workers=len(confs), thread_name_prefix=prefix) as pool:
        futures = [pool.submit(one, f"{prefix}-{i:03d}", conf) for i, conf in enumerate(confs)]
        return [f.result() for f in futures]


class ConflictBursts:
    """Every `every` seconds, make the next `size` ConfigMap writes within `window` seconds fail with
    409 Conflict. A burst ends with its window, as real contention ends when the other writers have
    written: without the window a single writer slower than `size` writes per `every` (a survey on a
    loaded machine) met a fresh burst on every attempt and never wrote at all."""

    def __init__(self, cloud, size: int = 3, every: float = 1.0, window: float = 0.5) -> None:
        self.cloud, self.size, self.every, self.window = cloud, size, every, min(window, every)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="conflict-bursts")
        self.bursts = 0

    def _loop(self) -> None:
        while not self._stop.wait(self.every - self.window):
            self.cloud.set_faults(k8s_conflict_burst=self.size)
            self.bursts += 1
            if self._stop.wait(self.window):
                break
            self.cloud.set_faults(k8s_conflict_burst=0)

    def __enter__(self) -> ConflictBursts:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.cloud.set_faults(k8s_conflict_burst=0)


def job_pods(core_v1) -> dict[str, list]:
    """Pods launched by gpuboot, by job id."""
    pods: dict[str, list] = {}
    for pod in core_v1.list_pod_for_all_namespaces(label_selector=LABEL_JOB).items:
        pods.setdefault(pod.metadata.labels[LABEL_JOB], []).append(pod)
    return pods


def first_placement(result: RunResult) -> str | None:
    """What the first decisive placement of a run said: 'fits' (a plan), 'busy' (deferred to
    wait for capacity) or 'refused'; tries that failed for other reasons (contention) are skipped."""
    decided = first_decision(result)
    return decided[0] if decided else None


def first_decision(result: RunResult) -> tuple[str, float] | None:
    """(first_placement's answer, when it was given)."""
    for attempt in result.history:
        if attempt.task_id.endswith(".place") and attempt.map_index == -1:
            if attempt.status == "success":
                return "fits", attempt.at
            if attempt.status == "deferred" and attempt.detail.endswith("WakeUpTrigger"):
                return "busy", attempt.at
            if attempt.status == "failed" and "can never run" in attempt.detail:
                return "refused", attempt.at
    return None

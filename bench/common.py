"""Helpers shared by the benchmark parts: timing, the local cloud with Airflow connections, growth."""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gpuboot.replay.metrics import percentile


def best_of(call: Callable[[], object], repeat: int, clock: Callable[[], float] = time.perf_counter
            ) -> tuple[float, object]:
    """Fastest of `repeat` runs (seconds) and the last result: the usual way to time pure code.
    `clock=time.process_time` counts this process's CPU only, which the other work on a shared
    machine inflates far less than the wall clock."""
    best, result = math.inf, None
    for _ in range(repeat):
        began = clock()
        result = call()
        best = min(best, clock() - began)
    return best, result


def timed(call: Callable[[], object]) -> tuple[float, object]:
    return best_of(call, 1)


def growth_exponent(n1: float, t1: float, n2: float, t2: float) -> float:
    """k in t ~ n^k from two points: 1 = linear, 2 = quadratic."""
    return math.log(t2 / t1) / math.log(n2 / n1)


def stats(values: list[float]) -> dict:
    """median, p95, mean, min, max of `values` (seconds), rounded to the millisecond."""
    def r(v):
        return None if v is None else round(v, 3)
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": r(statistics.median(values)), "p95": r(percentile(values, 95)),
            "mean": r(statistics.fmean(values)), "min": r(min(values)), "max": r(max(values))}


class Sampler:
    """A daemon thread running `sample()` from `with` until its end (`_stop` tells it to finish)."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


@contextlib.contextmanager
def local_cloud(fleet: dict, workdir: Path, ready_timeout: float = 120.0) -> Iterator:
    """simcloud running `fleet` with gpuboot's manifests applied (its job namespace, RBAC), and its
    Airflow connections exported as AIRFLOW_CONN_* for the hooks."""
    from simcloud.harness import GPUBOOT_MANIFESTS, SimCloud

    saved = dict(os.environ)
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    with SimCloud.start(fleet, workdir, ready_timeout=ready_timeout) as cloud:
        cloud.apply(*GPUBOOT_MANIFESTS)
        try:
            export_connections(cloud.connections_file)
            yield cloud
        finally:
            os.environ.clear()
            os.environ.update(saved)


def export_connections(path: Path) -> None:
    """This process's Airflow connections: every one of the connections file `path`, as AIRFLOW_CONN_*."""
    for conn_id, conn in json.loads(Path(path).read_text()).items():
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(conn)


@contextlib.contextmanager
def output_to(path: Path):
    """Send this process's stdout/stderr (file descriptors, so Airflow's log handlers too) to `path`."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def write_json(path: Path, data: object) -> None:
    """A figure file: `data` as indented JSON at `path` (its folder made when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")

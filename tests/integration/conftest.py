"""A local cloud per test for the gpuboot adapters and operators, with short emulated timings,
the shipped namespaces and RBAC applied (the jobs' namespace, gpu-jobs, exists), and the Airflow
connections it writes exposed as AIRFLOW_CONN_* for the hooks. The adapters here act as the
admin (the tests also write through them); the e2e, stress, chaos and distributed tests run the
product as its ServiceAccount, and test_rbac.py checks those rights against the cloud."""
from __future__ import annotations

import contextlib
import json

import pytest

from simcloud.harness import GPUBOOT_MANIFESTS, SimCloud, small_fleet, wait_until  # noqa: F401  (re-exported)

T4 = "ecs.gn6i-c4g1.xlarge"
T4X2 = "ecs.gn6i-c24g1.12xlarge"
CPU = "ecs.g7.xlarge"

# One running and two stopped GPU nodes (4 GPUs in all) and a CPU node. The stale phase
# (new bootID, Ready, old GPU count) is long enough for the weakened-rule test to bind a
# pod inside it, and shorter than the settle window the readiness tests use.
FLEET = small_fleet([
    {"name": "gpu-run", "instance_type": T4, "status": "Running"},
    {"name": "gpu-stop", "instance_type": T4, "status": "Stopped"},
    {"name": "gpu2-stop", "instance_type": T4X2, "status": "Stopped"},
    {"name": "cpu-1", "instance_type": CPU, "status": "Running"},
], timings={"stale_seconds": 1.0, "device_plugin_seconds": 0.5})
SETTLE_SECONDS = 2.0


def with_job_namespaces(sim: SimCloud) -> SimCloud:
    """Apply deploy/kubernetes/ (namespace.yaml creates gpu-jobs, where jobs run by default)."""
    sim.apply(*GPUBOOT_MANIFESTS)
    return sim


def expose_connections(connections_file, monkeypatch) -> None:
    for conn_id, conn in json.loads(open(connections_file).read()).items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))


@contextlib.contextmanager
def running_cloud(fleet: dict, tmp_path, monkeypatch):
    """`fleet` running, the shipped manifests applied, kubernetes_default / alibaba_ecs_default pointing at it."""
    with SimCloud.start(fleet, tmp_path / "simcloud") as sim:
        with_job_namespaces(sim)
        expose_connections(sim.connections_file, monkeypatch)
        yield sim


@pytest.fixture
def cloud(tmp_path, monkeypatch):
    """The test fleet above, running (a module may override it with its own fleet: running_cloud)."""
    with running_cloud(FLEET, tmp_path, monkeypatch) as sim:
        yield sim

"""End-to-end fixtures: one throwaway Airflow home per session, the local cloud per test.

The throwaway AIRFLOW_HOME is set by tests/conftest.py before anything imports Airflow; the
session fixture here migrates whatever database the imported Airflow really uses, so the
two can never disagree.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# One running GPU node too small for a 2-GPU job, a stopped 1-GPU node (never to be
# chosen for it: per-node fit) and a stopped 2-GPU node, the only one that can hold it alone.
FLEET_NODES = [
    {"name": "t4-running", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Running"},
    {"name": "t4-stopped", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Stopped"},
    {"name": "t4x2-stopped", "instance_type": "ecs.gn6i-c24g1.12xlarge", "status": "Stopped"},
]

# Read by Airflow at every lookup, so these hold even if Airflow is already imported.
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(REPO / "plugins")


@pytest.fixture(scope="session", autouse=True)
def airflow_db():
    """`airflow db migrate` once per session, on the database this process uses."""
    import airflow.configuration
    from airflow.configuration import conf

    env = dict(
        os.environ,
        AIRFLOW_HOME=airflow.configuration.AIRFLOW_HOME,
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=conf.get("database", "sql_alchemy_conn"),
    )
    airflow_cli = Path(sys.executable).with_name("airflow")
    done = subprocess.run([str(airflow_cli), "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"airflow db migrate failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture
def cloud(tmp_path):
    """The local cloud with the e2e fleet (fast emulated timings), fresh for each test."""
    from simcloud.harness import SimCloud, small_fleet

    with SimCloud.start(small_fleet(FLEET_NODES), tmp_path / "cloud") as sim:
        yield sim


@pytest.fixture
def connections(cloud) -> Path:
    """The product's Airflow connections at one fixed path for the whole session: Kubernetes as
    the ServiceAccount deploy/kubernetes/rbac.yaml binds (the shipped manifests applied first, see
    SimCloud.gpuboot_connections), ECS from the cloud; the test's own reads stay admin.

    Pass this, not cloud.connections_file, to dag.test(conn_file_path=...): the Task SDK
    builds a custom secrets backend once per process (airflow.sdk.configuration.
    ensure_secrets_loaded), so a later dag.test() with another file path would still read
    the first file. The backend re-reads its file on every lookup, so a fixed path works.
    """
    import airflow.configuration

    path = Path(airflow.configuration.AIRFLOW_HOME) / "e2e-connections.json"
    shutil.copyfile(cloud.gpuboot_connections(), path)
    return path


def task_log(output: str, dag_run, task: str) -> str:
    """What was logged while task `task` (the id after the group prefix; every map index) ran.

    dag.test() runs tasks and their triggers in-process, one at a time, logging to stdout
    with a UTC timestamp per entry; an entry belongs to the task instance whose
    start..end window holds its timestamp (continuation lines follow their entry).
    """
    windows = [
        (ti.start_date, ti.end_date)
        for ti in dag_run.get_task_instances()
        if ti.task_id.rsplit(".", 1)[-1] == task and ti.start_date and ti.end_date
    ]
    parts, inside = [], False
    for line in output.splitlines():
        stamp = _TIMESTAMP.match(line)
        if stamp:
            at = dt.datetime.fromisoformat(stamp.group(1)).replace(tzinfo=dt.UTC)
            inside = any(start <= at <= end for start, end in windows)
        if inside:
            parts.append(line)
    return "\n".join(parts)


_TIMESTAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z ")

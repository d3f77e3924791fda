"""The `gpuboot_idle_scaledown` DAG with dag.test() against the local cloud."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuboot.core.idle import ANNOTATION_IDLE_SINCE
from tests.e2e.conftest import REPO

RUNNING = "t4-running"      # the e2e fleet's running, managed, idle GPU node


@pytest.fixture(autouse=True)
def fresh_secrets_backends():
    """Airflow 3.3 memoises the first custom secrets backend per process, so a later dag.test()
    with another conn_file_path (another local cloud) would read the first one's connections.
    Forget it before and after each test. (Belongs in tests/e2e/conftest.py.)"""
    from airflow.sdk import configuration

    configuration._secrets_backend_cache.clear()
    yield
    configuration._secrets_backend_cache.clear()


@pytest.fixture(scope="module")
def scaledown_dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "idle_scaledown.py"), safe_mode=False)
    assert bag.import_errors == {}
    return bag.dags["gpuboot_idle_scaledown"]


def idle_since(cloud) -> str | None:
    return (cloud.core_v1().read_node(RUNNING).metadata.annotations or {}).get(ANNOTATION_IDLE_SINCE)


def test_schedule_is_periodic_without_catchup_one_run_at_a_time(scaledown_dag):
    assert scaledown_dag.catchup is False and scaledown_dag.max_active_runs == 1
    assert scaledown_dag.schedule == dt.timedelta(minutes=5)
    assert scaledown_dag.params["dry_run"] is False and scaledown_dag.params["idle_minutes"] == 10
    assert scaledown_dag.params["spare_minutes"] == 240      # gpuboot.core.idle.DEFAULT_SPARE_SECONDS, the replay's


def test_it_runs_from_the_start_even_where_new_dags_are_created_paused(scaledown_dag):
    """Issue 9: created paused (dags_are_paused_at_creation), it never stopped the nodes jobs booted."""
    assert scaledown_dag.is_paused_upon_creation is False


def run(dag, cloud, capfd, conf: dict) -> dict:
    """One dag.test() run with every param given (dag.test() keeps earlier runs' conf in the
    shared DAG object's params); the task's summary (its XCom return value)."""
    dag_run = dag.test(conn_file_path=str(cloud.gpuboot_connections()),   # as the product's ServiceAccount
                       run_conf={"dry_run": False, "idle_minutes": 10, **conf})
    output = capfd.readouterr().out
    assert dag_run.state == "success", output[-3000:]
    return dag_run.get_task_instance("scale_down").xcom_pull(task_ids="scale_down")


def test_dry_run_decides_for_every_managed_node_and_writes_nothing(cloud, scaledown_dag, capfd):
    summary = run(scaledown_dag, cloud, capfd, {"dry_run": True})

    assert summary["dry_run"] is True and summary["idle_seconds"] == 600 and summary["spare_seconds"] == 4 * 3600
    assert {n: d["verdict"] for n, d in summary["decisions"].items()} == {
        RUNNING: "idle", "t4-stopped": "stopped", "t4x2-stopped": "stopped"}
    assert idle_since(cloud) is None


def test_scheduled_run_records_idle_since(cloud, scaledown_dag, capfd):
    summary = run(scaledown_dag, cloud, capfd, {"idle_minutes": 1})

    assert summary["dry_run"] is False and summary["stopped"] == []
    assert summary["decisions"][RUNNING] == {"verdict": "idle", "reason": "idle for 0.0 s < 60.0 s"}
    assert idle_since(cloud) is not None


def test_bad_params_are_rejected_at_trigger_time(scaledown_dag):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match="idle_minutes"):
        scaledown_dag.test(run_conf={"idle_minutes": 0})
    with pytest.raises(ParamValidationError, match="spare_minutes"):
        scaledown_dag.test(run_conf={"spare_minutes": -1})

"""What the `gpu_job` trigger refuses, through dag.test(): at trigger time where the Params form
can check it, else at the place step before anything is reserved or booted."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import REPO, task_log
from tests.e2e.test_gpu_job import JOB, all_pods, node_boot_id, states
from tests.shared import live_reservations


def parse_gpu_job():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "gpu_job.py"), safe_mode=False)
    assert bag.import_errors == {}
    return bag.dags["gpu_job"]


@pytest.fixture(scope="module")
def gpu_job_dag():
    return parse_gpu_job()


@pytest.mark.parametrize(("change", "param"), [
    ({"args": ["--data", "x" * 200_000]}, "args"),            # issue 9: over Linux's per-argument limit
    ({"command": ["python", "-c", "x" * 200_000]}, "command"),
    ({"env": {"BLOB": "x" * 200_000}}, "env"),
])
def test_container_input_no_exec_can_take_is_refused_at_trigger_time(gpu_job_dag, change, param):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=param):
        gpu_job_dag.test(run_conf=dict(JOB, **change))


def test_a_boot_timeout_below_the_documented_minimum_is_refused_at_trigger_time(monkeypatch):
    """Issue 9: boot_timeout_seconds 1 (settle 5) was accepted and took healthy nodes out of service."""
    from airflow.sdk.exceptions import ParamValidationError

    monkeypatch.delenv("GPUBOOT_MIN_BOOT_SECONDS", raising=False)        # the real-cloud default, 60 s
    dag = parse_gpu_job()
    with pytest.raises(ParamValidationError, match="boot_timeout_seconds"):
        dag.test(run_conf=dict(JOB, boot_timeout_seconds=1, settle_seconds=5))


def test_unknown_keys_in_the_trigger_conf_fail_place_naming_the_likely_field(cloud, connections, gpu_job_dag,
                                                                            capfd):
    """Issue 9: {"gpu": 2, "gpu_modle": "A100", "memroy": "64Gi"} ran as a 1-GPU, 4Gi job and succeeded."""
    conf = {k: v for k, v in JOB.items() if k not in ("gpus", "memory")}
    conf.update({"gpu": 2, "gpu_modle": "A100", "memroy": "64Gi"})
    boot_before = node_boot_id(cloud, "t4-stopped")

    dag_run = gpu_job_dag.test(conn_file_path=str(connections), run_conf=conf)
    output = capfd.readouterr().out

    assert dag_run.state == "failed" and states(dag_run)["place"] == "failed", states(dag_run)
    assert "DAG run params: gpu: unknown field. Did you mean 'gpus'?" in task_log(output, dag_run, "place")
    assert live_reservations(cloud) == [] and node_boot_id(cloud, "t4-stopped") == boot_before
    assert [p for p in all_pods(cloud) if (p.metadata.labels or {}).get("gpuboot.io/job")] == []


@pytest.mark.parametrize("namespace", ["kube-system", "default"])
def test_a_namespace_outside_the_job_namespaces_is_refused_at_trigger_time(gpu_job_dag, namespace):
    """The form offers GPUBOOT_JOB_NAMESPACES only (an enum): whoever may trigger gpu_job cannot
    aim its pods at kube-system (and the ServiceAccount could not create them there: test_rbac.py)."""
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match="namespace"):
        gpu_job_dag.test(run_conf=dict(JOB, namespace=namespace))


@pytest.mark.parametrize(("change", "words"), [
    ({"name": "Bad_Name"}, "'Bad_Name' is not a \"Kubernetes name: use lower case letters, digits and '-', at most 63"),
    ({"gpus": -1}, "-1 is not a 'whole number of GPUs: 0 or more (0 runs on CPU only)'"),
])
def test_trigger_time_refusals_say_the_rule_in_words(gpu_job_dag, change, words):
    """Issue 35 #9: the name refusal quoted the regex ("does not match '^[a-z0-9]...'"), gpus -1 said
    "less than or equal to the minimum of -1"."""
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError) as refused:
        gpu_job_dag.test(run_conf=dict(JOB, **change))
    first = str(refused.value).splitlines()[0]
    assert words in first and "does not match" not in first and "minimum of" not in first, first

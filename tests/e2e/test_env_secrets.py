"""Issue 35 #5: a job's env values never reach XCom, rendered fields, logs or API responses; values can
come from Kubernetes Secrets (secret_env, env_from_secrets) without passing through Airflow at all.

One `gpu_job` run with dag.test() on the local cloud: its env carries a distinctive value, its
secret_env and env_from_secrets read two Secrets of the job's namespace. The pod proves it got all
three (it prints a digest of them, never them); then every log line of the run, every XCom, every
rendered template field, and the REST API's and the fleet API's answers about the run are searched
for the three values. The one place a plain env value may stay is the run's own conf, which is the
user's input (the reason secrets belong in Secrets)."""
from __future__ import annotations

import base64
import hashlib
import json

import pytest
from fastapi.testclient import TestClient

from tests.e2e.conftest import task_log
from tests.e2e.test_gpu_job import gpu_job_dag, states  # noqa: F401 (the module-scoped DAG fixture)

PLAIN = "plainvalue-5e2a9c71d4"           # in the job's env
FROM_KEY = "keyvalue-0b8f3e6a19"          # in Secret hf-token, key token (secret_env)
FROM_SECRET = "envfromvalue-7d41c2b8e5"   # in Secret wandb, key WANDB_API_KEY (env_from_secrets)
VALUES = (PLAIN, FROM_KEY, FROM_SECRET)
DIGEST = hashlib.sha256("|".join(VALUES).encode()).hexdigest()
PROBE = ("import hashlib, os\n"
         "got = '|'.join(os.environ.get(k, '') for k in ('API_TOKEN', 'HF_TOKEN', 'WANDB_API_KEY'))\n"
         "print('env-digest', hashlib.sha256(got.encode()).hexdigest(), flush=True)\n")
JOB = {"name": "secret-env", "image": "python:3.11-slim", "command": ["python", "-c", PROBE],
       "gpus": 2, "cpu": "1", "memory": "1Gi", "settle_seconds": 1, "boot_timeout_seconds": 120,
       "queue_timeout_seconds": 60, "env": {"API_TOKEN": PLAIN, "EPOCHS": "3"},
       "secret_env": {"HF_TOKEN": "hf-token/token"}, "env_from_secrets": ["wandb"]}


def make_secret(cloud, name: str, data: dict[str, str]) -> None:
    from kubernetes import client

    body = client.V1Secret(metadata=client.V1ObjectMeta(name=name),
                           data={k: base64.b64encode(v.encode()).decode() for k, v in data.items()})
    cloud.core_v1().create_namespaced_secret("gpu-jobs", body)


@pytest.fixture
def api(monkeypatch, tmp_path):
    """Airflow's REST API (the API server's app) and gpuboot's fleet API, in process on the test's
    database, with an admin's token."""
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER",
                       "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager")
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "test-secret-for-the-env-secrets-test-only-" + "x" * 32)
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", str(tmp_path / "passwords.json"))
    from airflow.api_fastapi.app import create_app, purge_cached_app
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    from gpuboot.ui.fleet_api import create_app as fleet_app

    purge_cached_app()
    airflow = TestClient(create_app())
    from airflow.api_fastapi.app import get_auth_manager

    token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    auth = {"Authorization": f"Bearer {token}"}
    yield airflow, TestClient(fleet_app()), auth
    purge_cached_app()


def api_answers(airflow, fleet, auth, dag_run) -> dict[str, str]:
    """What the APIs say about the run, by URL: its task instances (with their rendered fields), every
    XCom entry's value, every task's log, and the fleet API's run tab."""
    base = f"/api/v2/dags/{dag_run.dag_id}/dagRuns/{dag_run.run_id}"
    out = {}

    def get(path: str, client=airflow, **params) -> dict:
        r = client.get(path, headers=auth, params=params)
        assert r.status_code == 200, (path, r.status_code, r.text[:500])
        out[path] = r.text
        return r.json()

    get(base)
    tis = get(f"{base}/taskInstances")["task_instances"]
    for ti in tis:
        get(f"{base}/taskInstances/{ti['task_id']}")
        for entry in get(f"{base}/taskInstances/{ti['task_id']}/xcomEntries")["xcom_entries"]:
            get(f"{base}/taskInstances/{ti['task_id']}/xcomEntries/{entry['key']}", deserialize="true")
        if ti["try_number"]:
            get(f"{base}/taskInstances/{ti['task_id']}/logs/{ti['try_number']}", full_content="true")
    get(f"/api/runs/{dag_run.dag_id}/{dag_run.run_id}", client=fleet)
    return out


def stored(dag_run) -> dict[str, str]:
    """Every XCom value and rendered template field of the run, from the metadata database."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    out = {}
    with create_session() as session:
        for row in session.scalars(select(XComModel).where(XComModel.run_id == dag_run.run_id)):
            out[f"xcom {row.task_id} {row.key}"] = json.dumps(XComModel.deserialize_value(row), default=str)
        for row in session.scalars(select(RenderedTaskInstanceFields).where(
                RenderedTaskInstanceFields.run_id == dag_run.run_id)):
            out[f"rendered {row.task_id}"] = json.dumps(row.rendered_fields, default=str)
    return out


def test_env_values_are_nowhere_but_in_the_pod_and_secrets_come_from_kubernetes(
        cloud, connections, gpu_job_dag, api, capfd):
    make_secret(cloud, "hf-token", {"token": FROM_KEY})
    make_secret(cloud, "wandb", {"WANDB_API_KEY": FROM_SECRET})

    dag_run = gpu_job_dag.test(conn_file_path=str(connections), run_conf=JOB)
    output = capfd.readouterr().out

    assert dag_run.state == "success", output[-5000:]
    assert f"env-digest {DIGEST}" in task_log(output, dag_run, "launch"), "the pod did not get all three values"
    (pod,) = cloud.core_v1().list_namespaced_pod("gpu-jobs").items
    env = {e.name: e for e in pod.spec.containers[0].env}
    assert env["HF_TOKEN"].value_from.secret_key_ref.name == "hf-token" and env["HF_TOKEN"].value is None
    assert pod.spec.containers[0].env_from[0].secret_ref.name == "wandb"

    airflow, fleet, auth = api
    answers = api_answers(airflow, fleet, auth, dag_run)
    places = {"the run's log output": output, **stored(dag_run), **answers}
    assert len([k for k in places if k.startswith("rendered")]) == 5 and any("xcom" in k for k in places)
    run_url = f"/api/v2/dags/{dag_run.dag_id}/dagRuns/{dag_run.run_id}"
    leaks = [(value, where) for value in VALUES for where, text in places.items() if value in text
             and not (value == PLAIN and where == run_url)]    # the run's conf: the user's own input
    assert leaks == []
    # names are shown: the launch step's rendered fields say which variables the pod has
    launched = json.loads(places["rendered gpu_job.launch"])["launched"]
    assert {"API_TOKEN", "EPOCHS", "HF_TOKEN"} <= set(launched["env"]) and launched["env_from"] == ["wandb"]
    assert PLAIN in json.dumps(json.loads(answers[run_url])["conf"])   # where a plain value does stay

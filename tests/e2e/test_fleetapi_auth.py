"""The fleet API (gpuboot.ui.fleet_api) answers only an Airflow user allowed to read DAGs, with Airflow's own
auth manager, JWTs and (for revoked tokens) metadata database: 401 without a token, 403 with a forged one or a user without that permission.
(The allowed user, the page and its data are tested in Chromium: tests/ui, make test-ui.)"""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient


@pytest.fixture(params=["app", "mounted by the plugin"])
def client(request, monkeypatch, tmp_path):
    """The fleet app itself, and the plugin's lazy app mounted as the API server mounts it."""
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER",
                       "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager")
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "test-secret-for-the-fleet-api-auth-test-only-" + "x" * 32)
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", str(tmp_path / "passwords.json"))
    from airflow.api_fastapi.app import init_auth_manager, purge_cached_app

    from gpuboot.ui.fleet_api import create_app

    manager = init_auth_manager()
    if request.param == "app":
        yield TestClient(create_app()), manager
    else:
        from starlette.applications import Starlette
        from starlette.routing import Mount

        from gpuboot.ui.plugin import URL_PREFIX, GpuBootPlugin

        (entry,) = GpuBootPlugin.fastapi_apps
        root = Starlette(routes=[Mount(entry["url_prefix"], app=type(entry["app"])())])   # a fresh, unbuilt one
        yield TestClient(root, base_url=f"http://testserver{URL_PREFIX}"), manager
    purge_cached_app()


def test_no_token_is_401_and_a_forged_one_403(client):
    http, _ = client
    assert http.get("/api/fleet").status_code == 401
    assert http.get("/api/runs/gpu_job/r1").status_code == 401
    assert http.get("/api/jobs/form").status_code == 401
    assert http.post("/api/jobs/check", json={"conf": {}}).status_code == 401
    forged = http.get("/api/fleet", headers={"Authorization": "Bearer not-a-jwt"})
    assert forged.status_code == 403 and forged.json()["detail"] == "Invalid JWT token"
    assert http.get("/api/fleet", cookies={"_token": "not-a-jwt"}).status_code == 403


def test_a_user_without_read_access_to_dags_is_403(client):
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    http, manager = client
    token = manager.generate_jwt(SimpleAuthManagerUser(username="nobody", role=None))
    for path in ("/api/fleet", "/api/runs/gpu_job/r1", "/api/jobs/form"):
        assert http.get(path, headers={"Authorization": f"Bearer {token}"}).status_code == 403, path
    assert http.post("/api/jobs/check", json={"conf": {}}, headers={"Authorization": f"Bearer {token}"}).status_code == 403


def test_the_job_form_and_its_check_answer_a_user_who_can_read_dags(client):
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    http, manager = client
    auth = {"Authorization": f"Bearer {manager.generate_jwt(SimpleAuthManagerUser(username='viewer', role='viewer'))}"}
    form = http.get("/api/jobs/form", headers=auth).json()
    assert form["dag_id"] == "gpu_job" and [f["key"] for f in form["fields"]][:2] == ["name", "image"]
    bad = {"name": "Bad_Name", "image": "python:3.11-slim", "command": ["python"], "gpus": -1, "memory": "lots"}
    errors = http.post("/api/jobs/check", json={"conf": bad}, headers=auth).json()["errors"]
    assert set(errors) == {"name", "gpus", "memory"} and "out of range" in errors["gpus"]
    good = {**bad, "name": "train", "gpus": 1, "memory": "8Gi"}
    assert http.post("/api/jobs/check", json={"conf": good}, headers=auth).json() == {"errors": {}}
    assert http.post("/api/jobs/check", json={"conf": "nope"}, headers=auth).status_code == 422


def test_the_page_itself_holds_no_data_and_loads_without_a_token(client):
    http, _ = client
    page = http.get("/fleet")
    assert page.status_code == 200 and "api/fleet" in page.text and "<table id=\"nodes\">" in page.text
    job_page = http.get("/jobs/new")
    assert job_page.status_code == 200 and "api/jobs/check" in job_page.text and "api/v2/dags/" in job_page.text

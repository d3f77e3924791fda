"""The demo's REST client (scripts/demo.py AirflowApi) against a scripted transport: a call the
server fails (5xx, or no answer) is sent again, a 4xx is not, and a run is triggered with the
demo's own id, so a repeat whose first answer was lost finds that run instead of adding another."""
from __future__ import annotations

import json

import httpx
import pytest

from scripts import demo


def api_with(handler) -> demo.AirflowApi:
    api = demo.AirflowApi("http://airflow.test")
    api.http = httpx.Client(base_url="http://airflow.test", transport=httpx.MockTransport(handler))
    return api


def test_a_call_the_server_fails_is_sent_again_until_it_answers():
    answers = [httpx.Response(500, text="database is locked"), "no answer", httpx.Response(503),
               httpx.Response(200, json={"is_paused": True})]
    sent = []

    def handler(request):
        sent.append(request.url.path)
        answer = answers.pop(0)
        if answer == "no answer":
            raise httpx.ReadTimeout("timed out", request=request)
        return answer

    assert api_with(handler).get("/dags/gpu_job").json() == {"is_paused": True}
    assert sent == ["/api/v2/dags/gpu_job"] * 4


def test_a_client_error_is_returned_at_once():
    sent = []

    def handler(request):
        sent.append(request.url.path)
        return httpx.Response(404)

    assert api_with(handler).get("/dags/nope").status_code == 404
    assert len(sent) == 1


def test_a_server_that_keeps_failing_is_a_demo_error_naming_the_call():
    api = api_with(lambda request: httpx.Response(500, text="database is locked"))
    api.RETRY_SECONDS = 1.0
    with pytest.raises(demo.DemoError, match=r"PATCH /api/v2/dags/gpu_job: .*failing .*HTTP 500 database is locked"):
        api.trigger("gpu_job", {})


def test_a_trigger_whose_answer_was_lost_finds_its_run_rather_than_adding_one():
    runs: dict[str, dict] = {}
    posts = []

    def handler(request):
        path = request.url.path
        if request.method == "PATCH":
            return httpx.Response(200, json={"is_paused": False})
        if request.method == "POST":
            run_id = json.loads(request.content)["dag_run_id"]
            posts.append(run_id)
            if run_id in runs:
                return httpx.Response(409, json={"detail": "already exists"})
            runs[run_id] = {"dag_run_id": run_id}
            raise httpx.ReadTimeout("the answer was lost", request=request)   # created, but never answered
        run_id = path.rsplit("/", 1)[1]
        return httpx.Response(200, json=runs[run_id]) if run_id in runs else httpx.Response(404)

    run_id = api_with(handler).trigger("gpu_job", {"gpus": 1})
    assert list(runs) == [run_id] and posts == [run_id, run_id]

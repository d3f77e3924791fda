"""gpuboot's FastAPI app, mounted by the plugin in Airflow's API server at /gpuboot: the GPU-fleet
page, the "Run a GPU job" page, and the job queue (/api/queue: the same pass the place steps run).

Glue only: the cluster is read with placement's own survey (gpuboot.lifecycle.booking.survey over KubeClient
and EcsHook) plus the ledger, at most once per CACHE_SECONDS however many pages poll; gpuboot.ui.fleet_view
assembles the JSON. The JSON routes answer only an Airflow user (the UI's session cookie or a
Bearer token from /auth/token): 401 without a token, 403 with an invalid one or without read access
to DAGs. The pages themselves (static HTML + JS, no build step) hold no data.

The job page exists because Airflow's trigger form checks only required fields and JSON syntax
before Trigger, and then refuses one field at a time with the raw schema error. This page asks
/api/jobs/check (gpuboot.core.jobspec.field_errors: the place step's own validator, every field at
once) as each field is left, and triggers `gpu_job` through Airflow's REST API with the user's
session, so Airflow's permissions, its validation of the params and its audit log all still apply.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import Body, Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import HTMLResponse

from gpuboot.core.jobspec import field_errors, form_fields
from gpuboot.ui.fleet_view import etag_of, fleet_view, observe_gpus, run_view

CACHE_SECONDS = float(os.environ.get("GPUBOOT_FLEET_CACHE_SECONDS", "3"))
PAGE = Path(__file__).with_name("fleet.html")
JOB_PAGE = Path(__file__).with_name("jobform.html")
JOB_DAG_ID = os.environ.get("GPUBOOT_JOB_FORM_DAG_ID", "gpu_job")


def _settings() -> tuple[str, str, str]:
    """The connections and ledger namespace the page reads: the gpu_job defaults unless overridden."""
    return (os.environ.get("GPUBOOT_FLEET_KUBERNETES_CONN_ID", "kubernetes_default"),
            os.environ.get("GPUBOOT_FLEET_ECS_CONN_ID", "alibaba_ecs_default"),
            os.environ.get("GPUBOOT_FLEET_LEDGER_NAMESPACE", "default"))


class FleetCache:
    """One survey per `ttl` seconds for every viewer; concurrent requests wait for the one read."""

    def __init__(self, ttl: float = CACHE_SECONDS) -> None:
        self.ttl, self.lock = ttl, threading.Lock()
        self.at, self.data, self.gpus_seen, self.surveys = float("-inf"), None, {}, 0
        self.body, self.etag = b"", ""

    def get(self) -> dict:
        return self.tagged()[0]

    def tagged(self) -> tuple[dict, bytes, str]:
        """The data, its JSON (encoded once per survey, not per viewer) and its ETag (etag_of)."""
        with self.lock:
            if self.data is None or time.monotonic() - self.at >= self.ttl:
                self.data = self._read()
                self.body, self.etag = json.dumps(self.data).encode(), etag_of(self.data)
                self.at = time.monotonic()
            return self.data, self.body, self.etag

    def _read(self) -> dict:
        # imported here: every Airflow component loads the plugin, only the API server serves the page
        from gpuboot.hooks.ecs import EcsHook
        from gpuboot.hooks.kube import KubeClient
        from gpuboot.lifecycle.booking import survey
        from gpuboot.lifecycle.jobqueue import JobQueue, queue_config, queue_view
        from gpuboot.lifecycle.ledger import ReservationLedger

        kube_conn, ecs_conn, namespace = _settings()
        kube, ecs = KubeClient(kube_conn), EcsHook(ecs_conn)
        now = time.time()
        state = ReservationLedger(kube, namespace).snapshot()
        live = [r for r in state.reservations if r.expires_at > now]
        seen = survey(kube, ecs, live, now)
        self.surveys += 1
        starts: dict[str, tuple[str, float]] = {}
        for record in state.jobs:
            if record.expires_at > now:
                for s in record.started:
                    if s.node not in starts or s.at > starts[s.node][1]:
                        starts[s.node] = (record.job_id, s.at)
        booting = sorted({v.instance_id for v in seen.views if v.instance_id and
                          (v.state.value == "booting" or v.name in starts)})
        instances = {i["InstanceId"]: i for i in ecs.describe_instances(booting)} if booting else {}
        self.gpus_seen = observe_gpus(self.gpus_seen, seen.views, now)
        data = fleet_view(seen.views, seen.nodes, reservations=live, backed=seen.backed,
                          marks=state.live_unavailable(now), starts=starts, instances=instances,
                          gpus_seen=self.gpus_seen, now=now)
        data["surveys"] = self.surveys
        data["queue"] = queue_view(JobQueue(kube, namespace).snapshot(), seen.views, state.live_unavailable(now),
                                   queue_config(), now, seen.pods, live)
        return data


CACHE = FleetCache()


def _read_access():
    """Airflow's own dependency: an authenticated user allowed to read DAGs (401 / 403 otherwise)."""
    from airflow.api_fastapi.core_api.security import requires_access_dag

    return Depends(requires_access_dag(method="GET"))


def _run_data(dag_id: str, run_id: str) -> dict:
    """The run's task instances and its steps' XComs, read from the metadata database."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        tis = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id,
                                                         TaskInstance.run_id == run_id)).all()
        if not tis:
            raise HTTPException(status_code=404, detail=f"no task instances for run {run_id!r} of DAG {dag_id!r}")
        rows = session.scalars(select(XComModel).where(XComModel.dag_id == dag_id, XComModel.run_id == run_id,
                                                       XComModel.map_index == -1)).all()
        xcoms: dict[str, dict[str, Any]] = {}
        for row in rows:
            xcoms.setdefault(row.task_id, {})[row.key] = XComModel.deserialize_value(row)
        tasks = [{"task_id": t.task_id, "state": t.state, "start_date": t.start_date and t.start_date.isoformat(),
                  "end_date": t.end_date and t.end_date.isoformat()} for t in tis if t.map_index in (-1, 0)]
    return run_view(xcoms, tasks)


def conditional(request: Request, body: bytes, etag: str) -> Response:
    """The fleet's JSON, or 304 with no body when the page already has it (If-None-Match): an open
    tab polling an unchanged fleet costs a few hundred bytes a poll, not the whole fleet."""
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if etag and etag in {t.strip() for t in request.headers.get("if-none-match", "").split(",")}:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


def create_app() -> FastAPI:
    app = FastAPI(title="gpuboot", description="The GPU fleet as placement sees it, and a job form that checks every field")
    read = _read_access()      # one dependency object: a benchmark or test may override it

    @app.get("/fleet", response_class=HTMLResponse, include_in_schema=False)
    @app.get("/fleet/run", response_class=HTMLResponse, include_in_schema=False)
    def page() -> str:
        return PAGE.read_text()

    @app.get("/api/fleet", dependencies=[read])
    def fleet(request: Request) -> Response:
        return conditional(request, *CACHE.tagged()[1:])

    @app.get("/api/queue", dependencies=[read])
    def queue() -> dict:
        """The waiting jobs in order: position, name, team, class, shape, enqueue time and queue deadline,
        who is ahead, what blocks each (and whether a quota, a hold or capacity), the nodes held for it."""
        return {"queue": CACHE.get()["queue"]}

    @app.get("/api/runs/{dag_id}/{run_id}", dependencies=[read])
    def run(dag_id: str, run_id: str) -> dict:
        return _run_data(dag_id, run_id)

    @app.get("/jobs/new", response_class=HTMLResponse, include_in_schema=False)
    def job_page() -> str:
        return JOB_PAGE.read_text()

    @app.get("/api/jobs/form", dependencies=[read])
    def job_form() -> dict:
        return {"dag_id": JOB_DAG_ID, "fields": form_fields()}

    @app.post("/api/jobs/check", dependencies=[read])
    def job_check(conf: dict[str, Any] = Body(embed=True)) -> dict:  # noqa: B008 (FastAPI's declaration)
        return {"errors": field_errors(conf, "job form")}

    return app

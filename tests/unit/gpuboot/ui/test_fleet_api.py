"""The fleet API's conditional answer (gpuboot.ui.fleet_api.conditional): 304 with no body when the page has it."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from gpuboot.ui.fleet_api import conditional

BODY, TAG = b'{"nodes": []}', 'W/"abc"'


def client() -> TestClient:
    app = FastAPI()

    @app.get("/fleet")
    def fleet(request: Request):
        return conditional(request, BODY, TAG)

    return TestClient(app)


def test_a_poll_with_the_current_etag_is_answered_304_without_a_body():
    c = client()
    full = c.get("/fleet")
    assert (full.status_code, full.content, full.headers["etag"]) == (200, BODY, TAG)
    assert full.headers["content-type"] == "application/json" and full.headers["cache-control"] == "no-cache"
    same = c.get("/fleet", headers={"If-None-Match": f'W/"old", {TAG}'})
    assert (same.status_code, same.content, same.headers["etag"]) == (304, b"", TAG)
    assert c.get("/fleet", headers={"If-None-Match": 'W/"old"'}).status_code == 200

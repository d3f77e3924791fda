"""The Kubernetes client's retries of a 429 (`gpuboot.hooks.kube.throttled_retries`): kube-apiserver's priority
and fairness answers 429 to a request it could not queue or queued too long, before running it, so every verb
is sent again after the Retry-After it names; other statuses are answered as they were. A plain HTTP server
on localhost plays the API server: the urllib3 pool the kubernetes client is built on talks to it."""
from __future__ import annotations

import http.server
import threading
import time

import pytest
import urllib3

from gpuboot.hooks.kube import THROTTLED_TRIES, throttled_retries

QUICK = 0.001     # the backoff between tries when the server names no Retry-After (0.2 s and doubling in use)


class Server(http.server.ThreadingHTTPServer):
    """Answers `status` (with Retry-After `retry_after`, if any) to the first `refusals` requests, then 200."""

    def __init__(self, refusals: int, status: int = 429, retry_after: str | None = None) -> None:
        self.refusals, self.status, self.retry_after, self.seen = refusals, status, retry_after, []
        super().__init__(("127.0.0.1", 0), Handler)


class Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        server: Server = self.server
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server.seen.append((self.command, time.monotonic()))
        refused = len(server.seen) <= server.refusals
        self.send_response(server.status if refused else 200)
        if refused and server.retry_after is not None:
            self.send_header("Retry-After", server.retry_after)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_PATCH = do_POST = do_PUT = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def serve():
    servers = []

    def start(*args, **kwargs) -> tuple[Server, str]:
        server = Server(*args, **kwargs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}/api/v1/namespaces/default/configmaps/x"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("method", ["GET", "PATCH", "POST", "PUT"])
def test_a_429_is_sent_again_whatever_the_verb_until_it_goes_through(serve, method):
    server, url = serve(refusals=3)
    pool = urllib3.PoolManager(retries=throttled_retries(QUICK))
    response = pool.request(method, url, body=b"{}" if method != "GET" else None)
    assert response.status == 200
    assert [m for m, _ in server.seen] == [method] * 4


def test_the_wait_is_the_retry_after_the_server_names(serve):
    server, url = serve(refusals=1, retry_after="1")
    urllib3.PoolManager(retries=throttled_retries()).request("PATCH", url, body=b"{}")
    (_, first), (_, second) = server.seen
    assert second - first >= 1.0


def test_past_its_tries_the_last_429_is_the_answer(serve):
    server, url = serve(refusals=THROTTLED_TRIES + 5)
    response = urllib3.PoolManager(retries=throttled_retries(QUICK)).request("PATCH", url, body=b"{}")
    assert response.status == 429
    assert len(server.seen) == THROTTLED_TRIES + 1


@pytest.mark.parametrize("status", [409, 500, 503, 504])
def test_other_refusals_of_a_write_are_answered_at_once(serve, status):
    """A 409 is a compare-and-swap lost, a 5xx of a write may have landed: the caller decides, not the pool."""
    server, url = serve(refusals=1, status=status)
    response = urllib3.PoolManager(retries=throttled_retries(QUICK)).request("PATCH", url, body=b"{}")
    assert response.status == status and len(server.seen) == 1

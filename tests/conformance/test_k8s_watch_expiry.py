"""Watch expiry, future versions and bookmarks as the real API server answers them, through
`kubernetes`, `kubernetes_asyncio` and `kubectl get --raw` against `python -m simcloud serve`.

- A resourceVersion older than the compaction window (`timings.watch_history_seconds`) is 410 Gone,
  reason Expired, whatever the resource: compaction is by age of the version, not per resource.
- One newer than any written waits 3 s (the watch cache's wait), then is 504, reason Timeout,
  "Too large resource version", with the ResourceVersionTooLarge cause.
- allowWatchBookmarks=true gets a BOOKMARK every `timings.watch_bookmark_seconds`, and one just
  before the watch's own timeoutSeconds, each at the watch cache's version, and only when that has
  moved past the stream (test_k8s_api.py shows the real one's rule).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import threading
import time

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio import config as aconfig
from kubernetes_asyncio import watch as awatch

from simcloud.harness import small_fleet, wait_until
from tests.conftest import kubectl_binaries

WINDOW = 2.0
FLEET = small_fleet([{"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"}],
                    timings={"watch_history_seconds": WINDOW})


def watch_error(v1, rv: str) -> ApiException | None:
    """The error a one-second watch of ConfigMaps from `rv` ends with (None: it streamed)."""
    try:
        for _ in kubernetes.watch.Watch().stream(v1.list_config_map_for_all_namespaces, resource_version=rv,
                                                 timeout_seconds=1):
            pass
    except ApiException as exc:
        return exc
    return None


def current_rv(v1) -> str:
    return v1.list_config_map_for_all_namespaces().metadata.resource_version


def test_a_version_older_than_the_window_is_410_expired_for_every_resource(simcloud_factory):
    cloud = simcloud_factory(FLEET)
    v1 = cloud.core_v1()
    rv = current_rv(v1)
    written = time.monotonic()
    v1.create_namespaced_config_map("default", {"metadata": {"name": "after"}})
    events = []
    for event in kubernetes.watch.Watch().stream(v1.list_namespaced_config_map, "default", resource_version=rv,
                                                 timeout_seconds=1):
        events.append((event["type"], event["object"].metadata.name))
    assert events == [("ADDED", "after")]            # inside the window: the change is replayed

    # ConfigMaps were written once; the kubelet's Lease renewals age `rv` out all the same
    gone = wait_until(lambda: watch_error(v1, rv), timeout=WINDOW * 5, interval=0.2)
    assert time.monotonic() - written >= WINDOW
    assert gone.status == 410 and gone.reason.startswith(f"Expired: too old resource version: {rv} ("), gone.reason
    assert watch_error(v1, current_rv(v1)) is None   # a fresh version still watches


def test_kubernetes_asyncio_sees_410_and_504(simcloud_factory):
    cloud = simcloud_factory(FLEET)
    v1 = cloud.core_v1()
    old = current_rv(v1)
    wait_until(lambda: watch_error(v1, old), timeout=WINDOW * 5, interval=0.2)
    future = str(int(current_rv(v1)) + 1_000_000)

    async def error_of(rv: str):
        api = await aconfig.new_client_from_config(config_file=str(cloud.kubeconfig))
        try:
            av1 = aclient.CoreV1Api(api)
            started = time.monotonic()
            try:
                async for _ in awatch.Watch().stream(av1.list_namespaced_config_map, "default", resource_version=rv,
                                                     timeout_seconds=10):
                    pass
            except aclient.exceptions.ApiException as exc:
                return exc.status, exc.reason, time.monotonic() - started
            return None, None, time.monotonic() - started
        finally:
            await api.close()

    status, reason, _ = asyncio.run(error_of(old))
    assert status == 410 and "too old resource version" in reason
    status, reason, waited = asyncio.run(error_of(future))
    assert status == 504 and f"Too large resource version: {future}, current: " in reason, reason
    assert waited >= 3.0 - 0.1, "the watch cache waits for a future version before giving up"


def test_a_future_version_written_within_the_wait_is_watched(simcloud_factory):
    cloud = simcloud_factory(FLEET)
    v1 = cloud.core_v1()
    soon = str(int(current_rv(v1)) + 1)          # the next Lease renewal writes it
    assert watch_error(v1, soon) is None


@pytest.mark.kubectl
@pytest.mark.parametrize("kubectl", kubectl_binaries(), ids=str)
def test_kubectl_raw_watch_gets_the_status_in_the_stream(simcloud_factory, kubectl, tmp_path):
    cloud = simcloud_factory(FLEET)
    v1 = cloud.core_v1()
    old = current_rv(v1)
    wait_until(lambda: watch_error(v1, old), timeout=WINDOW * 5, interval=0.2)

    def raw_watch(rv: str) -> dict:
        out = subprocess.run([str(kubectl), "--kubeconfig", str(cloud.kubeconfig), "--cache-dir",
                              str(tmp_path / "kcache"), "get", "--raw",
                              f"/api/v1/configmaps?watch=true&resourceVersion={rv}&timeoutSeconds=5"],
                             capture_output=True, text=True, timeout=30,
                             env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[0])

    expired = raw_watch(old)
    assert expired["type"] == "ERROR"
    assert {k: expired["object"][k] for k in ("kind", "status", "reason", "code")} == {
        "kind": "Status", "status": "Failure", "reason": "Expired", "code": 410}
    too_new = raw_watch(str(int(current_rv(v1)) + 1_000_000))
    assert too_new["type"] == "ERROR"
    status = too_new["object"]
    assert (status["reason"], status["code"]) == ("Timeout", 504)
    assert status["details"]["causes"] == [{"reason": "ResourceVersionTooLarge",
                                            "message": "Too large resource version"}]
    assert status["details"]["retryAfterSeconds"] == 1


def bookmarks_of(v1, timeout: int, allow: bool = True) -> list[tuple[float, str]]:
    """(seconds after the start, resourceVersion) of every BOOKMARK a ConfigMap watch of "default" gets
    while ConfigMaps are written in "kube-system" (which it does not select) every 0.2 s: a bookmark
    carries the watch cache's version, only when past the watch's start, so a quiet one would get none."""
    rv = current_rv(v1)
    stop = threading.Event()

    def write_elsewhere() -> None:
        for i in itertools.count():
            v1.create_namespaced_config_map("kube-system", {"metadata": {"name": f"elsewhere-{rv}-{i}"}})
            if stop.wait(0.2):
                return
    writer = threading.Thread(target=write_elsewhere, daemon=True)
    writer.start()
    started, seen = time.monotonic(), []
    try:
        for event in kubernetes.watch.Watch().stream(v1.list_namespaced_config_map, "default", resource_version=rv,
                                                     allow_watch_bookmarks=allow, timeout_seconds=timeout,
                                                     deserialize=False):
            assert event["type"] == "BOOKMARK", event
            seen.append((time.monotonic() - started, event["object"]["metadata"]["resourceVersion"]))
            assert int(seen[-1][1]) > int(rv) and int(seen[-1][1]) >= int(seen[-2][1] if len(seen) > 1 else rv)
    finally:
        stop.set()
        writer.join(5)
    return seen


def test_bookmarks_come_every_bookmark_period_when_allowed(simcloud_factory):
    cloud = simcloud_factory(small_fleet(FLEET["nodes"], timings={"watch_bookmark_seconds": 1}))
    v1 = cloud.core_v1()
    seen = bookmarks_of(v1, timeout=4)
    assert len(seen) >= 2 and seen[0][0] >= 1.0 - 0.1, seen
    assert [int(rv) for _, rv in seen] == sorted(int(rv) for _, rv in seen)
    assert bookmarks_of(v1, timeout=3, allow=False) == []


def test_a_watch_shorter_than_the_period_gets_one_bookmark_before_its_timeout(simcloud_factory):
    cloud = simcloud_factory(FLEET)          # default bookmark period: a minute
    seen = bookmarks_of(cloud.core_v1(), timeout=4)
    assert len(seen) == 1 and 2.0 - 0.2 <= seen[0][0] < 4.0, seen

"""bench.burst's request counting: what kind of Kubernetes request a method and path are."""
from __future__ import annotations

import pytest

from bench.burst import per_placement, request_kind


@pytest.mark.parametrize(("method", "url", "kind"), [
    ("PATCH", "/api/v1/namespaces/default/configmaps/gpuboot-queue-3", "PATCH configmaps"),
    ("GET", "/api/v1/namespaces/default/configmaps/gpuboot-queue-3", "GET configmaps"),
    ("GET", "/api/v1/nodes?watch=true&resourceVersion=5", "WATCH nodes"),
    ("GET", "/api/v1/pods?fieldSelector=status.phase%21%3DSucceeded&limit=500", "LIST pods"),
    ("GET", "/api/v1/namespaces/default/pods", "LIST pods"),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1", "PUT leases"),
    ("PATCH", "/api/v1/nodes/gpu-node-00001/status", "PATCH nodes/status"),
    ("POST", "/api/v1/namespaces/default/pods/p/binding", "POST pods/binding"),
    ("GET", "/api/v1/namespaces/default", "GET namespaces"),
    ("GET", "/version", "GET /version"),
])
def test_a_request_is_named_by_its_verb_and_resource(method, url, kind):
    assert request_kind(method, url) == kind


def test_requests_per_placement_are_rounded_means_most_common_first():
    from collections import Counter
    assert list(per_placement(Counter({"GET configmaps": 3, "PATCH configmaps": 7}), 4).items()) == [
        ("PATCH configmaps", 1.75), ("GET configmaps", 0.75)]


def test_a_placer_process_that_ends_before_it_is_ready_fails_the_burst_at_once_not_at_the_deadline():
    import multiprocessing as mp
    import queue
    import time

    from bench.burst import _placer_ready

    ctx = mp.get_context("fork")
    ready = ctx.Queue()
    dead = ctx.Process(target=exit, args=(3,))
    dead.start()
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="exit code 3"):
        _placer_ready(ready, dead, time.monotonic() + 900)
    assert time.monotonic() - began < 30
    alive = ctx.Process(target=ready.put, args=({"me": "placer-x"},))
    alive.start()
    assert _placer_ready(ready, alive, time.monotonic() + 30) == {"me": "placer-x"}
    alive.join(5)
    with pytest.raises(queue.Empty):        # alive and silent past the deadline
        sleeper = ctx.Process(target=time.sleep, args=(10,))
        sleeper.start()
        try:
            _placer_ready(ready, sleeper, time.monotonic() + 1)
        finally:
            sleeper.kill()

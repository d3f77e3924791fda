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

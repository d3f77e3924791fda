"""Conformance of simcloud itself: its API server, scheduler, node-lifecycle controller, CLI and in-process
harness. On the real control plane (--kube=real) only the tests marked both_backends run (the same
assertions against kube-apiserver v1.37.2: ground truth for simcloud's answers); the rest are skipped
there (they reach into simcloud's store, faults or kubelets)."""
from __future__ import annotations

import os

import pytest

REASON = "conformance of simcloud's own API server, scheduler, node-lifecycle controller and CLI"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    real = os.environ.get("GPUBOOT_KUBE") == "real"
    for item in items:
        if str(item.fspath).startswith(here + os.sep) and item.get_closest_marker("both_backends") is None:
            item.add_marker(pytest.mark.simcloud_only(reason=REASON))
            if real:
                item.add_marker(pytest.mark.skip(reason=f"simcloud only: {REASON}"))


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    """One real control plane per module, for the tests marked both_backends under --kube=real."""
    from tests.real_k8s.cluster import real_k8s
    with real_k8s(tmp_path_factory.mktemp("conformance-k8s"), ()) as cluster:
        yield cluster

"""Conformance of simcloud itself: its API server, scheduler, node-lifecycle controller, CLI and in-process
harness. On the real control plane (--kube=real) these are skipped: what the product relies on runs there
through the product's own tests (make test-real-k8s)."""
from __future__ import annotations

import os

import pytest

REASON = "conformance of simcloud's own API server, scheduler, node-lifecycle controller and CLI"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    real = os.environ.get("GPUBOOT_KUBE") == "real"
    for item in items:
        if str(item.fspath).startswith(here + os.sep):
            item.add_marker(pytest.mark.simcloud_only(reason=REASON))
            if real:
                item.add_marker(pytest.mark.skip(reason=f"simcloud only: {REASON}"))

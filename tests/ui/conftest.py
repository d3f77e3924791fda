"""The UI tests share one stack (local cloud + Airflow standalone, ~1 min to start) and one browser.

Slow and needing Chromium: they run only when GPUBOOT_TEST_UI=1, which `make test-ui` sets.
"""
from __future__ import annotations

import os

import pytest

from tests.ui.harness import airflow_stack, chromium


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GPUBOOT_TEST_UI") != "1":
        skip = pytest.mark.skip(reason="slow; run with `make test-ui` (GPUBOOT_TEST_UI=1)")
        for item in items:
            if "tests/ui/" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    with airflow_stack(tmp_path_factory.mktemp("ui-stack")) as running:
        yield running


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("ui-browser")) as context:
        yield context


# Page loads and REST calls on a shared, loaded machine can take minutes (one uvicorn worker).
SLOW_MS = 300_000


@pytest.fixture
def page(browser, stack):
    import httpx

    stack.api.http.timeout = httpx.Timeout(SLOW_MS / 1000)
    page = browser.new_page()
    page.set_default_timeout(SLOW_MS)
    page.set_default_navigation_timeout(SLOW_MS)
    yield page
    page.close()

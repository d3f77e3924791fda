"""The browser harness of the UI tests: headless Debian Chromium driven by Playwright, against the
stack the demo runs (simcloud + `airflow standalone`, started by scripts/demo.py's own helpers).

Playwright drives the system's /usr/bin/chromium (the Debian package; Playwright's own browser
download is never used). Each browser gets a fresh profile and the flags that keep it from
reaching out (no background networking, component updates, sync or QUIC).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scripts import demo

REPO = demo.REPO
CHROMIUM = Path(os.environ.get("GPUBOOT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = REPO / "results" / "ui"
DOC_IMAGES = REPO / "docs" / "img"
# Airflow standalone starts four components: about a minute alone, many more on a shared loaded machine.
START_TIMEOUT = float(os.environ.get("GPUBOOT_UI_START_TIMEOUT", "900"))


@dataclass
class Stack:
    """A running local cloud and Airflow, and a REST client logged in as the admin."""

    cloud: demo.SimCloud
    url: str
    api: demo.AirflowApi
    user: str
    password: str
    home: Path


@contextlib.contextmanager
def airflow_stack(workdir: Path, fleet: Path | None = None, password: str = "ui-test-pass") -> Iterator[Stack]:
    """The demo's stack (scripts/demo.py: running_cloud, airflow_env, running_airflow), healthy and
    with gpu_job parsed; everything is stopped on exit."""
    fleet = fleet or REPO / "simcloud" / "fleets" / "demo.yaml"
    home = workdir / "airflow"
    home.mkdir(parents=True)
    password_file = home / "passwords.json"
    password_file.write_text(json.dumps({demo.ADMIN_USER: password}) + "\n")
    port = demo.free_port()
    url = f"http://127.0.0.1:{port}"
    with demo.running_cloud(fleet, workdir / "cloud") as cloud:
        env = demo.airflow_env(home, port, password_file, cloud.gpuboot_connections())
        # a loaded CI machine (or a shared one) can take more than the default 30 s to import a DAG file
        env.update(AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT="300", AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT="600")
        with demo.running_airflow(env, home / "standalone.log") as proc:
            api = demo.AirflowApi(url)
            try:
                demo.wait_until("Airflow to be healthy",
                                lambda: api.healthy() or (proc.poll() is not None and demo._died(proc)),
                                timeout=START_TIMEOUT)
                api.login(demo.ADMIN_USER, password)
                demo.wait_until(f"DAG {demo.DAG_ID} to be parsed", lambda: api.dag_loaded(demo.DAG_ID),
                                timeout=START_TIMEOUT)
            except demo.DemoError:
                demo._tail(home / "standalone.log")
                raise
            yield Stack(cloud, url, api, demo.ADMIN_USER, password, home)


@contextlib.contextmanager
def chromium(workdir: Path) -> Iterator:
    """A Playwright browser context on headless Debian Chromium with a fresh profile under `workdir`."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        raise RuntimeError(f"{CHROMIUM} not found: apt-get install chromium (the Debian package)")
    profile = workdir / "chromium-profile"
    shutil.rmtree(profile, ignore_errors=True)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000})
        try:
            yield context
        finally:
            context.close()


def login(page, stack: Stack) -> None:
    """Log in through Airflow's own login form, as a person would (a session from an earlier test is dropped)."""
    page.context.clear_cookies()
    page.goto(f"{stack.url}/")
    page.get_by_label("Username").fill(stack.user)
    page.get_by_label("Password").fill(stack.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda u: "/auth/login" not in u and "login" not in u, timeout=60_000)


def screenshot(page, name: str) -> Path:
    """Save the page as results/ui/<name>.png (the folder is made on first use)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def doc_screenshot(page, name: str) -> Path:
    """Save what a person sees first (the viewport) as docs/img/<name>.png, the picture the docs
    and the README show: written by the test that checks the page, so it stays current."""
    DOC_IMAGES.mkdir(parents=True, exist_ok=True)
    path = DOC_IMAGES / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path

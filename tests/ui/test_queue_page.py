"""The job queue on the GPU-fleet page and in the waiting step's log, in headless Chromium (issue 32 #5).

A 2-GPU T4 job takes the fleet's only 2-GPU T4 node (gpu-t4x2-1); two more wait for it. The page's
queue table must show them in order (position, job, team, priority, shape, waiting since, what
blocks them, their deadline), the second naming the first ahead of it; each waiting place step's
log line says the same; once the first job ends both run in turn and the table empties. The
screenshot is docs/img/queue-table.png.
"""
from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from simcloud.harness import wait_until
from tests.ui.harness import doc_screenshot, login, screenshot
from tests.ui.test_fleet_page import BOOT_TIMEOUT_MS, ONE_TIME_FORMAT, finished

# three jobs one after the other on one node, each place poll a worker start: long on a loaded machine
pytestmark = pytest.mark.timeout(1800)


def t4_pair(name: str, seconds: int, **more) -> dict:
    """A 2-GPU T4 job: only gpu-t4x2-1 holds it."""
    return {"name": name, "image": "python:3.11-slim", "gpus": 2, "gpu_model": "T4", "cpu": "1", "memory": "1Gi",
            "settle_seconds": 1, "queue_timeout_seconds": 1800,
            "command": ["python", "-c", f"import time; time.sleep({seconds}); print('{name} done')"],  # sleep-ok: workload
            **more}


def place_log(stack, run_id: str) -> list[str]:
    """The place step's log of the run (its current try)."""
    tis = [t for t in stack.api.task_instances("gpu_job", run_id) if t["task_id"].endswith("place")]
    return [line for ti in tis for line in stack.api.log_events("gpu_job", run_id, ti)]


def test_the_queue_table_and_the_log_lines_show_each_waiting_job_its_place_blocker_and_deadline(stack, page):
    login(page, stack)
    page.goto(f"{stack.url}/gpuboot/fleet")
    expect(page.locator("#totals tbody tr[data-model]").first).to_be_visible(timeout=120_000)

    hog = stack.api.trigger("gpu_job", t4_pair("ui-hog", 60))
    # the hog holds gpu-t4x2-1 (its reservation, then its pod) before the others come
    expect(page.locator('#reservations tr[data-node="gpu-t4x2-1"]')).to_have_count(1, timeout=BOOT_TIMEOUT_MS)
    first = stack.api.trigger("gpu_job", t4_pair("ui-first", 2, team="vision", priority_class="normal"))
    rows = page.locator("#queue tbody tr[data-job]")
    expect(rows).to_have_count(1, timeout=BOOT_TIMEOUT_MS)
    second = stack.api.trigger("gpu_job", t4_pair("ui-second", 2, team="nlp", preemptible=True))
    expect(rows).to_have_count(2, timeout=BOOT_TIMEOUT_MS)

    one, two = rows.nth(0), rows.nth(1)
    expect(one.locator("td.job")).to_contain_text("ui-first (gb-")
    expect(two.locator("td.job")).to_contain_text("ui-second (gb-")
    expect(one.locator("td.position")).to_have_text("1")
    expect(two.locator("td.position")).to_have_text("2")
    expect(one).to_contain_text("vision")
    expect(two).to_contain_text("nlp")
    expect(one.locator("td.shape")).to_have_text("2 GPUs (T4)")
    expect(two.locator("td.shape")).to_have_text("2 GPUs (T4), preemptible")
    first_id = one.get_attribute("data-job")
    for row in (one, two):
        expect(row).to_have_attribute("data-blocked-by", "capacity")
        expect(row.locator("td.blocker .badge")).to_have_text("capacity")
        expect(row.locator("td.since")).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(.* ago\)$"))
        expect(row.locator("td.deadline")).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(in .*\)$"))
    expect(two.locator("td.blocker")).to_contain_text(f"ahead: ui-first ({first_id})")
    api = stack.api.http.get("/gpuboot/api/queue").json()["queue"]
    assert [(q["position"], q["name"], q["blocked_by"]) for q in api] == [
        (1, "ui-first", "capacity"), (2, "ui-second", "capacity")], api
    assert api[1]["ahead"] == [first_id] and all(q["deadline"] > q["enqueued_at"] + 1700 for q in api), api
    assert re.match(ONE_TIME_FORMAT, page.locator("#changed").text_content())
    doc_screenshot(page, "queue-table")
    screenshot(page, "queue-table-full")

    # each waiting place step says where it stands, who is ahead, what blocks it and until when
    line = re.compile(r"queue position (\d) of (\d); ahead: (.+?); blocked by: (.+); "
                      r"queue deadline \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(in [^)]+\)")
    said = wait_until(lambda: [m for text in place_log(stack, second) for m in [line.search(text)] if m],
                      timeout=120, interval=2)
    assert said[-1].group(1) == "2" and f"ui-first ({first_id})" in said[-1].group(3), said[-1].group(0)

    # the hog ends: the first in line runs, then the second; the table empties
    assert finished(stack, hog) == "success"
    assert finished(stack, first) == "success"
    assert finished(stack, second) == "success"
    expect(rows).to_have_count(0, timeout=60_000)
    expect(page.locator("#queue tbody")).to_contain_text("none")

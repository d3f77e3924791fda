"""gpuboot's "Run a GPU job" page (/gpuboot/jobs/new) in headless Chromium: every field is checked as
it is left, by the place step's own validator, and nothing is triggered until all are right (issue 18:
Airflow's own form checks patterns and bounds only on Trigger, one field at a time)."""
from __future__ import annotations

import re

from playwright.sync_api import expect

from tests.ui.harness import login, screenshot


def runs(stack) -> list[dict]:
    return stack.api.get("/dags/gpu_job/dagRuns").json()["dag_runs"]


def leave(page, key: str, value: str) -> None:
    field = page.locator(f"#input-{key}")
    field.fill(value)
    field.press("Tab")


def test_each_bad_field_says_why_next_to_it_and_nothing_runs_until_all_are_right(stack, page):
    before = {r["dag_run_id"] for r in runs(stack)}
    login(page, stack)
    page.goto(f"{stack.url}/gpuboot/jobs/new")
    expect(page.locator("#input-name")).to_be_visible()
    # nothing in red before anything is typed; required markers only on name, image, command
    for error in page.locator(".error").all():
        expect(error).to_have_text("")
    assert sorted(page.locator(".field:has(.required) input, .field:has(.required) textarea")
                  .evaluate_all("els => els.map(e => e.name)")) == ["command", "image", "name"]

    leave(page, "name", "Bad_Name")
    leave(page, "image", "python:3.11-slim")
    leave(page, "command", "python\n-c\nprint('hello')")
    leave(page, "gpus", "-1")
    leave(page, "memory", "lots")
    expect(page.locator("#error-name")).to_contain_text("not a DNS-1123 label")
    expect(page.locator("#error-name")).to_contain_text("e.g. 'train-resnet'")
    expect(page.locator("#error-gpus")).to_contain_text("-1 is out of range. Use an integer >= 0")
    expect(page.locator("#error-memory")).to_contain_text("'lots' is not a Kubernetes quantity")
    expect(page.locator("#input-gpus")).to_have_value("-1")             # never turned into 0
    expect(page.locator("#input-memory")).to_have_value("lots")
    for ok in ("image", "command", "cpu"):
        expect(page.locator(f"#error-{ok}")).to_have_text("")
    # opening Advanced leaves the main fields where they are
    page.locator("#advanced summary").click()
    expect(page.locator("#input-name")).to_be_visible()
    expect(page.locator("#input-replicas")).to_be_visible()
    screenshot(page, "job-form-bad-input")

    page.get_by_role("button", name="Trigger").click()
    expect(page.locator("#outcome")).to_contain_text("Not triggered: 3 fields to fix")
    assert {r["dag_run_id"] for r in runs(stack)} == before

    leave(page, "name", "ui-form-job")
    leave(page, "gpus", "1")
    leave(page, "memory", "8Gi")
    for key in ("name", "gpus", "memory"):
        expect(page.locator(f"#error-{key}")).to_have_text("")
    page.get_by_role("button", name="Trigger").click()
    link = page.locator("#run-link")
    expect(link).to_be_visible()
    expect(page.locator("#run-placement-link")).to_have_attribute(        # and to the run's own page
        "href", re.compile(r"/dags/gpu_job/runs/[^/]+/plugin/gpu-placement$"))
    screenshot(page, "job-form-triggered")
    created = [r for r in runs(stack) if r["dag_run_id"] not in before]
    assert [r["dag_run_id"] for r in created] == [link.inner_text()]
    conf = created[0]["conf"]
    assert (conf["name"], conf["gpus"], conf["memory"], conf["command"]) == \
        ("ui-form-job", 1, "8Gi", ["python", "-c", "print('hello')"])
    assert "gpu_model" not in conf and "args" not in conf      # left empty: the DAG's defaults apply

"""gpu_job's trigger form in headless Chromium, as a new user meets it (issue 18).

What Airflow 3.3's form does with each JSON-schema feature (its FlexibleForm): a single type
"string" is a one-line input, arrays of strings a one-per-line box, "object" a JSON editor, an enum
a drop-down labelled by values_display; a type without "null" is marked required; an integer box
clamps to "minimum"/"maximum" when left (so gpuboot states bounds as exclusiveMinimum/Maximum:
refused, never changed). It checks only required fields and JSON syntax as you type; patterns and
bounds are refused when Trigger is pressed (Airflow's validation of the params), one field at a time.
"""
from __future__ import annotations

from playwright.sync_api import expect

from tests.ui.harness import login, screenshot


def runs_of(stack, dag_id: str) -> int:
    return stack.api.get(f"/dags/{dag_id}/dagRuns").json()["total_entries"]


def open_form(page, stack):
    login(page, stack)
    page.goto(f"{stack.url}/dags/gpu_job")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    expect(dialog.locator("#element_name")).to_be_visible(timeout=120_000)
    return dialog


def field_row(dialog, name: str):
    """The form row of one field: its label, input, help text and error text."""
    by_id = dialog.locator(f'div.chakra-field__root:has(#element_{name})')
    return by_id.or_(dialog.locator(f'div.chakra-field__root:has([name="element_{name}"])')).last


def test_the_form_shows_each_field_as_it_should(stack, page):
    dialog = open_form(page, stack)
    screenshot(page, "trigger-form")
    # required markers only on the required fields
    for name in ("name", "image"):
        expect(dialog.locator(f"#element_{name}")).to_have_attribute("required", "")
    for name in ("args", "cpu", "memory", "gpus"):
        assert dialog.locator(f'[name="element_{name}"]').first.get_attribute("required") is None, name
    for name in ("args", "env", "node_selector", "tolerations", "extra_resources", "gpus", "gpu_model"):
        assert "*" not in field_row(dialog, name).locator("label").first.inner_text(), name
    # quantities are one-line inputs, not text areas
    for name in ("cpu", "memory"):
        assert dialog.locator(f"#element_{name}").evaluate("e => e.tagName") == "INPUT"
    # no literal [] or null in the optional fields, "any" for the GPU model
    expect(dialog.locator("#element_args")).to_have_value("")
    expect(dialog.locator('[name="element_gpu_model"]')).to_have_value("__null__")
    expect(dialog.locator("#element_gpu_model")).to_contain_text("any")
    expect(dialog).not_to_contain_text("null")
    # the way to gpuboot's own form, which checks every field as it is left: in the form and the DAG's docs
    expect(field_row(dialog, "name").locator('a[href="/gpuboot/jobs/new"]')).to_have_text("Run a GPU job")
    assert "(/gpuboot/jobs/new)" in stack.api.get("/dags/gpu_job/details").json()["doc_md"]


def test_bad_input_is_refused_unchanged_naming_the_field_and_no_run_is_created(stack, page):
    before = runs_of(stack, "gpu_job")
    dialog = open_form(page, stack)
    dialog.locator("#element_name").fill("Bad_Name")
    dialog.locator("#element_image").fill("python:3.11-slim")
    command = dialog.locator("#element_command")      # a string-or-list field: it takes typed keys, not fill()
    command.click()
    command.press_sequentially("python")
    gpus = dialog.locator('input[name="element_gpus"]')
    gpus.fill("-1")
    dialog.locator("#element_memory").fill("lots")
    dialog.locator("#element_memory").press("Tab")
    expect(gpus).to_have_value("-1")          # never silently turned into 0 (a CPU-only job)
    expect(dialog.locator("#element_memory")).to_have_value("lots")
    # each field says its rule in words next to it
    expect(field_row(dialog, "gpus")).to_contain_text("0 or more")
    expect(field_row(dialog, "memory")).to_contain_text("Kubernetes quantity above zero")
    expect(field_row(dialog, "name")).to_contain_text("Lower-case letters")
    screenshot(page, "trigger-form-bad-input")

    dialog.get_by_role("button", name="Trigger").click()
    expect(page.get_by_text("Failed to Trigger Dag")).to_be_visible(timeout=60_000)
    expect(dialog).to_contain_text("Invalid input for param name")
    screenshot(page, "trigger-form-refused")
    assert runs_of(stack, "gpu_job") == before

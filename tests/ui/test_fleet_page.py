"""The GPU-fleet page in headless Chromium while a job boots a node of the local cloud (issue 15).

The page (gpuboot.ui.fleet_api, shown in Airflow's UI under Browse and as a DAG run tab) must show
the node booting with its timeline, then Ready holding the job's reservation, then the
reservation gone once the job is done; its API answers only an Airflow user. Screenshots under
results/ui/.
"""
from __future__ import annotations

import os

import httpx
from playwright.sync_api import expect

from simcloud.harness import wait_until
from tests.shared import two_gpu_training_job
from tests.ui.harness import login, screenshot

# trigger -> scheduler -> place -> start -> boot: under a minute alone, many on a shared loaded machine
BOOT_TIMEOUT_MS = int(float(os.environ.get("GPUBOOT_UI_STEP_TIMEOUT", "900")) * 1000)
# The pod's own work lasts long enough for the page (polling every 2 s) to see the job running.
TRAIN = ("import time\n"
         "print('ui-train start', flush=True)\n"
         "time.sleep(15)\n"        # sleep-ok: the pod's own workload, not a wait
         "print('ui-train done', flush=True)\n")


def test_the_fleet_api_answers_only_an_airflow_user(stack, page):
    api = f"{stack.url}/gpuboot/api/fleet"
    assert httpx.get(api, timeout=300).status_code == 401                     # no token, no cookie
    forged = httpx.get(api, headers={"Authorization": "Bearer not-a-token"}, timeout=300)
    assert forged.status_code == 403 and "Invalid JWT token" in forged.text
    assert httpx.get(api, cookies={"_token": "not-a-token"}, timeout=300).status_code == 403
    # the first read imports the Kubernetes and ECS clients into the API server: minutes on a loaded machine
    first = stack.api.http.get("/gpuboot/api/fleet", timeout=600)
    assert first.status_code == 200, first.text
    # a page view costs at most one survey every few seconds, whoever asks
    assert stack.api.http.get("/gpuboot/api/fleet").json()["surveys"] == first.json()["surveys"]
    names = {n["name"] for n in first.json()["nodes"]}
    assert {"cpu-system-1", "gpu-t4-busy-1", "gpu-t4x2-1"} <= names


def test_the_fleet_page_follows_a_boot_the_reservation_and_its_release(stack, page):
    login(page, stack)
    # the page inside Airflow's UI (external view under Browse)
    page.goto(f"{stack.url}/plugin/gpu-fleet")
    embedded = page.frame_locator("iframe")
    expect(embedded.locator('#nodes tr[data-node="gpu-t4-busy-1"]')).to_be_visible(timeout=120_000)
    screenshot(page, "fleet-in-airflow-ui")

    page.goto(f"{stack.url}/gpuboot/fleet")
    expect(page.locator('#nodes tr[data-node="gpu-t4x2-1"][data-state="stopped"]')).to_be_visible(timeout=60_000)
    row = page.locator('#nodes tr[data-node="gpu-t4-busy-1"]')
    expect(row.locator("td.state")).to_have_text("ready")
    expect(row).to_contain_text("ecs.gn6i-c4g1.xlarge")
    expect(row).to_contain_text("$1.20")
    screenshot(page, "fleet-before")

    job = {**two_gpu_training_job("ui"), "command": ["python", "-c", TRAIN]}
    run_id = stack.api.trigger("gpu_job", job)

    boot = page.locator('#boots .boot[data-state="booting"]')
    expect(boot).to_have_count(1, timeout=BOOT_TIMEOUT_MS)
    node = boot.get_attribute("data-node")
    expect(boot.locator('li[data-step="start requested"]')).to_have_class("done")
    expect(page.locator(f'#nodes tr[data-node="{node}"] td.state')).to_have_text("booting")
    expect(page.locator(f'#reservations tr[data-node="{node}"]')).to_have_count(1)
    screenshot(page, "fleet-booting")

    # Ready with its GPUs: the whole timeline is there and the job still holds the node
    ready = page.locator(f'#nodes tr[data-node="{node}"][data-state="ready"]')
    expect(ready).to_be_visible(timeout=BOOT_TIMEOUT_MS)
    timeline = page.locator(f'#boots .boot[data-node="{node}"] li.done')
    expect(timeline).to_have_count(4, timeout=30_000)
    reservation = page.locator(f'#reservations tr[data-node="{node}"]')
    expect(reservation).to_have_count(1)
    expect(reservation).to_contain_text("gb-")
    screenshot(page, "fleet-running")

    # the job done and released: no reservation left on the node
    expect(page.locator(f'#reservations tr[data-node="{node}"]')).to_have_count(0, timeout=BOOT_TIMEOUT_MS)
    screenshot(page, "fleet-released")
    state = wait_until(lambda: (s := stack.api.run_state("gpu_job", run_id)) in ("success", "failed") and s,
                       timeout=BOOT_TIMEOUT_MS / 1000, interval=2)
    assert state == "success"

    # the run's own tab: its placement table and boot timeline
    page.goto(f"{stack.url}/dags/gpu_job/runs/{run_id}/plugin/gpu-placement")
    tab = page.frame_locator("iframe")
    expect(tab.locator("#placement-table")).to_contain_text("VERDICT", timeout=120_000)
    expect(tab.locator(f'#run-boots tr[data-node="{node}"]')).to_be_visible()
    screenshot(page, "run-placement-tab")

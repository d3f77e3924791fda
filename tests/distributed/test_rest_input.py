"""Bad input to `gpu_job` through the REST API on the distributed stack, the way issue 9 found it.

Each run is refused before anything is reserved or booted: at trigger time (HTTP 400) where
the Params form can check it, else by the place task, naming the field. Uses the stack of
test_gpu_job_distributed.py (CeleryExecutor, PostgreSQL, Redis, separate processes).
"""
from __future__ import annotations

import json

import pytest

from simcloud.harness import wait_until
from tests.distributed.test_gpu_job_distributed import DAG_ID, JOB, TWO_GPU_NODE, distributed, short  # noqa: F401
from tests.shared import live_reservations

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1500)]

# Issue 9's conf: with name, image and command, typos of gpus, gpu_model and memory.
TYPOS = {**{k: v for k, v in JOB.items() if k not in ("gpus", "memory")},
         "gpu": 2, "gpu_modle": "A100", "memroy": "64Gi"}
# Refused by the place task, each naming its field (the form cannot check these alone).
AT_PLACE = {
    "typos": (TYPOS, "DAG run params: gpu: unknown field. Did you mean 'gpus'?"),
    "boot-timeout": ({**JOB, "name": "bt-train", "boot_timeout_seconds": 3, "settle_seconds": 5},
                     "boot_timeout_seconds: 3s is shorter than a boot can take"),
}


TERMINAL = {"success", "failed", "upstream_failed", "skipped"}


def place_outcome(api, run_id: str, procs, timeout: float = 300) -> dict[str, str]:
    """Every task's state once all are terminal. (Not the run's state: on this stack a run whose
    place step failed was seen to stay `running` for minutes after its last task ended.)"""
    def settled():
        procs.check_alive()
        states = {short(ti["task_id"]): ti["state"] for ti in api.task_instances(DAG_ID, run_id)}
        return states if states and set(states.values()) <= TERMINAL else None
    return wait_until(settled, timeout=timeout, interval=0.5,
                      message=lambda: f"run {run_id}: tasks not all done in {timeout}s")


def place_log(api, run_id: str) -> str:
    """The place step's whole log (messages and the exception's details) through the REST API."""
    (ti,) = [t for t in api.task_instances(DAG_ID, run_id) if short(t["task_id"]) == "place"]
    r = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{ti['task_id']}/logs/1", full_content="true")
    r.raise_for_status()
    return json.dumps(r.json()["content"])


def post_run(api, conf: dict):
    return api.http.post(f"/api/v2/dags/{DAG_ID}/dagRuns", json={"logical_date": None, "conf": conf})


def test_bad_trigger_input_over_rest_is_refused_before_anything_is_reserved_or_booted(distributed):
    cloud, airflow, procs = distributed
    api = airflow.api
    boot_ids = {n.metadata.name: n.status.node_info.boot_id for n in cloud.core_v1().list_node().items}
    wait_until(lambda: procs.check_alive() or api.dag_loaded(DAG_ID), timeout=180, interval=1,
               message=lambda: f"{DAG_ID} not parsed by the dag-processor in 180s")
    api.http.patch(f"/api/v2/dags/{DAG_ID}", json={"is_paused": False}).raise_for_status()

    # At trigger time: an argument over Linux's per-argument limit (issue 9: 200 KB) is a 400 naming it.
    refused = post_run(api, {**JOB, "args": ["--data", "x" * 200_000]})
    assert refused.status_code == 400 and "args" in refused.text, (refused.status_code, refused.text[:500])
    # ... and so is a namespace outside GPUBOOT_JOB_NAMESPACES (the form's enum): no pods in kube-system.
    refused = post_run(api, {**JOB, "name": "ns-train", "namespace": "kube-system"})
    assert refused.status_code == 400 and "namespace" in refused.text, (refused.status_code, refused.text[:500])

    # At the place task: each run fails there, naming the field; nothing is reserved, booted or launched.
    runs = {}
    for case, (conf, _) in AT_PLACE.items():
        r = post_run(api, conf)
        assert r.status_code < 300, (case, r.status_code, r.text[:500])   # the form accepts them
        runs[case] = r.json()["dag_run_id"]
    for case, run_id in runs.items():
        states = place_outcome(api, run_id, procs)
        assert states["place"] == "failed", (case, states)
        assert {s for step, s in states.items() if step != "place"} <= {"upstream_failed", "skipped"}, (case, states)
        log = place_log(api, run_id)
        assert AT_PLACE[case][1] in log, (case, log[-3000:])
    assert live_reservations(cloud) == []
    assert {n.metadata.name: n.status.node_info.boot_id for n in cloud.core_v1().list_node().items} == boot_ids
    assert [p for p in cloud.core_v1().list_pod_for_all_namespaces().items
            if (p.metadata.labels or {}).get("gpuboot.io/job")] == []
    assert TWO_GPU_NODE in boot_ids

    # Issue 9: the idle scale-down was created paused (dags_are_paused_at_creation) and never ran.
    wait_until(lambda: api.dag_loaded("gpuboot_idle_scaledown"), timeout=120, interval=1)
    assert api.is_paused("gpuboot_idle_scaledown") is False

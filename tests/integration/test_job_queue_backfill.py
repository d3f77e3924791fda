"""Backfill around a hold by stated runtimes, live, with the real steps and clients (both Kubernetes
backends): a 4-GPU job that stated a 10-minute runtime runs on the only 8-GPU node; a high-priority
8-GPU job arrives and waits, holding the node until that job is due to end; a 2-GPU job that states
it ends well before then takes two of the node's free GPUs; one that states nothing waits behind the
hold. The place steps compute when the node frees from the running job's pod start and its stated
runtime (gpuboot.core.queue.releases_of), as the replay does."""
from __future__ import annotations

import time

import pytest
from airflow.sdk.exceptions import TaskDeferred

from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.jobqueue import JobQueue
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.operators.launch import GpuPodOperator
from gpuboot.operators.start import StartGpuNodesOperator
from simcloud.harness import wait_until
from tests.integration.conftest import running_cloud
from tests.integration.test_cancel import running_pods
from tests.integration.test_operators import context, place, release
from tests.integration.test_preemption import FLEET, JOB

LONG = {**JOB, "name": "long", "gpus": 4, "expected_runtime_seconds": 600,
        "command": ["python", "-c", "import time\ntime.sleep(600)"]}  # sleep-ok: the pod's own workload
BIG = {**JOB, "name": "big", "priority_class": "high", "command": ["true"]}
SHORT = {**JOB, "name": "short", "gpus": 2, "expected_runtime_seconds": 60, "command": ["true"]}
UNSTATED = {**JOB, "name": "unstated", "gpus": 2, "command": ["true"]}


@pytest.fixture
def cloud(tmp_path, monkeypatch):
    with running_cloud(FLEET, tmp_path, monkeypatch) as sim:
        yield sim


def waits(job: dict, job_id: str) -> None:
    with pytest.raises(TaskDeferred):          # the place step waits in the queue
        place(job, job_id=job_id)


def test_a_short_job_that_states_its_runtime_backfills_around_a_hold_and_one_that_states_none_waits(cloud, capfd):
    plan, pushed = place(LONG, job_id="long")
    assert plan["outcome"] == "fits", plan["message"]
    started = StartGpuNodesOperator(task_id="start", plan=plan, job=pushed["job"]).execute(context("start"))
    with pytest.raises(TaskDeferred):          # its pods are created; the gang's trigger is left unrun
        GpuPodOperator(task_id="launch", job=pushed["job"], plan=started["plan"], env_source=LONG,
                       startup_timeout_seconds=30).execute(context("launch"))
    wait_until(lambda: running_pods("long") != [], timeout=120, message="the long job's pod did not start")

    waits(BIG, "big")                          # 8 GPUs, 4 free: it waits, of the high class
    plan, _ = place(SHORT, job_id="short")     # its pass holds gpu8 for big, due when long should end
    assert plan["outcome"] == "fits", plan["message"]
    assert [a["node"] for a in plan["assignments"]] == ["gpu8"]
    state = JobQueue(KubeClient()).snapshot()
    (hold,) = state.holds
    assert hold.job_id == "big" and hold.nodes == ("gpu8",)
    assert time.time() + 500 < hold.due <= time.time() + 600          # long's pod start + its 600 s
    capfd.readouterr()
    waits(UNSTATED, "unstated")                # 2 GPUs free on gpu8, but it may end after the hold is due
    assert "node(s) gpu8 held for job big" in capfd.readouterr().out

    for job_id in ("short", "long", "big", "unstated"):
        release(job_id)
    assert ReservationLedger(KubeClient()).live() == []
    state = JobQueue(KubeClient()).snapshot()
    assert (state.waiting, state.running, state.holds) == ((), (), ())

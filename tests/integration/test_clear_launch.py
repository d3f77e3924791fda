"""Issue 35 #7: clearing launch on a finished run runs the job again, never replays the old verdict.

Before: Airflow cleared only place and release with launch (its setup and teardown); place booked a
node that start was not run to power on, and launch adopted the gang of attempt 1, completed minutes
before ("adopting the gang of attempt 1, still live"), replayed its log and reported success. Now a
finished gang of an earlier try is never adopted (launch clears it and launches again), and start
and wait_gpu_ready are setups of launch, so clearing launch clears the whole job before it."""
from __future__ import annotations

from airflow.sdk import DAG

from gpuboot.hooks.kube import KubeClient
from gpuboot.operators.launch import GpuPodOperator
from gpuboot.task_groups.gpu_job import gpu_job_group
from tests.integration.test_operators import JOB, context, place

QUICK = {**JOB, "name": "quick", "cpu": "100m", "memory": "64Mi", "gpus": 0, "allow_gpu_nodes": True,
         "command": ["python", "-c", "print('quick run', flush=True)"]}


def pods_of(job_id: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["status"].get("phase") for p in KubeClient().list_pods(f"gpuboot.io/job={job_id}")}


def launch_at(try_number: int, pushed: dict, plan: dict, capfd) -> tuple[list[str], str]:
    """The launch step at try `try_number`, run to its verdict; its pods and its log."""
    ctx = context("launch")
    ctx["ti"].try_number = try_number
    capfd.readouterr()
    op = GpuPodOperator(task_id="launch", job=pushed["job"], plan=plan, env_source=QUICK, deferrable=False,
                        startup_timeout_seconds=30)
    return op.execute(ctx), capfd.readouterr().out


def test_a_cleared_launch_of_a_finished_gang_launches_again_not_adopts(cloud, capfd):
    plan, pushed = place(QUICK, job_id="cleared")
    assert plan["outcome"] == "fits", plan["message"]
    (first,), _ = launch_at(1, pushed, plan, capfd)
    assert pods_of("cleared") == {first: "Succeeded"}

    (second,), log = launch_at(2, pushed, plan, capfd)      # the launch cleared: a new try
    assert second != first and second.endswith("-2")
    assert "adopting" not in log and f"left by earlier attempt(s) ['1']: {first}" in log
    assert "quick run" in log and pods_of("cleared") == {second: "Succeeded"}   # it really ran again

    (same,), log = launch_at(2, pushed, plan, capfd)        # this very try again (a resumed worker): its verdict stands
    assert same == second and "adopting the gang of attempt 2" in log


def test_clearing_launch_clears_place_start_and_wait_gpu_ready_with_it():
    from airflow.serialization.serialized_objects import DagSerialization

    with DAG("clear_check", schedule=None) as dag:
        gpu_job_group({"name": "x", "image": "python:3.11", "command": ["true"]})
    scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    for step in ("launch", "wait_gpu_ready", "start"):        # what the UI's and REST API's clear of one task takes
        cleared = scheduler_dag.partial_subset(task_ids=[f"gpu_job.{step}"], include_upstream=False,
                                               include_downstream=True)
        assert {t.split(".")[-1] for t in cleared.task_dict} == {"place", "start", "wait_gpu_ready", "launch",
                                                                  "release"}, step

"""Crash safety on a real deployment needs Airflow to retry a step whose worker died."""
from __future__ import annotations

from airflow.sdk import DAG

from gpuboot.task_groups.gpu_job import gpu_job_group


def test_every_step_of_the_group_is_retried_with_backoff():
    with DAG("retry_check", schedule=None) as dag:
        gpu_job_group({"name": "x", "image": "python:3.11", "command": ["true"]})
    steps = {task.task_id.split(".")[-1]: task for task in dag.tasks}
    assert set(steps) == {"place", "start", "wait_gpu_ready", "launch", "release"}
    for name, task in steps.items():
        assert task.retries == 2 and task.retry_exponential_backoff == 2.0, name


def test_retries_can_be_turned_off():
    with DAG("retry_off", schedule=None) as dag:
        gpu_job_group({"name": "x", "image": "python:3.11", "command": ["true"]}, retries=0)
    assert {task.retries for task in dag.tasks} == {0}

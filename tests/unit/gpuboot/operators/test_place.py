"""The place step in a burst: a transaction that stays contended makes the step defer (a timer
trigger, no worker slot held, nothing reserved) and place again when it fires, until the job's
queue timeout; only then does it fail. The transaction itself is replaced by a scripted one
(`ScriptedPlace`): what is under test is the step's handling of its outcome."""
from __future__ import annotations

import time

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.placement import Outcome, Plan
from gpuboot.core.queue import Entry
from gpuboot.core.resources import GPU, Resources
from gpuboot.lifecycle.booking import LedgerContended
from gpuboot.lifecycle.jobqueue import JobQueue
from gpuboot.operators.place import PlaceGpuJobOperator
from gpuboot.triggers.wake_up import WakeUpTrigger
from tests.builders import step_context
from tests.fakes import cloud

JOB = {"name": "sweep-7", "image": "python:3.11", "command": ["true"], "gpus": 1, "queue_timeout_seconds": 120}


class ScriptedPlace(PlaceGpuJobOperator):
    """The place step with its transaction answering from `script` (an exception or a plan each call)."""

    def __init__(self, script, **kwargs):
        super().__init__(task_id="place", job=JOB, job_id="job-7", **kwargs)
        self.script, self.calls = list(script), 0
        self.cluster = cloud().cluster           # the job queue's ConfigMap (the queue deadline) lives here

    def check_cluster(self, spec, job_id) -> None:
        pass

    def kube(self):
        return self.cluster

    def place_and_reserve(self, spec, job_id, deadline=None):
        self.calls += 1
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


FITS = Plan("job-7", Outcome.FITS, "fits on gpu-run")


def test_a_contended_placement_defers_on_a_timer_and_places_again_when_it_fires():
    step, ctx = ScriptedPlace(script=[LedgerContended("busy ledger"), LedgerContended("busy ledger"), FITS]), step_context()
    began = time.time()
    with pytest.raises(TaskDeferred) as first:
        step.execute(ctx)
    trigger = first.value.trigger
    assert isinstance(trigger, WakeUpTrigger) and first.value.method_name == "resume"
    deadline = trigger.echo["deadline"]
    assert began + 119 <= deadline <= time.time() + 120                   # the queue timeout, from the first try
    assert began + 1 <= trigger.moment <= deadline                       # a jittered few seconds, never past it
    with pytest.raises(TaskDeferred) as second:
        step.resume(ctx, {"echo": trigger.echo})
    assert second.value.trigger.echo["deadline"] == deadline            # the deadline is carried, not restarted
    plan = step.resume(ctx, {"echo": second.value.trigger.echo})
    assert plan["outcome"] == "fits" and step.calls == 3
    assert ctx["ti"].pushed["job_id"] == "job-7"


def test_a_retry_of_the_place_step_keeps_the_deadline_of_the_jobs_first_enqueue():
    step, ctx = ScriptedPlace(script=[LedgerContended("busy ledger")]), step_context()
    fixed = time.time() + 30                    # the first try enqueued the job 90 s ago, then its worker died
    JobQueue(step.cluster).enqueue(Entry("job-7", Resources({GPU: 1})), fixed)
    with pytest.raises(TaskDeferred) as deferred:
        step.execute(ctx)
    assert deferred.value.trigger.echo["deadline"] == fixed


def test_a_placement_still_contended_at_the_queue_timeout_fails_with_the_reason():
    step = ScriptedPlace(script=[LedgerContended("busy ledger")])
    with pytest.raises(AirflowFailException, match="queue_timeout_seconds=120: busy ledger"):
        step.resume(step_context(), {"echo": {"deadline": time.time() - 1, "tried": []}})


def test_a_job_its_teams_quota_can_never_hold_is_refused_at_trigger_time_naming_the_field(monkeypatch):
    monkeypatch.setenv("GPUBOOT_QUEUE_CONFIG", '{"teams": {"vision": {"nominal": {"T4": 2}}}}')
    op = PlaceGpuJobOperator(task_id="place", job=JOB)
    with pytest.raises(AirflowFailException, match=r"team: team vision may use at most 2 GPUs .* needs 4 at once\. "
                                                   r"Ask for fewer GPUs"):
        op.check_quota(JobSpec.from_dict({**JOB, "gpus": 2, "replicas": 2, "team": "vision"}), "job-7")
    op.check_quota(JobSpec.from_dict({**JOB, "gpus": 2, "team": "vision"}), "job-7")     # fits: no refusal
    monkeypatch.setenv("GPUBOOT_QUEUE_CONFIG", "{not json")
    with pytest.raises(AirflowFailException, match="GPUBOOT_QUEUE_CONFIG: not a valid queue configuration"):
        op.check_quota(JobSpec.from_dict(JOB), "job-7")

"""Every failure without retry of a step reaches the run's note: its first line is the step's
summary (`failed: ...`, XCom "summary", which gpuboot.ui.run_note gathers), whichever layer raised
it. The steps' adapters are replaced by a scripted JobBoot (`ScriptedBoot`); what is under test
is how the steps end."""
from __future__ import annotations

import time

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.placement import Outcome, Plan
from gpuboot.lifecycle.booking import LedgerContended
from gpuboot.lifecycle.boot import CapacityBusy, CapacityUnavailable
from gpuboot.lifecycle.jobqueue import JobQueue
from gpuboot.operators.place import PlaceGpuJobOperator
from gpuboot.operators.start import StartGpuNodesOperator
from tests.builders import TaskInstance, step_context
from tests.fakes import cloud

JOB = {"name": "sweep-7", "image": "python:3.11", "command": ["true"], "gpus": 1, "queue_timeout_seconds": 120}
PLAN = Plan("job-7", Outcome.FITS, "fits on gpu-stop")


class ScriptedBoot:
    """JobBoot's face to the start step, answering from `script` (an exception or a plan per call)."""

    def __init__(self, script):
        self.spec, self.job_id, self.script = JobSpec.from_dict(JOB), "job-7", list(script)

    def hold(self, seconds):
        pass

    def _next(self, *args):
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    ensure_up = bring_up = rebook = _next


class ScriptedStart(StartGpuNodesOperator):
    def __init__(self, *, script, **kwargs):
        super().__init__(task_id="start", plan=PLAN.to_json(), job=JOB, **kwargs)
        self.scripted = ScriptedBoot(script)
        self.cluster = cloud().cluster          # the job queue's ConfigMap (the queue deadline) lives here

    def _boot(self, plan):
        return self.scripted

    def kube(self):
        return self.cluster


def test_capacity_that_never_comes_back_fails_the_start_step_with_a_summary():
    ctx = step_context()
    with pytest.raises(AirflowFailException, match="no capacity, ever") as failed:
        ScriptedStart(script=[CapacityUnavailable("no capacity, ever: tried gpu-a, gpu-b")]).execute(ctx)
    assert ctx["ti"].pushed["summary"] == "failed: no capacity, ever: tried gpu-a, gpu-b"
    assert type(failed.value) is AirflowFailException       # raised as it was, only summarized first


def test_a_busy_wait_past_the_queue_timeout_fails_the_start_step_with_a_summary():
    step, ctx = ScriptedStart(script=[CapacityBusy("gpu-a failed to boot; the rest is busy", ["gpu-a: NoStock"]),
                               Plan("job-7", Outcome.BUSY, "capacity busy")]), step_context()
    with pytest.raises(TaskDeferred) as deferred:
        step.execute(ctx)
    assert "summary" not in ctx["ti"].pushed          # waiting is not failing
    echo = {**deferred.value.trigger.echo, "deadline": time.time() - 1}
    with pytest.raises(AirflowFailException, match="still no capacity after queue_timeout_seconds=120"):
        step.resume(ctx, {"echo": echo})
    assert ctx["ti"].pushed["summary"] == ("failed: job job-7: still no capacity after queue_timeout_seconds=120; "
                                           "tried: gpu-a: NoStock")


def test_the_start_steps_wait_keeps_the_queue_deadline_the_place_step_fixed():
    step, ctx = ScriptedStart(script=[CapacityBusy("gpu-a failed to boot; the rest is busy", ["gpu-a: NoStock"])]), \
        step_context()
    fixed = time.time() + 7                           # what is left of the job's 120 s after its wait in place
    JobQueue(step.cluster).admit("job-7", "default", "Tesla-T4", 1, deadline=fixed)
    with pytest.raises(TaskDeferred) as deferred:
        step.execute(ctx)
    assert deferred.value.trigger.echo["deadline"] == fixed          # not a fresh 120 s
    assert deferred.value.trigger.moment <= fixed


def test_a_start_step_whose_job_used_up_its_queue_timeout_in_place_fails_at_once():
    step, ctx = ScriptedStart(script=[CapacityBusy("gpu-a failed to boot; the rest is busy", ["gpu-a: NoStock"])]), \
        step_context()
    JobQueue(step.cluster).admit("job-7", "default", "Tesla-T4", 1, deadline=time.time() - 1)
    with pytest.raises(AirflowFailException, match="still no capacity after queue_timeout_seconds=120"):
        step.execute(ctx)


def test_a_re_placement_still_contended_at_its_deadline_fails_the_start_step_with_a_summary():
    step, ctx = ScriptedStart(script=[LedgerContended("busy ledger")]), step_context()
    step.contended_until = time.time() - 1
    with pytest.raises(AirflowFailException, match="queue_timeout_seconds=120: busy ledger"):
        step.execute(ctx)
    assert ctx["ti"].pushed["summary"] == ("failed: job job-7: could not commit its re-placement before "
                                           "queue_timeout_seconds=120: busy ledger")


def test_a_bad_job_fails_the_place_step_with_a_summary_naming_the_field():
    ctx = step_context()
    with pytest.raises(AirflowFailException, match="gpus"):
        PlaceGpuJobOperator(task_id="place", job={**JOB, "gpus": -1}).execute(ctx)
    assert ctx["ti"].pushed["summary"].startswith("failed: ") and "gpus" in ctx["ti"].pushed["summary"]


def test_a_refusal_is_summarized_once():
    class Never(PlaceGpuJobOperator):
        def check_cluster(self, spec, job_id):
            pass

        def kube(self):
            return cloud().cluster

        def place_and_reserve(self, spec, job_id, deadline=None):
            return Plan(job_id, Outcome.NEVER, "no node has 9 GPUs")

    pushed = []

    class Counting(TaskInstance):
        def xcom_push(self, key, value):
            pushed.append((key, value))

    with pytest.raises(AirflowFailException, match="can never run"):
        Never(task_id="place", job=JOB, job_id="job-7").execute({"ti": Counting(), "run_id": "r", "params": {}})
    assert [v for k, v in pushed if k == "summary"] == [("failed: job sweep-7 can never run in this fleet: "
                                                        "no node has 9 GPUs")]

"""The release step when the ledger stays contended: it defers on a timer and releases again (it is
idempotent), carrying one deadline, instead of spending its Airflow tries; only past that deadline does
it fail. The release itself is replaced by a scripted one: what is under test is the step's handling."""
from __future__ import annotations

import time

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from gpuboot.exceptions import LedgerConflict, LedgerContended
from gpuboot.operators import release as release_module
from gpuboot.operators.release import ReleaseReservationOperator
from gpuboot.triggers.wake_up import WakeUpTrigger
from tests.builders import step_context


class ScriptedRelease(ReleaseReservationOperator):
    """The release step answering from `script` (an exception or a return value per call)."""

    def __init__(self, *, script, **kwargs):
        super().__init__(task_id="release", job_id="job-7", **kwargs)
        self.script, self.calls = list(script), 0

    def release(self, context, job_id):
        self.calls += 1
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


def test_a_contended_release_defers_and_releases_again_within_one_deadline():
    step, ctx = ScriptedRelease(script=[LedgerContended("busy ledger"), LedgerConflict("queue kept changing"), ["train"]]), \
        step_context()
    began = time.time()
    with pytest.raises(TaskDeferred) as first:
        step.execute(ctx)
    trigger = first.value.trigger
    assert isinstance(trigger, WakeUpTrigger) and first.value.method_name == "resume_after_contention"
    deadline = trigger.echo["deadline"]
    assert began + release_module.RELEASE_CONTENDED_SECONDS - 1 <= deadline
    assert began + 1 <= trigger.moment <= deadline
    with pytest.raises(TaskDeferred) as second:
        step.resume_after_contention(ctx, {"event": "wake", "echo": trigger.echo})
    assert second.value.trigger.echo["deadline"] == deadline       # carried, not restarted
    assert step.resume_after_contention(ctx, {"event": "wake", "echo": second.value.trigger.echo}) == ["train"]
    assert step.calls == 3


def test_a_release_still_contended_past_its_deadline_fails_saying_so():
    step, ctx = ScriptedRelease(script=[LedgerContended("busy ledger")]), step_context()
    step.contended_until = time.time() - 1
    with pytest.raises(AirflowFailException, match=r"could not release its reservations.*busy ledger"):
        step.execute(ctx)

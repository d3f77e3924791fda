"""The one busy-wait of the start step and the sensor, and how their failures end the task.

When a re-placement finds the fleet busy, the step waits deferred on a timer (WakeUpTrigger),
holding nothing, and re-places until the job's queue deadline (fixed once per job when its place
step first ran, read from the job queue: the timeout is not restarted per step); a job no capacity can ever hold
(gpuboot.lifecycle.boot.CapacityUnavailable) fails the task without a retry. A re-placement (a fail-over,
a NoStock fall-back) that cannot commit because the ledger stays contended (LedgerContended:
nothing written) defers the same way, a short jittered while, and runs the step again from the
ledger, so a job never fails for contention inside its queue timeout.

A job preempted while its nodes come up (gpuboot.lifecycle.preemption: it held capacity a
starving job needed, and no pod of it ran yet) is not re-placed here (`JobBoot.not_preempted`):
the step brings nothing up, and the sensor waits for nothing, so the job reaches its launch
step at once, which requeues it (gpuboot.operators.requeue), the one path for every victim.
"""
from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from airflow.sdk.exceptions import AirflowFailException

from gpuboot.core.placement import Outcome, Plan
from gpuboot.exceptions import JobPreempted
from gpuboot.lifecycle.booking import LedgerContended
from gpuboot.lifecycle.boot import BringUp, CapacityBusy, CapacityUnavailable, JobBoot
from gpuboot.lifecycle.jobqueue import JobQueue
from gpuboot.triggers.wake_up import WakeUpTrigger


@dataclass(frozen=True)
class CapacityWait:
    """A busy-wait in progress: until when the job may wait, and what it tried (the timer's echo)."""

    deadline: float
    tried: list

    def to_json(self) -> dict:
        return {"deadline": self.deadline, "tried": list(self.tried)}

    @classmethod
    def from_json(cls, d: Mapping) -> CapacityWait:
        return cls(deadline=float(d["deadline"]), tried=list(d.get("tried") or []))


@contextlib.contextmanager
def final_failures() -> Iterator[None]:
    """Turn the boot layer's "no capacity, ever" into Airflow's fail-without-retry."""
    try:
        yield
    except CapacityUnavailable as exc:
        raise AirflowFailException(str(exc)) from None


def handed_to_launch(task, preempted: JobPreempted, tried: list[str]) -> BringUp:
    """Nothing to bring up: the job was preempted before any pod of it ran (module doc)."""
    record = preempted.record
    task.log.warning("job %s was preempted by job %s before its node(s) were up: %s. Nothing more is brought up "
                     "here; its launch step requeues it (not failed)", record.job_id, record.preemptor, record.reason)
    return BringUp(Plan(record.job_id, Outcome.BUSY, f"preempted by job {record.preemptor}: requeued by its launch"),
                   [], [], list(tried))


def defer_for_contention(task, contended: Exception, deadline: float, method_name: str, again: str,
                         late: str) -> None:
    """The one wait after a contended ledger (nothing was written): a timer a short jittered while
    away (1 s plus up to `busy_poll_seconds`, at most 10), holding nothing, then `method_name`; the
    place step's and the re-placements' of start and wait. Past `deadline` the task fails without
    a retry: `late`, then why it was contended."""
    now = time.time()
    if now >= deadline:
        raise AirflowFailException(f"{late}: {contended}") from None
    wake = min(deadline, now + random.uniform(1.0, 1.0 + min(10.0, task.busy_poll_seconds)))
    task.log.info("%s; deferred, %s in %.1fs, giving up in %.0fs", contended, again, wake - now, deadline - now)
    task.defer(trigger=WakeUpTrigger(wake, CapacityWait(deadline, []).to_json()), method_name=method_name)


class WaitsForCapacity:
    """The one busy-wait of the start step and the sensor: when a re-placement finds the fleet
    busy (capacity in use, or the other candidates only marked unavailable for a while), wait
    deferred on a timer, holding nothing, and re-place every `busy_poll_seconds` until the job's
    queue timeout; then fail naming what was tried. Both steps therefore agree on when to wait."""

    busy_poll_seconds: float
    ledger_namespace: str
    kube: Callable
    contended_until: float | None = None      # while re-running after contention: the deadline it carries

    def bring_up_or_wait(self, boot: JobBoot, attempt: Callable[[], BringUp], deadline: float | None,
                         method_name: str) -> BringUp:
        """`attempt()` (a bring-up or fail-over); on CapacityBusy, defer to `method_name`."""
        try:
            with final_failures():
                return attempt()
        except JobPreempted as preempted:
            return handed_to_launch(self, preempted, [])
        except CapacityBusy as busy:
            if boot.spec is None:
                raise AirflowFailException(f"{busy}; no job spec given to wait with; pass job=...") from None
            deadline = deadline or self.queue_deadline(boot)
            self.wait_for_capacity(boot, busy.tried, deadline, str(busy), method_name)
        except LedgerContended as contended:
            if boot.spec is None:
                raise
            deadline = self.contended_until or deadline or self.queue_deadline(boot)
            defer_for_contention(self, contended, deadline, "resume_after_contention",
                                 "running this step again from the ledger",
                                 late=f"job {boot.job_id}: could not commit its re-placement before "
                                      f"queue_timeout_seconds={boot.spec.queue_timeout_seconds}")

    def queue_deadline(self, boot: JobBoot) -> float:
        """The job's queue deadline as its place step fixed it (the job queue's record): the timeout
        counts once per job across place, start and wait, not afresh in each step."""
        return JobQueue(self.kube(), self.ledger_namespace).deadline(boot.job_id, boot.spec.queue_timeout_seconds)

    def resume_after_contention(self, context, event: Mapping):
        """Back from a contended ledger (nothing was written): run the step again from the ledger
        (every try of the start step and the sensor starts there), within the same deadline."""
        self.contended_until = CapacityWait.from_json(event["echo"]).deadline
        return self.execute(context)

    def capacity_resumed(self, boot: JobBoot, echo: Mapping, method_name: str) -> BringUp:
        """Back from the busy-wait timer: place again and bring the new plan up, or wait more."""
        wait = CapacityWait.from_json(echo)
        try:
            with final_failures():
                plan = boot.rebook()
        except JobPreempted as preempted:
            return handed_to_launch(self, preempted, wait.tried)
        if plan.outcome == Outcome.BUSY:
            self.wait_for_capacity(boot, wait.tried, wait.deadline, f"capacity still busy: {plan.message}", method_name)
        self.log.info("re-placed job %s after waiting for capacity:\n%s", plan.job_id, plan.table())
        return self.bring_up_or_wait(boot, lambda: boot.bring_up(plan, wait.tried), wait.deadline, method_name)

    def wait_for_capacity(self, boot: JobBoot, tried: list[str], deadline: float, why: str, method_name: str):
        now = time.time()
        if now >= deadline:
            raise AirflowFailException(f"job {boot.job_id}: still no capacity after "
                                      f"queue_timeout_seconds={boot.spec.queue_timeout_seconds}; tried: "
                                      f"{'; '.join(tried)}")
        wake = min(deadline, now + self.busy_poll_seconds)
        self.log.info("%s; re-placing in %.0fs, giving up in %.0fs", why, wake - now, deadline - now)
        self.defer(trigger=WakeUpTrigger(wake, CapacityWait(deadline, list(tried)).to_json()), method_name=method_name)

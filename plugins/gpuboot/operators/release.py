"""The `release` step (a teardown): end the job's reservations and stop what it left unused."""
from __future__ import annotations

import time
from collections.abc import Mapping

from airflow.sdk import BaseOperator, TriggerRule
from airflow.sdk.exceptions import AirflowFailException

from gpuboot.core.gang import completion
from gpuboot.core.model import LABEL_JOB
from gpuboot.exceptions import LedgerConflict, LedgerContended
from gpuboot.lifecycle.jobqueue import JobQueue
from gpuboot.lifecycle.preemption import let_go
from gpuboot.operators.base import GpuJobStep, context_job_id, summarize
from gpuboot.operators.capacity_wait import CapacityWait, defer_for_contention

RELEASE_CONTENDED_SECONDS = 900   # a release that cannot commit for contention keeps deferring this long


class ReleaseReservationOperator(GpuJobStep, BaseOperator):
    """End the job's reservations whatever happened upstream (idempotent). A node the job
    started (its ledger record) where none of its pods ran is stopped again unless another job
    claims it: a run that failed before its launch leaves no instance running. The nodes the launch
    step created the gang on (its XCom "nodes", with `launch_task_id`) count as run on even when
    the pods are gone (a cancel deletes them): those go back to the idle rules, like any node
    that ran work.

    Then it fails (without retries; the gpu_job group makes it a teardown that fails the run) when the job
    did not run to completion, read from its pods: a run a user marked failed while it waited
    would otherwise end green, its teardown being its last task to finish.

    A ledger that stays contended (a burst, a loaded API server) does not fail the release: nothing was
    written, so the step defers on a short timer and releases again, for RELEASE_CONTENDED_SECONDS,
    without spending an Airflow retry (three tries that each lost the race left a reservation promised
    until its TTL; seen under a loaded chaos run)."""

    template_fields = ("job_id",)
    busy_poll_seconds = 5.0                   # the contention timer's jitter (defer_for_contention)
    contended_until: float | None = None      # while releasing again after contention: the deadline it carries

    def __init__(self, *, job_id: str | None = None, kubernetes_conn_id: str = "kubernetes_default",
                 ecs_conn_id: str = "alibaba_ecs_default", ledger_namespace: str = "default",
                 launch_task_id: str | None = None, **kwargs) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.ALL_DONE)
        super().__init__(**kwargs)
        self.job_id, self.kubernetes_conn_id, self.ledger_namespace = job_id, kubernetes_conn_id, ledger_namespace
        self.ecs_conn_id, self.launch_task_id = ecs_conn_id, launch_task_id

    def execute(self, context):
        job_id = self.job_id or context_job_id(self, context)
        try:
            return self.release(context, job_id)
        except (LedgerContended, LedgerConflict) as contended:
            deadline = self.contended_until or time.time() + RELEASE_CONTENDED_SECONDS
            defer_for_contention(self, contended, deadline, "resume_after_contention", "releasing again",
                                 late=f"job {job_id}: could not release its reservations for "
                                      f"{RELEASE_CONTENDED_SECONDS} s (they expire with their TTL)")

    def resume_after_contention(self, context, event: Mapping):
        """Back from a contended ledger: release again (idempotent), within the same deadline."""
        self.contended_until = CapacityWait.from_json(event["echo"]).deadline
        return self.execute(context)

    def release(self, context, job_id: str):
        """Release, drop the job from the queue, and fail when the job did not run to completion."""
        pods = self.kube().list_pods(f"{LABEL_JOB}={job_id}")
        used = {(p.get("spec") or {}).get("nodeName") for p in pods}
        launched = set(context["ti"].xcom_pull(task_ids=self.launch_task_id, key="nodes") or ()
                       if self.launch_task_id else ())
        used |= launched
        boot = self.job_boot(job_id)
        released = boot.finish(used=used - {None})
        if JobQueue(self.kube(), self.ledger_namespace).drop(job_id):  # out of the line and of its team's share
            let_go(boot.ledger, job_id)     # it had preempted and not placed: the nodes kept for it are free
        if released:
            line = (f"released {len(released)} reservation(s) of job {job_id}: "
                    + "; ".join(f"{r.task} on {r.node} ({r.resources})" for r in released))
        else:
            line = f"job {job_id} held no reservation"
        ran = sorted(used - {None})
        summarize(self, context, line + (f"; its pods ran on {', '.join(ran)}" if ran else "; no pod of it ran"))
        unfinished = completion(pods)
        if not pods and launched:
            unfinished = f"its pod(s) on {', '.join(sorted(launched))} were deleted before they finished"
        if unfinished is not None:
            raise AirflowFailException(f"job {job_id} did not run to completion ({unfinished}): the run fails; "
                                       "the reservations are released")
        return [r.task for r in released]

"""The `place` step: choose nodes for the job, reserve them in the ledger, or wait while busy.

The job is validated once, here: the canonical spec goes to the other steps via XCom (key
"job") next to the plan (return value).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from gpuboot.core.gang import draft_gang, spec_field
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.placement import Outcome, Plan
from gpuboot.core.ports import EcsError
from gpuboot.core.queue import never_fits_quota
from gpuboot.core.steplog import place_summary
from gpuboot.core.timefmt import utc_relative
from gpuboot.exceptions import SecondLedger
from gpuboot.hooks.kube import JOB_POD_RIGHTS
from gpuboot.lifecycle.batching import book_first
from gpuboot.lifecycle.booking import CONTENDED_SECONDS, Booker, LedgerContended
from gpuboot.lifecycle.jobqueue import CONFIGMAP, JobQueue, Turn, book_in_order, entry_of, queue_config
from gpuboot.operators.base import GpuJobStep, context_job_id, push, refusal, resolve_job, summarize, summarizes_failure
from gpuboot.operators.capacity_wait import CapacityWait, defer_for_contention
from gpuboot.triggers.wake_up import WakeUpTrigger


class PlaceGpuJobOperator(GpuJobStep, BaseOperator):
    """Choose a node for every task of the job (running nodes first, per-node fit), reserve
    that capacity in the ledger atomically, and return the plan. Busy: wait (deferred, timer)
    and re-plan until the job's queue timeout. Never fits: fail at once with the reason.
    Contended (a burst of placements kept the ledger changing for `contended_seconds`, or ECS
    answered a survey with a transient error): wait the same way, holding nothing, for a jittered
    few seconds, and place again; never a failure inside the queue timeout."""

    template_fields = ("job", "job_id")
    ui_color = "#e8f4ff"

    def __init__(self, *, job: Mapping | None = None, job_id: str | None = None,
                 kubernetes_conn_id: str = "kubernetes_default", ecs_conn_id: str = "alibaba_ecs_default",
                 ledger_namespace: str = "default", busy_poll_seconds: float = 30.0,
                 max_commit_attempts: int | None = None, boot_grace_seconds: float = 900,
                 contended_seconds: float = CONTENDED_SECONDS,
                 cpu_jobs_on_gpu_nodes: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.job, self.job_id = job, job_id
        self.cpu_jobs_on_gpu_nodes = cpu_jobs_on_gpu_nodes
        self.kubernetes_conn_id, self.ecs_conn_id = kubernetes_conn_id, ecs_conn_id
        self.ledger_namespace = ledger_namespace
        self.busy_poll_seconds = busy_poll_seconds
        self.max_commit_attempts = max_commit_attempts
        self.contended_seconds = contended_seconds
        self.boot_grace_seconds = boot_grace_seconds

    @summarizes_failure
    def execute(self, context):
        spec = self._spec(context)
        job_id = self.job_id or context_job_id(self, context)
        self.check_quota(spec, job_id)
        self.check_cluster(spec, job_id)
        # fixed at the job's first enqueue (a retry keeps it); start and wait read the same one
        deadline = JobQueue(self.kube(), self.ledger_namespace).deadline(job_id, spec.queue_timeout_seconds)
        return self._attempt(context, spec, deadline)

    def check_quota(self, spec: JobSpec, job_id: str) -> None:
        """A job its team's quota can never hold is refused now, not after a queue timeout."""
        try:
            never = never_fits_quota(entry_of(spec, job_id, time.time()), queue_config())
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from None
        if never:
            raise AirflowFailException(f"job {spec.name}: team: {never}. Ask for fewer GPUs (gpus x replicas, or "
                                       f"min_available), or set team to one whose quota can hold the job")

    @summarizes_failure
    def resume(self, context, event: Mapping):
        """Back from the busy-wait (its timer, or a release in the job queue): place again
        (the queue deadline comes back in the event)."""
        if event.get("woken") == "queue":
            self.log.info("woken by a release in the job queue: placing again")
        return self._attempt(context, self._spec(context), CapacityWait.from_json(event["echo"]).deadline)

    def _spec(self, context) -> JobSpec:
        """The job, with the operator's policy folded in: `cpu_jobs_on_gpu_nodes=False` keeps CPU-only
        jobs off GPU nodes even when they set allow_gpu_nodes; later steps re-place from this spec."""
        spec = resolve_job(self.job_values(), context, declared=self.params or ())
        if spec.allow_gpu_nodes and spec.gpus == 0 and not self.cpu_jobs_on_gpu_nodes:
            self.log.info("allow_gpu_nodes ignored: this place step forbids GPU nodes for CPU-only jobs "
                          "(cpu_jobs_on_gpu_nodes=False)")
            spec = dataclasses.replace(spec, allow_gpu_nodes=False)
        return spec

    def check_cluster(self, spec: JobSpec, job_id: str) -> None:
        """What the cluster must grant before anything is reserved or booted: the namespace, the
        rights to launch there, and the pods themselves."""
        self.check_namespace(spec)
        self.check_pods(spec, job_id)

    def check_namespace(self, spec: JobSpec) -> None:
        """The pods' namespace must exist, and this identity hold there what launching the pods
        needs (JOB_POD_RIGHTS), before anything is reserved or booted: either lack would otherwise
        be found only by launch, as a 404 or a 403 with the node up and the GPUs held."""
        kube = self.kube()
        if not kube.namespace_exists(spec.namespace):
            raise AirflowFailException(
                f"job {spec.name}: namespace: {spec.namespace!r} does not exist in the cluster. Create it "
                f"(kubectl create namespace {spec.namespace}) or set namespace to an existing one")
        missing = kube.denied(spec.namespace, JOB_POD_RIGHTS)
        if missing is None:
            self.log.warning("could not review gpuboot's rights in namespace %s (SelfSubjectAccessReview "
                             "refused); launch will find out", spec.namespace)
        elif missing:
            raise AirflowFailException(
                f"job {spec.name}: namespace: gpuboot may not {', '.join(missing)} in {spec.namespace!r}, which "
                f"launching the job's pods needs. Apply the Role and RoleBinding gpuboot-jobs of "
                f"deploy/kubernetes/rbac.yaml in {spec.namespace} (copy them with its name), or set namespace "
                f"to one where they are")

    def check_pods(self, spec: JobSpec, job_id: str) -> None:
        """The API server itself checks the pods launch will create (a dry run of each), before
        anything is reserved or booted: a pod it refuses would otherwise be found only by launch,
        with a node up and paid for. Its message names the field; a refusal ends the task without
        retries (the same pod is refused every time)."""
        kube = self.kube()
        for pod in draft_gang(spec, job_id, ranks=range(2)):    # rank 0 and one other: ranks differ in RANK only
            refused = kube.refusal_of_pod(spec.namespace, pod)
            if refused is not None:
                fields = sorted({f for f in map(spec_field, refused.fields or (None,)) if f})
                fix = f"Fix the job's {' / '.join(fields)}" if fields else "Fix the job spec"
                raise AirflowFailException(f"job {spec.name}: the API server refuses the pod launch would create "
                                           f"({refused.status}): {refused.message}. {fix}; nothing was reserved "
                                           f"or booted")

    def _attempt(self, context, spec: JobSpec, deadline: float):
        job_id = self.job_id or context_job_id(self, context)
        began = time.monotonic()
        try:
            plan = self.place_and_reserve(spec, job_id, deadline)
        except SecondLedger as exc:
            raise refusal(self, context, f"job {spec.name}: {exc}") from None
        except (LedgerContended, EcsError) as exc:
            if isinstance(exc, EcsError) and exc.kind != "transient":
                raise
            # a burst: the ledger kept changing, or ECS answered slowly to every survey at once
            defer_for_contention(self, exc, deadline, "resume", "placing again",
                                 late=f"job {spec.name} could not commit its placement before "
                                      f"queue_timeout_seconds={spec.queue_timeout_seconds}")
        self.log.info("placement of job %s (%s):\n%s", spec.name, job_id, plan.table())
        if plan.outcome == Outcome.NEVER:
            raise refusal(self, context, f"job {spec.name} can never run in this fleet: {plan.message}")
        if plan.outcome == Outcome.BUSY:
            now = time.time()
            if now >= deadline:
                raise refusal(self, context, f"job {spec.name} still waiting for capacity after "
                                             f"queue_timeout_seconds={spec.queue_timeout_seconds}: {plan.message}")
            wake = min(deadline, now + self.busy_poll_seconds)
            # the queue's line: position, who is ahead, what blocks it, the deadline
            why = self.turn.line(now) if self.turn and self.turn.step else \
                f"{plan.message}; queue deadline {utc_relative(deadline, now)}"
            wake_after = self.turn.wake_after if self.turn else None
            self.log.info("%s; re-planning in %.0fs at the latest%s", why, wake - now,
                          ", or as soon as a job is released" if wake_after is not None else "")
            self.defer(trigger=WakeUpTrigger(wake, CapacityWait(deadline, []).to_json(),
                                             queue=(self.ledger_namespace, CONFIGMAP), changes_seen=wake_after,
                                             kubernetes_conn_id=self.kubernetes_conn_id), method_name="resume")
        self.log.info("decision: %s; nodes to start: %s", plan.message, list(plan.nodes_to_start) or "none")
        push(context, "job", spec.to_dict(env_values=False))   # names only: launch reads the values
        push(context, "job_id", job_id)
        summarize(self, context, place_summary(spec.name, plan, time.monotonic() - began))
        return plan.to_json()

    turn: Turn | None = None

    def place_and_reserve(self, spec: JobSpec, job_id: str, deadline: float | None = None) -> Plan:
        """The shared place-and-reserve transaction (gpuboot.lifecycle.booking, through a batch in a burst:
        gpuboot.lifecycle.batching), committed when the job fits and the job queue admits it
        (gpuboot.lifecycle.jobqueue: its turn, or a backfill that delays no hold)."""
        kube = self.kube()
        booker = Booker(kube, self.ecs(), self.ledger(kube), self.log, max_commit_attempts=self.max_commit_attempts,
                        boot_grace_seconds=self.boot_grace_seconds, contended_seconds=self.contended_seconds)
        self.turn = book_in_order(booker, JobQueue(kube, self.ledger_namespace), spec, job_id, queue_config(),
                                  lambda: book_first(booker, spec, job_id), deadline)  # LedgerContended: the caller defers
        return self.turn.plan

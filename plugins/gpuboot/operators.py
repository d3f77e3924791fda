"""Airflow operators for one GPU job: place -> start -> (wait_gpu_ready) -> launch -> release.

They stay thin: gather inputs through the adapters (kube, ecs, ledger), call the pure
core (inventory, placement), do the I/O and log what was decided and why. The job is
validated once, by `place`, which hands the canonical spec to the other steps via XCom
(key "job") next to the plan (return value).
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import BaseOperator, TriggerRule
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from gpuboot.boot import DEFAULT_UNAVAILABLE_TTL_SECONDS, JobBoot
from gpuboot.booking import LAUNCH_MARGIN_SECONDS, Booker, LedgerContended, reservation_ttl
from gpuboot.jobspec import JobSpec, JobSpecError, params_schema
from gpuboot.model import LABEL_JOB, LABEL_TASK
from gpuboot.placement import Outcome, Plan
from gpuboot.stepbase import GpuJobStep
from gpuboot.triggers import WakeUpTrigger
from gpuboot.waiting import CapacityWait, WaitsForCapacity



# -- shared helpers ------------------------------------------------------------------------
def resolve_job(job: Mapping | None, context: Mapping, declared: Iterable[str] = ()) -> JobSpec:
    """The job from the `job` argument, or from the DAG run's params when it is None;
    an invalid job fails the task at once (no retry) with the field and the fix.

    From params, every key is part of the job except params the DAG declares for its own
    use (`declared` minus the JobSpec fields): a key the trigger conf brings that is neither
    (a typo such as `gpu`) is refused by JobSpec's unknown-field check, never dropped."""
    if job is None:
        own = set(declared) - set(params_schema())
        job = {k: v for k, v in (context.get("params") or {}).items() if k not in own}
        source = "DAG run params"
    else:
        source = "job"
    try:
        return JobSpec.from_dict(dict(job), source=source)
    except JobSpecError as exc:
        raise AirflowFailException(str(exc)) from None


def job_id_for(dag_id: str, run_id: str, group: str) -> str:
    """Stable across retries of one run, unique per (DAG, run, task group), a valid label value."""
    digest = hashlib.sha256(f"{dag_id}\x00{run_id}\x00{group}".encode()).hexdigest()[:20]
    return f"gb-{digest}"


def context_job_id(task: BaseOperator, context: Mapping) -> str:
    group = task.task_id.rpartition(".")[0]   # tasks of one task group share the job id
    return job_id_for(task.dag_id, context["run_id"], group)


def push(context: Mapping, key: str, value: Any) -> None:
    context["ti"].xcom_push(key=key, value=value)


# -- place ---------------------------------------------------------------------------------
class PlaceGpuJobOperator(GpuJobStep, BaseOperator):
    """Choose a node for every task of the job (running nodes first, per-node fit), reserve
    that capacity in the ledger atomically, and return the plan. Busy: wait (deferred, timer)
    and re-plan until the job's queue timeout. Never fits: fail at once with the reason."""

    template_fields = ("job", "job_id")
    ui_color = "#e8f4ff"

    def __init__(self, *, job: Mapping | None = None, job_id: str | None = None,
                 kubernetes_conn_id: str = "kubernetes_default", ecs_conn_id: str = "alibaba_ecs_default",
                 ledger_namespace: str = "default", busy_poll_seconds: float = 30.0,
                 max_commit_attempts: int = 20, boot_grace_seconds: float = 900,
                 cpu_jobs_on_gpu_nodes: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.job, self.job_id = job, job_id
        self.cpu_jobs_on_gpu_nodes = cpu_jobs_on_gpu_nodes
        self.kubernetes_conn_id, self.ecs_conn_id = kubernetes_conn_id, ecs_conn_id
        self.ledger_namespace = ledger_namespace
        self.busy_poll_seconds = busy_poll_seconds
        self.max_commit_attempts = max_commit_attempts
        self.boot_grace_seconds = boot_grace_seconds

    def execute(self, context):
        spec = self._spec(context)
        self.check_namespace(spec)
        return self._attempt(context, spec, time.time() + spec.queue_timeout_seconds)

    def resume(self, context, event: Mapping):
        """Back from the busy-wait timer: place again (the queue deadline comes back in the event)."""
        return self._attempt(context, self._spec(context), CapacityWait.from_json(event["echo"]).deadline)

    def _spec(self, context) -> JobSpec:
        """The job, with the operator's policy folded in: `cpu_jobs_on_gpu_nodes=False` keeps CPU-only
        jobs off GPU nodes even when they set allow_gpu_nodes; later steps re-place from this spec."""
        spec = resolve_job(self.job, context, declared=self.params or ())
        if spec.allow_gpu_nodes and spec.gpus == 0 and not self.cpu_jobs_on_gpu_nodes:
            self.log.info("allow_gpu_nodes ignored: this place step forbids GPU nodes for CPU-only jobs "
                          "(cpu_jobs_on_gpu_nodes=False)")
            spec = dataclasses.replace(spec, allow_gpu_nodes=False)
        return spec

    def check_namespace(self, spec: JobSpec) -> None:
        """The pods' namespace must exist before anything is reserved or booted: a missing one
        would otherwise be found only by launch, with the node up and the GPUs held."""
        if not self.kube().namespace_exists(spec.namespace):
            raise AirflowFailException(
                f"job {spec.name}: namespace: {spec.namespace!r} does not exist in the cluster. Create it "
                f"(kubectl create namespace {spec.namespace}) or set namespace to an existing one")

    def _attempt(self, context, spec: JobSpec, deadline: float):
        job_id = self.job_id or context_job_id(self, context)
        plan = self.place_and_reserve(spec, job_id)
        self.log.info("placement of job %s (%s):\n%s", spec.name, job_id, plan.table())
        if plan.outcome == Outcome.NEVER:
            raise AirflowFailException(f"job {spec.name} can never run in this fleet: {plan.message}")
        if plan.outcome == Outcome.BUSY:
            now = time.time()
            if now >= deadline:
                raise AirflowFailException(f"job {spec.name} still waiting for capacity after "
                                           f"queue_timeout_seconds={spec.queue_timeout_seconds}: {plan.message}")
            wake = min(deadline, now + self.busy_poll_seconds)
            self.log.info("%s; re-planning in %.0fs, giving up in %.0fs", plan.message, wake - now, deadline - now)
            self.defer(trigger=WakeUpTrigger(wake, CapacityWait(deadline, []).to_json()), method_name="resume")
        self.log.info("decision: %s; nodes to start: %s", plan.message, list(plan.nodes_to_start) or "none")
        push(context, "job", spec.to_dict())
        push(context, "job_id", job_id)
        return plan.to_json()

    def place_and_reserve(self, spec: JobSpec, job_id: str) -> Plan:
        """The shared place-and-reserve transaction (gpuboot.booking), committed when the job fits."""
        kube = self.kube()
        booker = Booker(kube, self.ecs(), self.ledger(kube), self.log,
                        max_commit_attempts=self.max_commit_attempts, boot_grace_seconds=self.boot_grace_seconds)
        try:
            return booker.book(spec, job_id).plan
        except LedgerContended as exc:
            raise AirflowException(str(exc)) from None


# -- start ---------------------------------------------------------------------------------
class StartGpuNodesOperator(GpuJobStep, WaitsForCapacity, BaseOperator):
    """Power on exactly the plan's stopped instances and record, per planned node, what the
    readiness rule needs (start time, bootID before the start, GPUs placed there).

    Capacity fallback (gpuboot.boot): an instance ECS cannot start for lack of stock marks
    its type in its zone unavailable for `unavailable_ttl_seconds` (shared by every run,
    in the ledger), and the job is re-placed and its new nodes started within this try, up
    to `max_capacity_attempts` failures; then the task fails naming each offering tried. When
    the job fits the fleet but the rest of it is busy right now, the task waits (deferred,
    holding nothing) and re-places every `busy_poll_seconds` until the job's queue timeout.
    Re-placing needs the job (`job`, the place step's XCom "job"); without it a capacity
    error fails the task. The plan the job ends up on is pushed as XCom "plan" (with
    "boots" and "started"); the sensor and the launch take it from there. Before anything
    else the step renews the job's reservations for its longest wait plus the launch, and
    every instance it starts is recorded in the job's ledger entry first (gpuboot.boot).
    """

    template_fields = ("plan", "job")
    ui_color = "#fff3e0"

    def __init__(self, *, plan: Mapping | Any, job: Mapping | Any = None,
                 kubernetes_conn_id: str = "kubernetes_default", ecs_conn_id: str = "alibaba_ecs_default",
                 ledger_namespace: str = "default", stopping_timeout_seconds: float = 600,
                 max_capacity_attempts: int = 3, unavailable_ttl_seconds: float = DEFAULT_UNAVAILABLE_TTL_SECONDS,
                 busy_poll_seconds: float = 30.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.plan, self.job = plan, job
        self.kubernetes_conn_id, self.ecs_conn_id = kubernetes_conn_id, ecs_conn_id
        self.ledger_namespace = ledger_namespace
        self.stopping_timeout_seconds = stopping_timeout_seconds
        self.max_capacity_attempts, self.unavailable_ttl_seconds = max_capacity_attempts, unavailable_ttl_seconds
        self.busy_poll_seconds = busy_poll_seconds

    def execute(self, context):
        plan = Plan.from_json(self.plan)
        boot = self._boot(plan)
        self._hold(boot)
        return self._pushed(context, self.bring_up_or_wait(boot, lambda: boot.ensure_up(plan), None, "resume"))

    def resume(self, context, event: Mapping):
        """Back from waiting for busy capacity (holding nothing): place again, or wait more."""
        boot = self._boot(Plan.from_json(self.plan))
        return self._pushed(context, self.capacity_resumed(boot, event["echo"], "resume"))

    def _boot(self, plan: Plan) -> JobBoot:
        return self.job_boot(plan.job_id, max_attempts=self.max_capacity_attempts,
                             stopping_timeout_seconds=self.stopping_timeout_seconds,
                             unavailable_ttl_seconds=self.unavailable_ttl_seconds)

    def _hold(self, boot: JobBoot) -> None:
        """This step may wait for an instance to stop, then the boot and the launch follow."""
        boot.hold(self.stopping_timeout_seconds + (reservation_ttl(boot.spec) if boot.spec else LAUNCH_MARGIN_SECONDS))

    @staticmethod
    def _pushed(context, result) -> dict:
        out = {"boots": result.boots, "started": result.started, "plan": result.plan.to_json()}
        for key, value in out.items():
            push(context, key, value)
        return out


# -- launch --------------------------------------------------------------------------------
def _toleration(t: Mapping) -> dict:
    """API-form toleration (camelCase) to the kubernetes model's keyword names."""
    names = {"tolerationSeconds": "toleration_seconds"}
    return {names.get(k, k): v for k, v in t.items()}


class GpuPodOperator(GpuJobStep, KubernetesPodOperator):
    """KubernetesPodOperator pinned to the planned node (nodeSelector kubernetes.io/hostname),
    requesting the job's GPUs/CPU/memory as requests and limits, labelled with the job and task.
    `task_name` picks one assignment of the plan (map it over the plan's tasks for gangs).
    Pods are kept when they finish (on_finish_action="keep_pod"): a terminated pod holds no
    capacity, and its record (node, exit code, log) stays for `kubectl logs` and audits;
    Kubernetes' terminated-pod GC or a retention job removes them later."""

    template_fields = (*KubernetesPodOperator.template_fields, "job", "plan", "task_name")

    def __init__(self, *, job: Mapping | Any = None, plan: Mapping | Any = None, task_name: str | None = None,
                 get_logs: bool = True, on_finish_action: str = "keep_pod",
                 startup_check_interval_seconds: int = 1, **kwargs) -> None:
        super().__init__(get_logs=get_logs, on_finish_action=on_finish_action,
                         startup_check_interval_seconds=startup_check_interval_seconds, **kwargs)
        self.job, self.plan, self.task_name = job, plan, task_name

    def execute(self, context):
        self.apply_plan()
        return super().execute(context)

    def apply_plan(self) -> None:
        from kubernetes.client import models as k8s

        spec = self.spec()
        plan = Plan.from_json(self.plan)
        chosen = [a for a in plan.assignments if self.task_name in (None, a.task)]
        if len(chosen) != 1:
            raise AirflowFailException(f"task_name {self.task_name!r} must name one of the plan's tasks: "
                                       f"{[a.task for a in plan.assignments]}")
        a = chosen[0]
        resources = a.requests.to_k8s()
        self.image, self.cmds, self.arguments = spec.image, list(spec.command), list(spec.args)
        self.env_vars = [k8s.V1EnvVar(name=k, value=str(v)) for k, v in spec.env.items()]
        self.namespace = spec.namespace
        self.name = self.name or a.task
        self.node_selector = {**spec.node_selector, **self.node_selector, "kubernetes.io/hostname": a.hostname}
        self.container_resources = k8s.V1ResourceRequirements(requests=resources, limits=resources)
        self.tolerations = [*self.tolerations, *(k8s.V1Toleration(**_toleration(t)) for t in spec.tolerations)]
        self.labels = {**self.labels, LABEL_JOB: plan.job_id, LABEL_TASK: a.task}
        self.log.info("launching %s on node %s (%s) with %s", a.task, a.node, a.hostname, a.requests)


# -- release -------------------------------------------------------------------------------
class ReleaseReservationOperator(GpuJobStep, BaseOperator):
    """End the job's reservations whatever happened upstream (idempotent). A node the job
    started (its ledger record) where none of its pods ran is stopped again unless another job
    claims it: a run that failed before its launch leaves no instance running."""

    template_fields = ("job_id",)

    def __init__(self, *, job_id: str | None = None, kubernetes_conn_id: str = "kubernetes_default",
                 ecs_conn_id: str = "alibaba_ecs_default", ledger_namespace: str = "default", **kwargs) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.ALL_DONE)
        super().__init__(**kwargs)
        self.job_id, self.kubernetes_conn_id, self.ledger_namespace = job_id, kubernetes_conn_id, ledger_namespace
        self.ecs_conn_id = ecs_conn_id

    def execute(self, context):
        job_id = self.job_id or context_job_id(self, context)
        used = {(p.get("spec") or {}).get("nodeName") for p in self.kube().list_pods(f"{LABEL_JOB}={job_id}")}
        boot = self.job_boot(job_id)
        released = boot.finish(used=used - {None})
        if released:
            self.log.info("released %d reservation(s) of job %s: %s", len(released), job_id,
                          "; ".join(f"{r.task} on {r.node} ({r.resources})" for r in released))
        else:
            self.log.info("job %s held no reservation", job_id)
        return [r.task for r in released]

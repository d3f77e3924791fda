"""Airflow operators for one GPU job: place -> start -> (wait_gpu_ready) -> launch -> release.

They stay thin: gather inputs through the adapters (kube, ecs, ledger), call the pure
core (inventory, placement), do the I/O and log what was decided and why. The job is
validated once, by `place`, which hands the canonical spec to the other steps via XCom
(key "job") next to the plan (return value).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import time
from collections.abc import Mapping
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import BaseOperator, TriggerRule
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from gpuboot.ecs import EcsError, EcsHook, InstanceOutcome
from gpuboot.inventory import NodeState, NodeView, Reservation, build_inventory, parse_provider_id
from gpuboot.jobspec import JobSpec, JobSpecError, params_schema
from gpuboot.kube import KubeClient
from gpuboot.ledger import LedgerConflict, ReservationLedger
from gpuboot.placement import Assignment, Outcome, Plan, place
from gpuboot.readiness import BootBaseline
from gpuboot.triggers import WakeUpTrigger

JOB_LABEL = "gpuboot.io/job"
TASK_LABEL = "gpuboot.io/task"
LAUNCH_MARGIN_SECONDS = 900     # reservation lifetime beyond the boot timeout (launch + scheduling)


# -- shared helpers ------------------------------------------------------------------------
def resolve_job(job: Mapping | None, context: Mapping) -> JobSpec:
    """The job from the `job` argument, or from the DAG run's params when it is None;
    an invalid job fails the task at once (no retry) with the field and the fix."""
    if job is None:
        fields = params_schema()
        job = {k: v for k, v in (context.get("params") or {}).items() if k in fields}
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


def instance_id_of(node: Mapping) -> str | None:
    parsed = parse_provider_id((node.get("spec") or {}).get("providerID"))
    return parsed[1] if parsed else None


def read_inventory(kube: KubeClient, ecs: EcsHook, reservations: list[Reservation], now: float,
                   boot_grace_seconds: float = 900) -> list[NodeView]:
    """Nodes and active pods from Kubernetes joined to their ECS instances and types."""
    nodes = kube.list_nodes()
    pods = kube.list_active_pods()
    ids = sorted({i for i in map(instance_id_of, nodes) if i})
    instances = ecs.describe_instances(ids) if ids else []
    types = ecs.describe_instance_types({i["InstanceType"] for i in instances if i.get("InstanceType")})
    return build_inventory(nodes, pods, instances, types, reservations, now,
                           boot_grace_seconds=boot_grace_seconds)


def parse_ecs_time(value: str | None) -> float | None:
    """ECS times look like 2024-05-01T08:30Z (minutes) or with seconds; returns epoch seconds."""
    if not value:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%MZ"):
        try:
            return dt.datetime.strptime(value, fmt).replace(tzinfo=dt.timezone.utc).timestamp()
        except ValueError:
            continue
    return None


class _GpuJobMixin:
    """Connections shared by the gpuboot operators."""

    def _clients(self) -> tuple[KubeClient, EcsHook]:
        return KubeClient(self.kubernetes_conn_id), EcsHook(self.ecs_conn_id)


# -- place ---------------------------------------------------------------------------------
class PlaceGpuJobOperator(_GpuJobMixin, BaseOperator):
    """Choose a node for every task of the job (running nodes first, per-node fit), reserve
    that capacity in the ledger atomically, and return the plan. Busy: wait (deferred, timer)
    and re-plan until the job's queue timeout. Never fits: fail at once with the reason."""

    template_fields = ("job", "job_id")
    ui_color = "#e8f4ff"

    def __init__(self, *, job: Mapping | None = None, job_id: str | None = None,
                 kubernetes_conn_id: str = "kubernetes_default", ecs_conn_id: str = "alibaba_ecs_default",
                 ledger_namespace: str = "default", busy_poll_seconds: float = 30.0,
                 max_commit_attempts: int = 20, boot_grace_seconds: float = 900, **kwargs) -> None:
        super().__init__(**kwargs)
        self.job, self.job_id = job, job_id
        self.kubernetes_conn_id, self.ecs_conn_id = kubernetes_conn_id, ecs_conn_id
        self.ledger_namespace = ledger_namespace
        self.busy_poll_seconds = busy_poll_seconds
        self.max_commit_attempts = max_commit_attempts
        self.boot_grace_seconds = boot_grace_seconds

    def execute(self, context):
        spec = resolve_job(self.job, context)
        return self._attempt(context, spec, time.time() + spec.queue_timeout_seconds)

    def resume(self, context, event: Mapping):
        """Back from the busy-wait timer: place again (the queue deadline comes back in the event)."""
        return self._attempt(context, resolve_job(self.job, context), float(event["echo"]["deadline"]))

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
            self.log.info("capacity busy (%s); re-planning in %.0fs, giving up in %.0fs",
                          plan.message, wake - now, deadline - now)
            self.defer(trigger=WakeUpTrigger(wake, {"deadline": deadline}), method_name="resume")
        self.log.info("decision: %s; nodes to start: %s", plan.message, list(plan.nodes_to_start) or "none")
        push(context, "job", spec.to_dict())
        push(context, "job_id", job_id)
        return plan.to_json()

    def place_and_reserve(self, spec: JobSpec, job_id: str) -> Plan:
        """Read ledger then cluster, place, commit with compare-and-swap; re-place on conflict.
        The ledger is read first so that a reservation released after this read belongs to a
        pod that the (later) pod listing already shows."""
        kube, ecs = self._clients()
        ledger = ReservationLedger(kube, self.ledger_namespace)
        request = spec.to_job_request(job_id)
        ttl = spec.reservation_ttl_seconds or spec.boot_timeout_seconds + LAUNCH_MARGIN_SECONDS
        for attempt in range(1, self.max_commit_attempts + 1):
            entries, version = ledger.read()
            now = time.time()
            others = [r for r in entries if r.job_id != job_id and r.expires_at > now]
            plan = place(request, read_inventory(kube, ecs, others, now, self.boot_grace_seconds))
            if plan.outcome != Outcome.FITS:
                return plan
            reservations = [Reservation(job_id=job_id, task=a.task, node=a.node, resources=a.requests,
                                        expires_at=now + ttl) for a in plan.assignments]
            try:
                ledger.commit(job_id, reservations, version)
            except LedgerConflict as exc:
                self.log.info("ledger changed while placing (%s); re-placing (attempt %d)", exc, attempt)
                continue
            self.log.info("reserved until %s: %s", dt.datetime.fromtimestamp(now + ttl, dt.timezone.utc)
                          .isoformat(timespec="seconds"),
                          "; ".join(f"{r.task} -> {r.node} ({r.resources})" for r in reservations))
            return plan
        raise AirflowException(f"ledger stayed contended for {self.max_commit_attempts} attempts; retry later")


# -- start ---------------------------------------------------------------------------------
class CapacityUnavailable(AirflowException):
    """ECS has no stock for an instance the plan chose (OperationDenied.NoStock and friends)."""


class StartGpuNodesOperator(_GpuJobMixin, BaseOperator):
    """Power on exactly the plan's stopped instances and record, per planned node, what the
    readiness rule needs (start time, bootID before the start, GPUs placed there)."""

    template_fields = ("plan",)
    ui_color = "#fff3e0"

    def __init__(self, *, plan: Mapping | Any, kubernetes_conn_id: str = "kubernetes_default",
                 ecs_conn_id: str = "alibaba_ecs_default", stopping_timeout_seconds: float = 600,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.plan = plan
        self.kubernetes_conn_id, self.ecs_conn_id = kubernetes_conn_id, ecs_conn_id
        self.stopping_timeout_seconds = stopping_timeout_seconds

    def execute(self, context):
        plan = Plan.from_json(self.plan)
        kube, ecs = self._clients()
        by_node: dict[str, list[Assignment]] = {}
        for a in plan.assignments:
            by_node.setdefault(a.node, []).append(a)
        to_start = {n: by_node[n][0].instance_id for n in plan.nodes_to_start}
        boot_ids = {n: ((kube.get_node(n).get("status") or {}).get("nodeInfo") or {}).get("bootID")
                    for n in by_node}
        requested_at = time.time()
        outcomes = self.start(ecs, [i for i in to_start.values() if i])
        started_elsewhere = {n for n, assigned in by_node.items()
                             if n not in to_start and assigned[0].state == NodeState.BOOTING}
        needs_start_time = [to_start[n] for n in to_start if outcomes[to_start[n]].outcome == "already"]
        needs_start_time += [by_node[n][0].instance_id for n in started_elsewhere if by_node[n][0].instance_id]
        start_times = ({i["InstanceId"]: parse_ecs_time(i.get("StartTime"))
                        for i in ecs.describe_instances(needs_start_time)} if needs_start_time else {})
        boots = []
        for node, assigned in sorted(by_node.items()):
            iid = assigned[0].instance_id
            if node in to_start:
                # A start done by an earlier try of this task shows as "already": trust ECS's StartTime.
                since = requested_at if outcomes[iid].outcome == "done" else start_times.get(iid) or requested_at
            elif node in started_elsewhere:
                since = start_times.get(iid)
            else:
                since = None
            baseline = BootBaseline(node=node, start_requested_at=since, boot_id_before=boot_ids[node],
                                    gpus_needed=sum(a.requests.gpus for a in assigned))
            boots.append(baseline.to_json())
            self.log.info("node %s (%s, %s): start requested at %s, bootID before %s, needs %d GPU(s)",
                          node, iid, assigned[0].state.value, since, boot_ids[node], baseline.gpus_needed)
        started = sorted(i for i in to_start.values() if i and outcomes[i].outcome == "done")
        push(context, "boots", boots)
        push(context, "started", started)
        return {"boots": boots, "started": started}

    def start(self, ecs: EcsHook, instance_ids: list[str]) -> dict[str, InstanceOutcome]:
        """Start the instances; wait out any still Stopping, then start those too."""
        outcomes = ecs.start_instances(instance_ids) if instance_ids else {}
        stopping = [i for i, o in outcomes.items() if o.outcome == "stopping"]
        if stopping:
            self.log.info("waiting for %s to finish stopping before starting them", stopping)
            statuses = ecs.wait_for_status(stopping, {"Stopped"}, self.stopping_timeout_seconds)
            stuck = {i: s for i, s in statuses.items() if s != "Stopped"}
            if stuck:
                raise AirflowException(f"instances still not Stopped after {self.stopping_timeout_seconds}s: {stuck}")
            outcomes.update(ecs.start_instances(stopping))
        for iid, outcome in outcomes.items():
            if not outcome.ok:
                self.on_start_failure(iid, outcome.error)
        return outcomes

    def on_start_failure(self, instance_id: str, error: EcsError | None) -> None:
        """Seam for capacity fallback (release, mark the type/zone unavailable, re-place)."""
        if error is not None and error.kind == "capacity":
            raise CapacityUnavailable(f"instance {instance_id} cannot start, no capacity: {error}")
        raise AirflowException(f"instance {instance_id} failed to start: {error}")


# -- launch --------------------------------------------------------------------------------
def _toleration(t: Mapping) -> dict:
    """API-form toleration (camelCase) to the kubernetes model's keyword names."""
    names = {"tolerationSeconds": "toleration_seconds"}
    return {names.get(k, k): v for k, v in t.items()}


class GpuPodOperator(KubernetesPodOperator):
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

        spec = JobSpec.from_dict(dict(self.job), source="job")
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
        self.labels = {**self.labels, JOB_LABEL: plan.job_id, TASK_LABEL: a.task}
        self.log.info("launching %s on node %s (%s) with %s", a.task, a.node, a.hostname, a.requests)


# -- release -------------------------------------------------------------------------------
class ReleaseReservationOperator(BaseOperator):
    """End the job's reservations whatever happened upstream (idempotent)."""

    template_fields = ("job_id",)

    def __init__(self, *, job_id: str | None = None, kubernetes_conn_id: str = "kubernetes_default",
                 ledger_namespace: str = "default", **kwargs) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.ALL_DONE)
        super().__init__(**kwargs)
        self.job_id, self.kubernetes_conn_id, self.ledger_namespace = job_id, kubernetes_conn_id, ledger_namespace

    def execute(self, context):
        job_id = self.job_id or context_job_id(self, context)
        released = ReservationLedger(KubeClient(self.kubernetes_conn_id), self.ledger_namespace).release(job_id)
        if released:
            self.log.info("released %d reservation(s) of job %s: %s", len(released), job_id,
                          "; ".join(f"{r.task} on {r.node} ({r.resources})" for r in released))
        else:
            self.log.info("job %s held no reservation", job_id)
        return [r.task for r in released]

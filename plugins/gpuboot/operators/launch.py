"""The `launch` step: the job's pods, one per rank of the plan, launched and failed as one gang."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from gpuboot.core.gang import CONTAINER, LABEL_ATTEMPT, MASTER_PORT, RankFailure, adoptable, gang_pods, rank_failure
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import LABEL_HOSTNAME, LABEL_JOB, LABEL_RANK
from gpuboot.core.placement import Plan
from gpuboot.core.steplog import launch_summary
from gpuboot.core.timefmt import duration
from gpuboot.hooks.kube import Conflict, InvalidRequest, KubeClient
from gpuboot.lifecycle.jobqueue import JobQueue, Preempted
from gpuboot.lifecycle.preemption import GONE_SECONDS, delete_and_wait
from gpuboot.operators.base import GpuJobStep, push, resolve_job, summarize
from gpuboot.operators.requeue import RequeuesWhenPreempted
from gpuboot.triggers.gang import GangTrigger


class GpuPodOperator(GpuJobStep, RequeuesWhenPreempted, BaseOperator):
    """Every task of the plan as one gang of pods (rank = the assignment's position), each pinned
    to its planned node (gpuboot.core.gang.node_selector) with the job's requests as requests and
    limits and the rank environment (WORLD_SIZE, RANK, NODE_RANK, MASTER_ADDR = rank 0's pod
    IP, MASTER_PORT, GPUBOOT_TASK_INDEX; see gpuboot.core.gang for why the pod IP). A one-task job is
    a gang of one.

    One fate: when a rank fails (non-zero exit, refused at admission, its node lost, its pod
    deleted) the other ranks are deleted and the step fails with the rank, its exit code and its
    last log lines; the Airflow retry deletes what is left of that attempt and launches the
    whole gang again. A retry after a crashed worker instead adopts the gang when all its pods
    are still live (or done): no second pod per rank. The failed rank's pod is kept until
    then, for `kubectl logs` and audits; pods of a finished gang are kept as records (they hold
    no capacity once terminated).

    Deferrable by default: once the pods are created the wait is a GangTrigger in the
    triggerer (no worker slot held), which streams every rank's log into the task log,
    prefixed `[rank N]`. `deferrable=False` runs the same trigger in the worker.

    Preempted (gpuboot.lifecycle.preemption: a higher job's place step deleted the pods): requeued,
    not failed. The step logs by whom and why, waits in the job queue with the job's first enqueue
    time, and places, brings up and launches the job again itself (gpuboot.operators.requeue)."""

    # "Rendered Templates" shows `launched`, what the gang runs (computed right after rendering,
    # env names only: values may be secret), stored again at the end with the pods' real names.
    template_fields = ("job", "plan", "launched")
    overwrite_rtif_after_execution = True

    def __init__(self, *, job: Mapping | Any = None, plan: Mapping | Any = None, env_source: Mapping | None = None,
                 kubernetes_conn_id: str = "kubernetes_default", deferrable: bool = True,
                 poll_seconds: float = 2.0, startup_timeout_seconds: float = 300.0, log_tail_lines: int = 20,
                 ecs_conn_id: str = "alibaba_ecs_default", ledger_namespace: str = "default",
                 busy_poll_seconds: float = 30.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.job, self.plan, self.kubernetes_conn_id = job, plan, kubernetes_conn_id
        self.ecs_conn_id, self.ledger_namespace, self.busy_poll_seconds = ecs_conn_id, ledger_namespace, busy_poll_seconds
        # where the env's values are when `job` is the place step's XCom (names only): the job as the
        # place step got it (a mapping, or None: the DAG run's params). Not a template field: never shown.
        self.env_source = env_source
        self.deferrable, self.poll_seconds = deferrable, poll_seconds
        self.startup_timeout_seconds, self.log_tail_lines = startup_timeout_seconds, log_tail_lines
        self.launched: dict = {}

    def render_template_fields(self, context, jinja_env=None) -> None:
        super().render_template_fields(context, jinja_env)
        if self.job and self.plan:
            self.launched = what_runs(self.spec(), Plan.from_json(self.plan), int(context["ti"].try_number))

    def execute(self, context):
        spec, plan = self.spec(), Plan.from_json(self.plan)
        if spec is None:
            raise AirflowFailException("launch needs the job (XCom 'job' of place)")
        spec = self._with_env_values(spec, context)
        record = self.preemption(plan.job_id)
        if record is not None:           # preempted before its pods ran (or a retry after a failed requeue)
            return self.requeued(context, spec, record)
        if not plan.assignments:
            raise AirflowFailException("launch needs a plan with assignments (XCom 'plan' of wait_gpu_ready)")
        return self.relaunch(context, spec, plan)

    def relaunch(self, context, spec: JobSpec, plan: Plan, handled: Preempted | None = None):
        """The gang on `plan` (adopted when a crashed try left it live), then the wait for its verdict.
        `handled`: the preemption this launch follows (settled once the pods exist)."""
        kube = self.kube()
        existing = kube.list_pods(f"{LABEL_JOB}={plan.job_id}")
        adopted = adoptable(existing, len(plan.assignments), int(context["ti"].try_number))
        if adopted is not None:
            attempt, names = adopted
            self.log.info("adopting the gang of attempt %d, still live: %s", attempt, ", ".join(names))
        else:
            self._clear(kube, existing)
            attempt = int(context["ti"].try_number)
            names = self._create(kube, spec, plan, attempt)
        # read after the pods exist (gpuboot.lifecycle.preemption): a preemptor that wrote its record before
        # listing our pods deleted them; one that listed them before they existed is seen here
        record = self.preemption(plan.job_id)
        if record is not None and record != handled:
            self._clear(kube, kube.list_pods(f"{LABEL_JOB}={plan.job_id}"))
            return self.requeued(context, spec, record)
        if handled is not None:
            JobQueue(kube, self.ledger_namespace).settle(handled)
        self.launched = {**what_runs(spec, plan, attempt), "pods": names}
        # where the gang runs, for release: a cancel deletes the pods, yet their nodes did run the job
        push(context, "nodes", sorted({a.node for a in plan.assignments}))
        trigger = GangTrigger(spec.namespace, plan.job_id, attempt, names, self.kubernetes_conn_id, self.poll_seconds,
                              started_at=time.time())
        return self._wait_on(trigger, "execute_complete", context)

    def _spec_for_requeue(self, context) -> JobSpec:
        return self._with_env_values(self.spec(), context)

    def _with_env_values(self, spec: JobSpec, context) -> JobSpec:
        """The job with its env values, read from the job's source (env_source, rendered here, or the
        DAG run's params) when `job` carries the names only; never logged nor stored."""
        if not spec.env_withheld:
            return spec
        if self.env_source is None and "name" not in (context.get("params") or {}):
            raise AirflowFailException(
                f"job {spec.name}: env: the values of {', '.join(sorted(spec.env))} are withheld from the job launch "
                "got (the place step's XCom 'job' holds names only). Pass env_source=<the job mapping the place "
                "step got> to the launch operator (gpu_job_group does), or take the job from the DAG run's params")
        source = self.render_template(self.env_source, context) if self.env_source is not None else None
        values = resolve_job(source, context, declared=self.params or ()).env
        if set(values) != set(spec.env):
            raise AirflowFailException(f"job {spec.name}: env: the job's source now sets {sorted(values)}, the place "
                                       f"step placed it with {sorted(spec.env)}. Clear the run from place")
        return dataclasses.replace(spec, env=values)

    def on_kill(self) -> None:
        """Killed in the worker (execution_timeout, marked failed while not deferred): delete the gang's
        pods. The deferred wait is the trigger's: GangTrigger.on_kill."""
        pods = list(self.launched.get("pods") or [])
        spec = self.spec()
        if not pods or spec is None:
            return
        kube = self.kube()
        for name in pods:
            kube.delete_pod(spec.namespace, name)
        self.log.warning("killed while the gang ran: deleted its pod(s) %s", ", ".join(pods))

    def execute_complete(self, context, event: Mapping):
        names, namespace = list(event["pods"]), event["namespace"]
        elapsed = time.time() - float(event.get("started_at") or time.time())
        nodes = ", ".join(self.launched.get("nodes") or []) or "?"
        spec = self.spec()
        what = (spec.name if len(names) == 1 else f"{spec.name} (gang of {len(names)})") if spec else "gang"
        push(context, "pods", event.get("times") or [])     # bound, running, finished per rank: the run page
        if event["status"] == "succeeded":
            self.log.info("gang %s: all %d rank(s) succeeded: %s", event["job_id"], len(names), ", ".join(names))
            summarize(self, context, launch_summary(what, nodes, ", ".join(names), "Succeeded", elapsed))
            return names
        failure = RankFailure.from_json(event["failure"])
        kube = self.kube()
        others = [n for n in names if n != failure.pod]
        for name in others:
            kube.delete_pod(namespace, name)
        record = self.preemption(event["job_id"]) if spec is not None else None
        if record is not None:           # its pods deleted by a preemptor: requeued, not failed
            self.log.warning("gang %s ended short (%s): its job was preempted", event["job_id"], failure.describe())
            return self.requeued(context, self._with_env_values(spec, context), record)
        summarize(self, context, launch_summary(what, nodes, failure.pod,
                                                f"Failed (rank {failure.rank})", elapsed, failure.exit_code))
        raise AirflowException(self._failure_message(kube, namespace, failure, names, others, event.get("tail")))

    def _failure_message(self, kube: KubeClient, namespace: str, failure: RankFailure, names: list[str],
                         others: list[str], streamed: list[str] | None = None) -> str:
        """The failure with the rank's last log lines: from its pod, else (the pod is gone, deleted mid-run)
        those the trigger streamed into this task's log."""
        tail = kube.pod_log_tail(namespace, failure.pod, self.log_tail_lines, CONTAINER)
        if not tail and streamed:
            tail = list(streamed)[-self.log_tail_lines:]
        deleted = f"; the other rank(s) deleted: {', '.join(others)}" if others else ""
        if not tail:
            return (f"gang of {len(names)}: {failure.describe()}{deleted}. Rank {failure.rank} wrote no log line "
                    "(its container never started, or printed nothing)")
        lines = "\n".join(f"  {line}" for line in tail)
        return (f"gang of {len(names)}: {failure.describe()}{deleted}. "
                f"Last {len(tail)} log line(s) of rank {failure.rank}:\n{lines}")

    def _create(self, kube: KubeClient, spec, plan: Plan, attempt: int) -> list[str]:
        """Rank 0 first; the others once its pod IP (their MASTER_ADDR) is known. A gang of one
        has no one to tell: its pod is created and left to the trigger."""
        first = gang_pods(spec, plan, attempt, None, ranks=[0])[0]
        self._create_pod(kube, first)
        name = first["metadata"]["name"]
        if len(plan.assignments) == 1:
            return [name]
        ip = self._wait_for_ip(kube, spec.namespace, name, plan.assignments[0].node)
        rest = gang_pods(spec, plan, attempt, ip, ranks=range(1, len(plan.assignments)))
        for pod in rest:
            self._create_pod(kube, pod)
        self.log.info("gang of %d launched (attempt %d): MASTER_ADDR=%s MASTER_PORT=%d (rank 0's pod IP)",
                      len(plan.assignments), attempt, ip, MASTER_PORT)
        return [name] + [p["metadata"]["name"] for p in rest]

    def _create_pod(self, kube: KubeClient, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        try:
            kube.create_pod(meta["namespace"], pod)
        except Conflict:   # created by this very try before a hiccup: the same pod
            self.log.info("pod %s already exists", meta["name"])
        except InvalidRequest as refused:  # the same pod is refused on every retry
            raise AirflowFailException(f"the API server refuses pod {meta['name']} ({refused.status}): "
                                       f"{refused.message}") from None
        container = spec["containers"][0]
        self.log.info("rank %s: pod %s on node %s with %s", meta["labels"][LABEL_RANK], meta["name"],
                      spec["nodeSelector"][LABEL_HOSTNAME],
                      " ".join(f"{k}={v}" for k, v in container["resources"]["requests"].items()))

    def _wait_for_ip(self, kube: KubeClient, namespace: str, name: str, node: str) -> str:
        """Rank 0's pod IP, watched for (it comes at the kubelet's first status write, within
        milliseconds of admission; a poll would add its interval to every gang's start)."""
        for pod in kube.pod_states(namespace, name, self.startup_timeout_seconds):
            ip = ((pod or {}).get("status") or {}).get("podIP")
            if ip:
                return ip
            failure = rank_failure(0, pod)
            if failure is not None:
                raise AirflowException(self._failure_message(kube, namespace, failure, [name], []))
        kube.delete_pod(namespace, name)
        raise AirflowException(f"rank 0 (pod {name}) got no pod IP on node {node} within "
                               f"{duration(self.startup_timeout_seconds)} (startup_timeout_seconds); deleted it")

    def _clear(self, kube: KubeClient, pods: list[dict]) -> None:
        """Delete every pod of earlier attempts and wait until they are gone, so the new gang
        never runs beside a leftover (nor finds its GPUs still held by one). A pod on a lost
        node stays Terminating: it is force-deleted after GONE_SECONDS."""
        if not pods:
            return
        self.log.info("deleting %d pod(s) left by earlier attempt(s) %s: %s", len(pods),
                      sorted({(p["metadata"].get("labels") or {}).get(LABEL_ATTEMPT, "?") for p in pods}),
                      ", ".join(sorted({p["metadata"]["name"] for p in pods})))
        left = delete_and_wait(kube, pods, min(self.poll_seconds, 1.0), GONE_SECONDS)
        if left:
            raise AirflowException(f"pods of an earlier attempt are still there: {left}")


def what_runs(spec, plan: Plan, attempt: int) -> dict:
    """What the gang runs, for "Rendered Templates": image, command, args, the env's names
    (never its values), nodes and pods by rank, resources per pod, namespace."""
    pods = gang_pods(spec, plan, attempt, master_addr=None)
    container = pods[0]["spec"]["containers"][0] if pods else {}
    return {
        "namespace": spec.namespace,
        "nodes": [p["spec"]["nodeSelector"][LABEL_HOSTNAME] for p in pods],
        "pods": [p["metadata"]["name"] for p in pods],
        "image": spec.image,
        "command": list(spec.command),
        "args": list(spec.args),
        "env": sorted({e["name"] for e in container.get("env") or []}),
        "env_from": list(spec.env_from_secrets),   # (a key named like "secret" is masked by Airflow)
        "resources": dict((container.get("resources") or {}).get("requests") or {}),
    }


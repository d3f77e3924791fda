"""The `launch` step: the job's pod (a KubernetesPodOperator) pinned to its planned node."""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk.exceptions import AirflowFailException

from gpuboot.model import LABEL_JOB, LABEL_TASK
from gpuboot.placement import Plan
from gpuboot.steplog import launch_summary
from gpuboot.steps.base import GpuJobStep, summarize


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

    # "Rendered Templates" shows what Airflow stored after rendering, before execute(): the plan is
    # applied right after rendering (render_template_fields) so image, cmds, arguments, node_selector
    # and container_resources there are the pod's, and `launched` sums it up with the env's names
    # only (env_vars is left out: its values may be secret; the job's env comes from the job spec).
    template_fields = (*(f for f in KubernetesPodOperator.template_fields if f != "env_vars"),
                       "job", "plan", "task_name", "launched")
    overwrite_rtif_after_execution = True    # stored again at the end, with the pod's real name

    def __init__(self, *, job: Mapping | Any = None, plan: Mapping | Any = None, task_name: str | None = None,
                 get_logs: bool = True, on_finish_action: str = "keep_pod",
                 startup_check_interval_seconds: int = 1, **kwargs) -> None:
        super().__init__(get_logs=get_logs, on_finish_action=on_finish_action,
                         startup_check_interval_seconds=startup_check_interval_seconds, **kwargs)
        self.job, self.plan, self.task_name = job, plan, task_name
        self.launched: dict = {}

    def render_template_fields(self, context, jinja_env=None) -> None:
        super().render_template_fields(context, jinja_env)
        self._applied_plan()

    def _applied_plan(self) -> None:
        """apply_plan once per task instance (it extends tolerations), then what will run."""
        if not getattr(self, "_plan_applied", False):
            self.apply_plan()
            self._plan_applied = True
        self.launched = what_runs(self)

    def execute(self, context):
        self._applied_plan()
        began, outcome = time.monotonic(), "failed"
        try:
            result = super().execute(context)
            outcome = "Succeeded"
            return result
        finally:
            pod = getattr(self, "pod", None)
            if pod is not None and pod.metadata is not None:
                self.launched = {**self.launched, "pod": pod.metadata.name}
            summarize(self, context, launch_summary(self.name or "", self.launched.get("node") or "?",
                                                    self.launched.get("pod") if pod is not None else None,
                                                    outcome, time.monotonic() - began))

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


def what_runs(op: KubernetesPodOperator) -> dict:
    """The container and placement the pod gets, for "Rendered Templates": image, command, args,
    the env's names (never its values), node, resources, namespace."""
    resources = op.container_resources
    return {
        "node": (op.node_selector or {}).get("kubernetes.io/hostname"),
        "namespace": op.namespace,
        "pod": op.name,
        "image": op.image,
        "command": list(op.cmds or []),
        "args": list(op.arguments or []),
        "env": sorted({getattr(e, "name", None) or str(e) for e in op.env_vars or ()}),
        "resources": dict(getattr(resources, "requests", None) or {}),
    }

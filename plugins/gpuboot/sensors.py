"""GpuReadySensor: the `wait_gpu_ready` step, deferrable by default.

Deferred, it hands one node at a time to NodeGpuReadyTrigger (a watch in the
triggerer, no worker slot held); in poke mode it applies the same ReadinessTracker to
Node reads. Either way the boot timeout fails the task with what was last seen.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowFailException

from gpuboot.jobspec import JobSpec
from gpuboot.kube import KubeClient
from gpuboot.readiness import BootBaseline, ReadinessTracker
from gpuboot.triggers import NodeGpuReadyTrigger


def describe_evidence(evidence: Mapping[str, Any]) -> str:
    """One line for the task log: Ready? GPUs? bootID? heartbeat age?"""
    keys = ("ready", "gpus_allocatable", "boot_id", "boot_id_changed", "heartbeat_age_seconds", "held_seconds")
    shown = [f"{k}={evidence[k]}" for k in keys if k in evidence]
    shown += [f"{k}={v}" for k, v in sorted(evidence.items()) if k not in keys]
    return ", ".join(shown) or "nothing"


class GpuReadySensor(BaseSensorOperator):
    """Wait until every node of the plan passes the GPU-readiness rule.

    `boots` is the start step's list of baselines (XCom key "boots"); settle window and
    boot timeout come from the job (XCom key "job" of the place step) unless given.
    Returns the plan's task names, now cleared to launch (what `launch` is mapped over);
    the per-node evidence goes to XCom key "evidence"."""

    template_fields = ("boots", "job", "plan")
    ui_color = "#e8f5e9"

    def __init__(self, *, boots: Sequence[Mapping] | Any, job: Mapping | Any = None, plan: Mapping | Any = None,
                 settle_seconds: float | None = None, boot_timeout_seconds: float | None = None,
                 kubernetes_conn_id: str = "kubernetes_default", deferrable: bool = True,
                 poke_interval: float = 2.0, **kwargs) -> None:
        if not deferrable and kwargs.get("mode") == "reschedule":
            raise ValueError("mode='reschedule' would restart the settle window on every poke; "
                             "use deferrable=True or mode='poke'")
        super().__init__(poke_interval=poke_interval, **kwargs)
        self.boots, self.job, self.plan = boots, job, plan
        self.settle_seconds, self.boot_timeout_seconds = settle_seconds, boot_timeout_seconds
        self.kubernetes_conn_id, self.deferrable = kubernetes_conn_id, deferrable
        self._trackers: dict[str, ReadinessTracker] = {}
        self._deadline: float | None = None

    def _timing(self) -> tuple[float, float]:
        spec = JobSpec.from_dict(dict(self.job), source="job") if self.job else None
        settle = self.settle_seconds if self.settle_seconds is not None else (spec.settle_seconds if spec else 5)
        timeout = (self.boot_timeout_seconds if self.boot_timeout_seconds is not None
                   else (spec.boot_timeout_seconds if spec else 900))
        return float(settle), float(timeout)

    def execute(self, context):
        settle, timeout = self._timing()
        if not self.boots:
            self.log.info("no node to wait for")
            return self._cleared(context, {})
        if not self.deferrable:
            self.timeout = timeout + 60            # our own deadline fails first, with evidence
            self._deadline = time.time() + timeout
            return super().execute(context)
        return self._defer_for(0, time.time() + timeout, settle, {})

    def _defer_for(self, index: int, deadline: float, settle: float, seen: dict):
        baseline = self.boots[index]
        self.log.info("waiting for node %s (%d/%d) until %s", baseline["node"], index + 1, len(self.boots),
                      time.strftime("%H:%M:%S", time.gmtime(deadline)))
        self.defer(trigger=NodeGpuReadyTrigger(baseline=dict(baseline), deadline=deadline, settle_seconds=settle,
                                               kubernetes_conn_id=self.kubernetes_conn_id,
                                               echo={"index": index, "deadline": deadline, "settle": settle,
                                                     "seen": seen}),
                   method_name="execute_complete")

    def execute_complete(self, context, event: Mapping):
        """Back from the trigger; where we were (which node, deadline) comes back in event["echo"]."""
        node, state = event.get("node"), event["echo"]
        index, deadline, settle, seen = state["index"], state["deadline"], state["settle"], state["seen"]
        if event.get("status") != "ready":
            raise AirflowFailException(f"node {node} not GPU-ready before the boot timeout: {event.get('reason')}; "
                                       f"last seen: {describe_evidence(event.get('evidence') or {})}")
        self.log.info("node %s is GPU-ready: %s", node, describe_evidence(event.get("evidence") or {}))
        seen = {**seen, node: event.get("evidence") or {}}
        if index + 1 < len(self.boots):
            self._defer_for(index + 1, deadline, settle, seen)
        return self._cleared(context, seen)

    def _cleared(self, context, evidence: dict) -> list[str]:
        context["ti"].xcom_push(key="evidence", value=evidence)
        return [a["task"] for a in (self.plan or {}).get("assignments", [])]

    def poke(self, context):
        settle, _ = self._timing()
        kube = KubeClient(self.kubernetes_conn_id)
        now = time.time()
        verdicts = {}
        for b in self.boots:
            tracker = self._trackers.setdefault(b["node"], ReadinessTracker(BootBaseline.from_json(b), settle))
            verdicts[b["node"]] = tracker.observe(kube.get_node(b["node"]), now)
        waiting = {n: v for n, v in verdicts.items() if not v.ready}
        if not waiting:
            cleared = self._cleared(context, {n: dict(v.evidence) for n, v in verdicts.items()})
            return PokeReturnValue(is_done=True, xcom_value=cleared)
        for node, verdict in waiting.items():
            self.log.info("node %s not ready yet: %s", node, verdict.reason)
        if self._deadline is not None and now >= self._deadline:
            node, verdict = next(iter(waiting.items()))
            raise AirflowFailException(f"node {node} not GPU-ready before the boot timeout: {verdict.reason}; "
                                       f"last seen: {describe_evidence(verdict.evidence)}")
        return False

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
    boot timeout come from the job (XCom key "job" of the place step) unless given."""

    template_fields = ("boots", "job")
    ui_color = "#e8f5e9"

    def __init__(self, *, boots: Sequence[Mapping] | Any, job: Mapping | Any = None,
                 settle_seconds: float | None = None, boot_timeout_seconds: float | None = None,
                 kubernetes_conn_id: str = "kubernetes_default", deferrable: bool = True,
                 poke_interval: float = 2.0, **kwargs) -> None:
        if not deferrable and kwargs.get("mode") == "reschedule":
            raise ValueError("mode='reschedule' would restart the settle window on every poke; "
                             "use deferrable=True or mode='poke'")
        super().__init__(poke_interval=poke_interval, **kwargs)
        self.boots, self.job = boots, job
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
            return {}
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
                                               kubernetes_conn_id=self.kubernetes_conn_id),
                   method_name="execute_complete",
                   kwargs={"index": index, "deadline": deadline, "settle": settle, "seen": seen})

    def execute_complete(self, context, event: Mapping, index: int, deadline: float, settle: float, seen: dict):
        node = event.get("node")
        if event.get("status") != "ready":
            raise AirflowFailException(f"node {node} not GPU-ready before the boot timeout: {event.get('reason')}; "
                                       f"last seen: {describe_evidence(event.get('evidence') or {})}")
        self.log.info("node %s is GPU-ready: %s", node, describe_evidence(event.get("evidence") or {}))
        seen = {**seen, node: event.get("evidence") or {}}
        if index + 1 < len(self.boots):
            self._defer_for(index + 1, deadline, settle, seen)
        return seen

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
            return PokeReturnValue(is_done=True, xcom_value={n: dict(v.evidence) for n, v in verdicts.items()})
        for node, verdict in waiting.items():
            self.log.info("node %s not ready yet: %s", node, verdict.reason)
        if self._deadline is not None and now >= self._deadline:
            node, verdict = next(iter(waiting.items()))
            raise AirflowFailException(f"node {node} not GPU-ready before the boot timeout: {verdict.reason}; "
                                       f"last seen: {describe_evidence(verdict.evidence)}")
        return False

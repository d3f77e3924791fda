"""The `start` step: power on the plan's stopped instances, falling back when ECS has no stock."""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator

from gpuboot.core.placement import Plan
from gpuboot.core.steplog import start_summary
from gpuboot.lifecycle.booking import LAUNCH_MARGIN_SECONDS, reservation_ttl
from gpuboot.lifecycle.boot import DEFAULT_UNAVAILABLE_TTL_SECONDS, JobBoot
from gpuboot.operators.base import GpuJobStep, push, summarize, summarizes_failure
from gpuboot.operators.capacity_wait import WaitsForCapacity


class StartGpuNodesOperator(GpuJobStep, WaitsForCapacity, BaseOperator):
    """Power on exactly the plan's stopped instances and record, per planned node, what the
    readiness rule needs (start time, bootID before the start, GPUs placed there).

    Capacity fallback (gpuboot.lifecycle.boot): an instance ECS cannot start for lack of stock marks
    its type in its zone unavailable for `unavailable_ttl_seconds` (shared by every run,
    in the ledger), and the job is re-placed and its new nodes started within this try, up
    to `max_capacity_attempts` failures; then the task fails naming each offering tried. When
    the job fits the fleet but the rest of it is busy right now, the task waits (deferred,
    holding nothing) and re-places every `busy_poll_seconds` until the job's queue timeout.
    Re-placing needs the job (`job`, the place step's XCom "job"); without it a capacity
    error fails the task. The plan the job ends up on is pushed as XCom "plan" (with
    "baselines" and "started"); the sensor and the launch take it from there. Before anything
    else the step renews the job's reservations for its longest wait plus the launch, and
    every instance it starts is recorded in the job's ledger entry first (gpuboot.lifecycle.boot).
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

    @summarizes_failure
    def execute(self, context):
        self._began = time.monotonic()
        plan = Plan.from_json(self.plan)
        boot = self._boot(plan)
        self._hold(boot)
        return self._pushed(context, self.bring_up_or_wait(boot, lambda: boot.ensure_up(plan), None, "resume"))

    @summarizes_failure
    def resume(self, context, event: Mapping):
        """Back from waiting for busy capacity (holding nothing): place again, or wait more."""
        self._began = time.monotonic()
        boot = self._boot(Plan.from_json(self.plan))
        return self._pushed(context, self.capacity_resumed(boot, event["echo"], "resume"))

    def _boot(self, plan: Plan) -> JobBoot:
        return self.job_boot(plan.job_id, max_attempts=self.max_capacity_attempts,
                             stopping_timeout_seconds=self.stopping_timeout_seconds,
                             unavailable_ttl_seconds=self.unavailable_ttl_seconds)

    def _hold(self, boot: JobBoot) -> None:
        """This step may wait for an instance to stop, then the boot and the launch follow."""
        boot.hold(self.stopping_timeout_seconds + (reservation_ttl(boot.spec) if boot.spec else LAUNCH_MARGIN_SECONDS))

    def _pushed(self, context, result) -> dict:
        out = {"baselines": result.baselines, "started": result.started, "plan": result.plan.to_json()}
        for key, value in out.items():
            push(context, key, value)
        summarize(self, context, start_summary(result.baselines, result.started,
                                               time.monotonic() - getattr(self, "_began", time.monotonic())))
        return out

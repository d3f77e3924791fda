"""A preempted job's launch step: told, requeued, placed, brought up and launched again, in one task.

Why in launch and not by failing it for a retry: Airflow cannot re-run `place`, `start` and
`wait_gpu_ready` from a downstream task (a retry re-runs the one task; only a person's clear takes
the setups with it), and a retry of launch alone would start the pods again on the nodes the
preemptor now holds. So the launch step, seeing its job's preemption record
(gpuboot.lifecycle.preemption), goes through the same steps itself, each with the code they use:

1. tell the user (by whom, why) and give back whatever the job still reserves;
2. wait in the job queue with the job's first enqueue time (`book_in_order`, the place step's
   turn), deferred on the place step's timer (`WakeUpTrigger`, woken by a release), until its
   queue timeout counted afresh from the preemption (being preempted is not the job's fault);
3. bring the new plan up (`JobBoot.ensure_up`: the start step's bring-up) and wait for each node
   to be GPU-ready (`NodeGpuReadyTrigger`, the sensor's trigger);
4. launch the gang on the new plan; the record is settled once the pods exist.

A contended ledger waits a short jittered while and places again, as the place step does. A node
that is not GPU-ready in time, or a bring-up that meets no capacity, fails this try with
the reason (no fail-over here: the sensor's is for the first boot); the Airflow retry finds the
record still there and requeues the job again, so it is never run on a node it does not hold.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.placement import Outcome, Plan
from gpuboot.core.ports import EcsError
from gpuboot.core.readiness import DEFAULT_FALLBACK_SECONDS
from gpuboot.core.timefmt import utc_relative
from gpuboot.lifecycle.booking import LAUNCH_MARGIN_SECONDS, Booker, LedgerContended
from gpuboot.lifecycle.boot import CapacityBusy, CapacityUnavailable, wait_deadline
from gpuboot.lifecycle.jobqueue import CONFIGMAP, JobQueue, Preempted, book_in_order, queue_config
from gpuboot.lifecycle.preemption import drop_reservations, told
from gpuboot.triggers.gpu_ready import NodeGpuReadyTrigger
from gpuboot.triggers.wake_up import WakeUpTrigger


class RequeuesWhenPreempted:
    """The launch step's requeue after a preemption (module doc); `relaunch(context, spec, plan, record)`
    is the operator's own launch of the gang on a plan."""

    ledger_namespace: str
    busy_poll_seconds: float
    kubernetes_conn_id: str
    ecs_conn_id: str
    deferrable: bool

    def preemption(self, job_id: str) -> Preempted | None:
        """The job's preemption record, if a preemptor requeued it and it has not been settled."""
        return JobQueue(self.kube(), self.ledger_namespace).snapshot().preempted_of(job_id)

    def requeued(self, context, spec: JobSpec, record: Preempted):
        """Steps 1 and 2 of the module doc."""
        self.log.warning("job %s (%s) was %s", spec.name, record.job_id, told(record))
        dropped = drop_reservations(self.ledger(), record.job_id)
        if dropped:
            self.log.info("gave back the %d reservation(s) job %s still held", dropped, record.job_id)
        queue = JobQueue(self.kube(), self.ledger_namespace)
        return self._turn(context, spec, record, queue.deadline(record.job_id, spec.queue_timeout_seconds))

    def resume_requeued(self, context, event: Mapping):
        """Back from waiting in the queue (its timer, or a release): place again."""
        echo = event["echo"]
        if event.get("woken") == "queue":
            self.log.info("woken by a release in the job queue: placing again")
        return self._turn(context, self._spec_for_requeue(context), Preempted.from_json(echo["preempted"]),
                          float(echo["deadline"]))

    def _turn(self, context, spec: JobSpec, record: Preempted, deadline: float):
        kube = self.kube()
        booker = Booker(kube, self.ecs(), self.ledger(kube), self.log)
        queue = JobQueue(kube, self.ledger_namespace)
        echo = {"deadline": deadline, "tried": [], "preempted": record.to_json()}
        try:
            turn = book_in_order(booker, queue, spec, record.job_id, queue_config(),
                                 lambda: booker.book(spec, record.job_id), deadline, record.enqueued_at)
        except (LedgerContended, EcsError) as exc:
            if isinstance(exc, EcsError) and exc.kind != "transient":
                raise
            if time.time() >= deadline:
                raise AirflowFailException(f"job {spec.name}, preempted, could not commit its placement before "
                                           f"queue_timeout_seconds={spec.queue_timeout_seconds}: {exc}") from None
            # a burst kept the ledger changing (nothing written): a short jittered while, then again
            wake = time.time() + random.uniform(1.0, 1.0 + min(10.0, self.busy_poll_seconds))
            self.log.info("%s; requeued after preemption: placing again in %.1fs", exc, wake - time.time())
            return self._wait_on(WakeUpTrigger(wake, echo), "resume_requeued", context)
        plan, now = turn.plan, time.time()
        if plan.outcome is Outcome.NEVER:
            raise AirflowFailException(f"job {spec.name} was preempted and can no longer run in this fleet: "
                                       f"{plan.message}")
        if plan.outcome is Outcome.BUSY:
            if now >= deadline:
                raise AirflowFailException(f"job {spec.name}, preempted, still waiting for capacity after "
                                           f"queue_timeout_seconds={spec.queue_timeout_seconds}: {plan.message}")
            why = turn.line(now) if turn.step else f"{plan.message}; queue deadline {utc_relative(deadline, now)}"
            wake = min(deadline, now + self.busy_poll_seconds)
            self.log.info("requeued after preemption: %s; placing again in %.0fs at the latest%s", why, wake - now,
                          ", or as soon as a job is released" if turn.wake_after is not None else "")
            return self._wait_on(WakeUpTrigger(wake, echo, queue=(self.ledger_namespace, CONFIGMAP),
                                               changes_seen=turn.wake_after, kubernetes_conn_id=self.kubernetes_conn_id),
                                 "resume_requeued", context)
        self.log.info("placed again after preemption:\n%s", plan.table())
        return self._bring_up(context, spec, plan, record)

    def _bring_up(self, context, spec: JobSpec, plan: Plan, record: Preempted):
        """Step 3: start what the plan needs and wait for each node's GPUs."""
        boot = self.job_boot(plan.job_id, handling=record)
        try:
            result = boot.ensure_up(plan)
        except (CapacityBusy, CapacityUnavailable) as exc:
            raise AirflowException(f"job {spec.name}, placed again after preemption, could not be brought up: "
                                   f"{exc}; the retry requeues it") from None
        return self._next_node(context, spec, result.plan.to_json(), list(result.baselines), 0, record)

    def _next_node(self, context, spec: JobSpec, plan: dict, baselines: list, index: int, record: Preempted):
        if index >= len(baselines):
            return self.relaunch(context, spec, Plan.from_json(plan), record)
        baseline = baselines[index]
        deadline = wait_deadline(baseline, spec.boot_timeout_seconds, spec.settle_seconds, time.time())
        self.ledger().renew(plan["job_id"], deadline + LAUNCH_MARGIN_SECONDS)
        self.log.info("waiting for node %s (%d/%d) to be GPU-ready until %s", baseline["node"], index + 1,
                      len(baselines), utc_relative(deadline, time.time()))
        echo = {"plan": plan, "baselines": baselines, "index": index, "preempted": record.to_json()}
        return self._wait_on(NodeGpuReadyTrigger(baseline=dict(baseline), deadline=deadline,
                                                 settle_seconds=spec.settle_seconds,
                                                 kubernetes_conn_id=self.kubernetes_conn_id,
                                                 fallback_seconds=DEFAULT_FALLBACK_SECONDS,
                                                 ecs_conn_id=self.ecs_conn_id, echo=echo),
                             "resume_node_ready", context)

    def _wait_on(self, trigger, method_name: str, context):
        """Defer on `trigger` (deferrable, the default), or run it here to its first event (deferrable=False)."""
        if self.deferrable:
            self.defer(trigger=trigger, method_name=method_name)
        return getattr(self, method_name)(context, asyncio.run(first_event(trigger)))

    def resume_node_ready(self, context, event: Mapping):
        """Back from a node's readiness watch: the next node, or the launch."""
        echo, node = event["echo"], event.get("node")
        spec = self._spec_for_requeue(context)
        if event.get("status") != "ready":
            raise AirflowException(f"job {spec.name}, placed again after preemption: node {node} is not GPU-ready "
                                   f"({event.get('status')}: {event.get('reason') or event.get('message')}); "
                                   "the retry requeues it")
        self.log.info("%s", event.get("summary") or f"node {node} is GPU-ready")
        return self._next_node(context, spec, echo["plan"], list(echo["baselines"]), int(echo["index"]) + 1,
                               Preempted.from_json(echo["preempted"]))


async def first_event(trigger) -> dict:
    """A trigger's one event, run in the worker (deferrable=False)."""
    async for event in trigger.run():
        return event.payload
    raise AirflowException(f"{type(trigger).__name__} ended without an event")

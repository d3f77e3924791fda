"""NodeGpuReadyTrigger: waits in the triggerer until one Node can really take GPU pods.

It reads the one Node's states from the Kubernetes adapter's stream (gpuboot.hooks.kube.NodeEvents:
list, watch, resume, re-list on 410, reconnect with backoff; one watch per node for all the
triggers of a triggerer waiting on it) and feeds each, plus timer ticks when the settle window
may have completed, into the pure `GpuWait` (gpuboot.core.gpu_wait), which the poking sensor
feeds from its reads: the rule, the settle timer and the deadline live there, not here.
It also ends early when the instance is stopped outside gpuboot (`PowerWatch`) and when the job is
preempted meanwhile (`PreemptionWatch`): the wait step then hands the job to its launch step, which
requeues it (gpuboot.operators.requeue), instead of learning it when the boot ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from airflow.triggers.base import BaseTrigger

from gpuboot.core.gpu_wait import GpuWait
from gpuboot.core.inventory import node_condition, parse_provider_id
from gpuboot.core.readiness import DEFAULT_FALLBACK_SECONDS, BootBaseline, ReadinessTracker
from gpuboot.core.steplog import boot_summary
from gpuboot.hooks.kube import AsyncKubeClient
from gpuboot.lifecycle.jobqueue import Preempted, preempted_in
from gpuboot.lifecycle.preemption import told
from gpuboot.triggers.events import ShortEvent
from gpuboot.triggers.wake_up import QUEUE_POLL_SECONDS, read_queue


class PowerWatch:
    """Whether the node's ECS instance was stopped by someone else (a person, ECS, a spot reclaim) while
    the wait runs: then no Node state will ever pass the rule, and the wait ends at once with that
    cause instead of at the boot timeout. ECS is asked only while the Node is not Ready (at most every
    CHECK_SECONDS) and, while it is Ready, every SLOW_SECONDS, to stay far below its API quota."""

    CHECK_SECONDS = 5.0
    SLOW_SECONDS = 60.0
    START_GRACE_SECONDS = 10.0      # ECS may still show Stopped just after StartInstances was accepted
    STOPPED = ("Stopping", "Stopped")

    def __init__(self, ecs_conn_id: str | None, start_requested_at: float | None, read_node) -> None:
        self.ecs_conn_id, self.start_requested_at, self.read_node = ecs_conn_id, start_requested_at, read_node
        self.checked = -math.inf
        self.instance_id: str | None = None
        self._ecs = None        # one hook (its connection read and SDK client built once) for every check

    def _due_in(self, node: Mapping | None, now: float) -> float:
        """Seconds until ECS may be asked again (<= 0: now): never within the start's grace."""
        ready = node_condition(node).get("status") == "True" if node else False
        due = self.checked + (self.SLOW_SECONDS if ready else self.CHECK_SECONDS)
        if self.start_requested_at is not None:
            due = max(due, self.start_requested_at + self.START_GRACE_SECONDS)
        return due - now

    def next_check_in(self, node: Mapping | None, now: float) -> float:
        return math.inf if self.ecs_conn_id is None else max(0.0, self._due_in(node, now))

    async def stopped_outside(self, node: Mapping | None, now: float) -> str | None:
        """The cause, when the instance behind `node` is Stopping/Stopped although this run started it
        (or found it running); None otherwise, or when it is not time to ask ECS again."""
        if self.ecs_conn_id is None or self._due_in(node, now) > 0:
            return None
        self.checked = now
        if self.instance_id is None:        # no write since the start yet: the Node as it is names it
            with contextlib.suppress(Exception):
                seen = node or await self.read_node()
                ids = parse_provider_id((seen.get("spec") or {}).get("providerID"))
                self.instance_id = ids[1] if ids else None
        if self.instance_id is None:
            return None
        try:
            status = await asyncio.to_thread(self._status)
        except Exception:       # throttled, or ECS away: the Node rule still decides; ask again later
            return None
        if status in self.STOPPED:
            return (f"its instance {self.instance_id} is {status}: stopped outside gpuboot (a person, ECS or "
                    f"a spot reclaim) while the job waited for it; no Node state can pass the rule now")
        return None

    def _status(self) -> str | None:
        """The instance's ECS status (in a worker thread: the SDK blocks)."""
        if self._ecs is None:
            from gpuboot.hooks.ecs import EcsHook

            self._ecs = EcsHook(self.ecs_conn_id)
        return self._ecs.statuses([self.instance_id]).get(self.instance_id)


class PreemptionWatch:
    """Whether the job was preempted while its node comes up (a victim with no pod yet:
    gpuboot.lifecycle.preemption). Its preemptor already gave its reservations away, so the wait is
    for nothing; learning it within POLL_SECONDS rather than when the boot ends (minutes) puts the job
    back in the line at once.

    Why a poll of the queue's ConfigMap every 2 s: the record lives in that one small object, and the
    read is the one every trigger of the triggerer looking at the queue shares (the waiters' wake-ups,
    gpuboot.triggers.wake_up.read_queue): one GET per triggerer per 2 s however many jobs wait. A watch
    would be told of every lease renewal of every waiter, for a record written once per preemption.
    The sensor in poke mode looks the same way at its pokes (`poked`: its own read, every 2 s at most)."""

    POLL_SECONDS = QUEUE_POLL_SECONDS

    def __init__(self, queue, kubernetes_conn_id: str) -> None:
        """`queue`: (namespace, ConfigMap name, job id), or None: not watched (the requeue's own waits)."""
        self.queue, self.kubernetes_conn_id = (tuple(queue) if queue else None), kubernetes_conn_id
        self.checked = -math.inf

    def next_check_in(self, now: float) -> float:
        return math.inf if self.queue is None else max(0.0, self.checked + self.POLL_SECONDS - now)

    def _due(self, now: float) -> bool:
        """Whether it is time to look (and, if so, the look counts from `now`)."""
        if self.queue is None or now < self.checked + self.POLL_SECONDS:
            return False
        self.checked = now
        return True

    async def preempted(self, now: float) -> Preempted | None:
        """The job's preemption record, when it is time to look and there is one."""
        if not self._due(now):
            return None
        namespace, name, job_id = self.queue
        ok, configmap = await read_queue(self.kubernetes_conn_id, namespace, name, self.POLL_SECONDS)
        return preempted_in(configmap, job_id) if ok else None

    def poked(self, kube, now: float, log: logging.Logger) -> Preempted | None:
        """The same look for the sensor in poke mode (a worker: no triggerer's shared read to join),
        through its own client `kube`; a read that fails counts as no record, as the trigger's does."""
        if not self._due(now):
            return None
        namespace, name, job_id = self.queue
        try:
            configmap = kube.read_configmap(namespace, name)
        except Exception as exc:      # the API server away or slow: the Node reads still decide
            log.warning("could not read the job queue %s/%s (%s); looking again in %gs", namespace, name, exc,
                        self.POLL_SECONDS)
            return None
        return preempted_in(configmap, job_id)


class NodeGpuReadyTrigger(BaseTrigger):
    """Fires once: {"status": "ready"|"timeout"|"stopped"|"preempted", "node", "reason", "evidence", "echo"}
    ("stopped": the instance was stopped outside gpuboot; PowerWatch, with `ecs_conn_id`. "preempted",
    with "preempted": the queue's record: the job was preempted; PreemptionWatch, with `preemption`,
    (namespace, queue ConfigMap, job id)).

    The watch starts from the Node's resourceVersion read before the start request
    (the baseline's), so every write of the boot is seen, the kubelet's reset of the GPU
    count included (see gpuboot.core.readiness). A watch that ends is resumed from the last
    resourceVersion seen, so nothing is missed; only 410 Gone forces a re-list, and the
    tracker is then told that writes may have been missed (its fallback window applies)."""

    def __init__(self, baseline: dict, deadline: float, settle_seconds: float = 5.0,
                 kubernetes_conn_id: str = "kubernetes_default", echo: dict | None = None,
                 fallback_seconds: float = DEFAULT_FALLBACK_SECONDS, ecs_conn_id: str | None = None,
                 preemption: list | tuple | None = None) -> None:
        super().__init__()
        self.ecs_conn_id = ecs_conn_id
        self.preemption = list(preemption) if preemption else None
        self.baseline = dict(baseline)
        self.deadline = float(deadline)
        self.settle_seconds = float(settle_seconds)
        self.fallback_seconds = float(fallback_seconds)
        self.kubernetes_conn_id = kubernetes_conn_id
        self.echo = dict(echo or {})

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"baseline": self.baseline, "deadline": self.deadline, "settle_seconds": self.settle_seconds,
                 "kubernetes_conn_id": self.kubernetes_conn_id, "echo": self.echo,
                 "fallback_seconds": self.fallback_seconds, "ecs_conn_id": self.ecs_conn_id,
                 "preemption": self.preemption})

    @property
    def node(self) -> str:
        return self.baseline["node"]

    def make_tracker(self, continuous: bool):
        """The readiness rule to apply (a seam for tests that prove the rule matters)."""
        return ReadinessTracker(BootBaseline.from_json(self.baseline), settle_seconds=self.settle_seconds,
                                fallback_seconds=self.fallback_seconds, continuous=continuous)

    def _event(self, status: str, wait: GpuWait, message: str, **more) -> ShortEvent:
        readiness = wait.last
        summary = boot_summary(self.node, wait.clock) if status == "ready" else message
        wait.note(message, time.time())
        return ShortEvent({"status": status, "node": self.node, "message": message, "echo": self.echo,
                           "boot": wait.clock.to_json(), "summary": summary,
                           "reason": readiness.reason if readiness else "no status read yet",
                           "code": readiness.code if readiness else None,
                           "evidence": dict(readiness.evidence) if readiness else {},
                           "history": wait.history, **more})

    async def run(self):
        baseline = BootBaseline.from_json(self.baseline)
        # Resume from before the start when we started the node: every write since is replayed.
        since = baseline.resource_version_before if baseline.start_requested_at is not None else None
        wait = GpuWait(baseline, self.make_tracker(continuous=since is not None), self.deadline)
        kube = AsyncKubeClient(self.kubernetes_conn_id)
        power = PowerWatch(self.ecs_conn_id, baseline.start_requested_at, lambda: kube.get_node(self.node))
        preemption = PreemptionWatch(self.preemption, self.kubernetes_conn_id)
        node: dict | None = None          # the latest Node seen (None: nothing written since the start yet)
        async with kube.node_events(self.node, since, self.log) as events:
            while True:
                now = time.time()
                if node is not None and wait.observe(node, now).ready:   # a settle window may have completed
                    break
                stretched = wait.stretched_by
                if wait.expired(now):
                    if wait.last is None:   # nothing seen (no write since the start, or the API down)
                        with contextlib.suppress(Exception):
                            wait.observe(await kube.get_node(self.node), now)
                    yield self._event("timeout", wait, f"node {self.node} not GPU-ready in time: "
                                      f"{wait.last.reason if wait.last else 'its Node could not be read'}")
                    return
                stopped = await power.stopped_outside(node, now)
                if stopped is not None:
                    yield self._event("stopped", wait, f"node {self.node}: {stopped}")
                    return
                record = await preemption.preempted(now)
                if record is not None:
                    yield self._event("preempted", wait, f"job {record.job_id} was {told(record)}",
                                      preempted=record.to_json())
                    return
                if stretched is None and wait.stretched_by is not None:
                    self.log.warning("node %s: boot timeout reached while its count holds in the fallback "
                                     "window; waiting %.0fs more for the window to complete", self.node,
                                     wait.stretched_by)
                event = await events.next(min(wait.next_check_in(now), power.next_check_in(node, now),
                                              preemption.next_check_in(now)))
                if event is None:
                    continue              # a timer: the settle window or the deadline
                if event.relisted:
                    self.log.warning("node %s re-listed after 410 Gone: writes in between were not seen, so a "
                                     "GPU count not seen reset is trusted only after %gs", self.node,
                                     max(self.fallback_seconds, self.settle_seconds))
                    wait.lost_continuity("the watch expired (410 Gone) and the Node was re-listed")
                if not event.node:
                    self.log.warning("node %s was deleted; waiting for it to come back", self.node)
                node = event.node
                readiness = wait.observe(node, time.time())
                self.log.info("node %s: %s", self.node, readiness.reason)
                if readiness.ready:
                    break
        ready = wait.last
        if "warning" in ready.evidence:
            self.log.warning("node %s: %s", self.node, ready.evidence["warning"])
        yield self._event("ready", wait, f"node {self.node} is GPU-ready: {ready.reason}")

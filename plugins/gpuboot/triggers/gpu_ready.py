"""NodeGpuReadyTrigger: waits in the triggerer until one Node can really take GPU pods.

It reads the one Node's states from the Kubernetes adapter's stream (gpuboot.hooks.kube.NodeEvents:
list, watch, resume, re-list on 410, reconnect with backoff; one watch per node for all the
triggers of a triggerer waiting on it) and feeds each, plus timer ticks when the settle window
may have completed, into the pure `GpuWait` (gpuboot.core.gpu_wait), which the poking sensor
feeds from its reads: the rule, the settle timer and the deadline live there, not here.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

from airflow.triggers.base import BaseTrigger

from gpuboot.core.gpu_wait import GpuWait
from gpuboot.core.readiness import DEFAULT_FALLBACK_SECONDS, BootBaseline, ReadinessTracker
from gpuboot.core.steplog import boot_summary
from gpuboot.hooks.kube import AsyncKubeClient
from gpuboot.triggers.events import ShortEvent


class NodeGpuReadyTrigger(BaseTrigger):
    """Fires once: {"status": "ready"|"timeout", "node", "reason", "evidence", "echo"}.

    The watch starts from the Node's resourceVersion read before the start request
    (the baseline's), so every write of the boot is seen, the kubelet's reset of the GPU
    count included (see gpuboot.core.readiness). A watch that ends is resumed from the last
    resourceVersion seen, so nothing is missed; only 410 Gone forces a re-list, and the
    tracker is then told that writes may have been missed (its fallback window applies)."""

    def __init__(self, baseline: dict, deadline: float, settle_seconds: float = 5.0,
                 kubernetes_conn_id: str = "kubernetes_default", echo: dict | None = None,
                 fallback_seconds: float = DEFAULT_FALLBACK_SECONDS) -> None:
        super().__init__()
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
                 "fallback_seconds": self.fallback_seconds})

    @property
    def node(self) -> str:
        return self.baseline["node"]

    def make_tracker(self, continuous: bool):
        """The readiness rule to apply (a seam for tests that prove the rule matters)."""
        return ReadinessTracker(BootBaseline.from_json(self.baseline), settle_seconds=self.settle_seconds,
                                fallback_seconds=self.fallback_seconds, continuous=continuous)

    def _event(self, status: str, wait: GpuWait, message: str) -> ShortEvent:
        readiness = wait.last
        summary = boot_summary(self.node, wait.clock) if status == "ready" else message
        wait.note(message, time.time())
        return ShortEvent({"status": status, "node": self.node, "message": message, "echo": self.echo,
                           "boot": wait.clock.to_json(), "summary": summary,
                           "reason": readiness.reason if readiness else "no status read yet",
                           "code": readiness.code if readiness else None,
                           "evidence": dict(readiness.evidence) if readiness else {},
                           "history": wait.history})

    async def run(self):
        baseline = BootBaseline.from_json(self.baseline)
        # Resume from before the start when we started the node: every write since is replayed.
        since = baseline.resource_version_before if baseline.start_requested_at is not None else None
        wait = GpuWait(baseline, self.make_tracker(continuous=since is not None), self.deadline)
        kube = AsyncKubeClient(self.kubernetes_conn_id)
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
                if stretched is None and wait.stretched_by is not None:
                    self.log.warning("node %s: boot timeout reached while its count holds in the fallback "
                                     "window; waiting %.0fs more for the window to complete", self.node,
                                     wait.stretched_by)
                event = await events.next(wait.next_check_in(now))
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

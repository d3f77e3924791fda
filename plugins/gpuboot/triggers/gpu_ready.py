"""NodeGpuReadyTrigger: waits in the triggerer until one Node can really take GPU pods.

It reads the one Node's states from the Kubernetes adapter's stream (gpuboot.hooks.kube.NodeEvents:
list, watch, resume, re-list on 410, reconnect with backoff; one watch per node for all the
triggers of a triggerer waiting on it) and feeds each, plus timer ticks
when the settle window may have completed, into the pure `ReadinessTracker`; it keeps only
the rule, the settle timer and the deadline. The rule itself lives in gpuboot.core.readiness.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from airflow.triggers.base import BaseTrigger

from gpuboot.hooks.kube import AsyncKubeClient
from gpuboot.core.readiness import DEFAULT_FALLBACK_SECONDS, BootBaseline, ReadinessTracker, Verdict
from gpuboot.core.steplog import BootClock, boot_summary
from gpuboot.triggers.events import ShortEvent

MAX_HISTORY = 50           # verdict changes returned in the event (the task log keeps every deferral's watch)


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
        self.history: list[str] = []
        self.clock = BootClock(self.baseline.get("start_requested_at"))

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

    def _event(self, status: str, verdict: Verdict | None, message: str) -> TriggerEvent:
        summary = boot_summary(self.node, self.clock) if status == "ready" else message
        return ShortEvent({"status": status, "node": self.node, "message": message, "echo": self.echo,
                           "boot": self.clock.to_json(), "summary": summary,
                           "reason": verdict.reason if verdict else "no status read yet",
                           "evidence": dict(verdict.evidence) if verdict else {},
                           "history": [*self.history, f"{_clock(time.time())} {message}"][-MAX_HISTORY:]})

    def note(self, verdict: Verdict) -> None:
        """Keep each change of verdict (with its time) for the event: the sensor logs it in the task log."""
        self.clock.observe(verdict, time.time())
        line = f"{_clock(time.time())} {verdict.reason}"
        if not self.history or self.history[-1].split(" ", 1)[1] != verdict.reason:
            self.history.append(line)

    async def run(self):
        baseline = BootBaseline.from_json(self.baseline)
        # Resume from before the start when we started the node: every write since is replayed.
        since = baseline.resource_version_before if baseline.start_requested_at is not None else None
        tracker = self.make_tracker(continuous=since is not None)
        kube = AsyncKubeClient(self.kubernetes_conn_id)
        node: dict | None = None          # the latest Node seen (None: nothing written since the start yet)
        verdict: Verdict | None = None
        deadline = self.deadline
        async with kube.node_events(self.node, since, self.log) as events:
            while True:
                now = time.time()
                if node is not None:      # judge the last state again: a settle window may have completed
                    verdict = tracker.observe(node, now)
                    self.note(verdict)
                    if verdict.ready:
                        break
                if now >= deadline and deadline == self.deadline and holding_in_fallback(tracker, verdict, now):
                    # Everything but the missed reset says ready: let the fallback window finish
                    # (once) rather than give up a node that is most likely healthy.
                    deadline = now + tracker.next_check_in(now)
                    self.log.warning("node %s: boot timeout reached while its count holds in the fallback "
                                     "window; waiting %.0fs more for the window to complete", self.node, deadline - now)
                if now >= deadline:
                    if verdict is None:   # nothing seen (no write since the start, or the API down)
                        with contextlib.suppress(Exception):
                            verdict = tracker.observe(await kube.get_node(self.node), now)
                    yield self._event("timeout", verdict, f"node {self.node} not GPU-ready in time: "
                                      f"{verdict.reason if verdict else 'its Node could not be read'}")
                    return
                wait = tracker.next_check_in(now)
                event = await events.next(min(deadline - now, wait if wait is not None else deadline - now))
                if event is None:
                    continue              # a timer: the settle window or the deadline
                if event.relisted:
                    self.log.warning("node %s re-listed after 410 Gone: writes in between were not seen, so a "
                                     "GPU count not seen reset is trusted only after %gs", self.node,
                                     max(self.fallback_seconds, self.settle_seconds))
                    tracker.lost_continuity("the watch expired (410 Gone) and the Node was re-listed")
                if not event.node:
                    self.log.warning("node %s was deleted; waiting for it to come back", self.node)
                node = event.node
                verdict = tracker.observe(node, time.time())
                self.log.info("node %s: %s", self.node, verdict.reason)
                self.note(verdict)
                if verdict.ready:
                    break
        if "warning" in verdict.evidence:
            self.log.warning("node %s: %s", self.node, verdict.evidence["warning"])
        yield self._event("ready", verdict, f"node {self.node} is GPU-ready: {verdict.reason}")


def holding_in_fallback(tracker: ReadinessTracker, verdict: Verdict | None, now: float) -> bool:
    """True while the count holds in the fallback window (the reset was missed, all else ready)."""
    return (verdict is not None and verdict.evidence.get("path") == "fallback"
            and tracker.next_check_in(now) is not None)


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%SZ", time.gmtime(epoch))

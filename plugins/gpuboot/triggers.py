"""NodeGpuReadyTrigger: waits in the triggerer until one Node can really take GPU pods.

It watches the one Node (field selector metadata.name, resuming from the last
resourceVersion, re-listing on 410) and feeds every event, plus timer ticks when the
settle window may have completed, into the pure `ReadinessTracker`. The rule itself
lives in gpuboot.readiness; this module only does the waiting.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from gpuboot.kube import AsyncKubeClient, Gone
from gpuboot.readiness import DEFAULT_FALLBACK_SECONDS, BootBaseline, ReadinessTracker, Verdict

MAX_HISTORY = 50           # verdict changes returned in the event (the task log keeps every deferral's watch)
MAX_WATCH_SECONDS = 60      # re-open the watch at least this often (cheap; survives idle proxies)
ERROR_BACKOFF_SECONDS = 2.0


class WakeUpTrigger(BaseTrigger):
    """Fires {"status": "wake", "echo": echo} at `moment` (epoch seconds).

    Why `echo`: the state a resumed task needs travels in the event itself, so it
    survives every runner (dag.test() passes only the event to the resume method)."""

    def __init__(self, moment: float, echo: dict | None = None) -> None:
        super().__init__()
        self.moment, self.echo = float(moment), dict(echo or {})

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"moment": self.moment, "echo": self.echo}

    async def run(self):
        await asyncio.sleep(max(0.0, self.moment - time.time()))
        yield TriggerEvent({"status": "wake", "echo": self.echo})


class NodeGpuReadyTrigger(BaseTrigger):
    """Fires once: {"status": "ready"|"timeout", "node", "reason", "evidence", "echo"}.

    The watch starts from the Node's resourceVersion read before the start request
    (the baseline's), so every write of the boot is seen, the kubelet's reset of the GPU
    count included (see gpuboot.readiness). A watch that ends is resumed from the last
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
        return TriggerEvent({"status": status, "node": self.node, "message": message, "echo": self.echo,
                             "reason": verdict.reason if verdict else "no status read yet",
                             "evidence": dict(verdict.evidence) if verdict else {},
                             "history": [*self.history, f"{_clock(time.time())} {message}"][-MAX_HISTORY:]})

    def note(self, verdict: Verdict) -> None:
        """Keep each change of verdict (with its time) for the event: the sensor logs it in the task log."""
        line = f"{_clock(time.time())} {verdict.reason}"
        if not self.history or self.history[-1].split(" ", 1)[1] != verdict.reason:
            self.history.append(line)

    async def run(self):
        kube = AsyncKubeClient(self.kubernetes_conn_id)
        baseline = BootBaseline.from_json(self.baseline)
        # Resume from before the start when we started the node: every write since is replayed.
        resource_version = baseline.resource_version_before if baseline.start_requested_at is not None else None
        tracker = self.make_tracker(continuous=resource_version is not None)
        node: dict | None = None          # the latest Node seen (None: nothing seen yet)
        verdict: Verdict | None = None
        while True:
            now = time.time()
            try:
                if resource_version is None:      # (re-)list: no version to resume from, or after 410 Gone
                    node = await kube.get_node(self.node)
                    resource_version = node["metadata"]["resourceVersion"]
                if node is not None:              # the listed Node, or a timer tick on the last one seen
                    verdict = tracker.observe(node, now)
                    self.note(verdict)
                    if verdict.ready:
                        break
                if now >= self.deadline:
                    if verdict is None:           # no write since the start: judge what is there now
                        verdict = tracker.observe(await kube.get_node(self.node), now)
                    yield self._event("timeout", verdict, f"node {self.node} not GPU-ready in time: "
                                      f"{verdict.reason}")
                    return
                remaining = self.deadline - now
                wait = tracker.next_check_in(now)
                window = min(remaining, MAX_WATCH_SECONDS, wait if wait is not None else remaining)
                loop = asyncio.get_running_loop()
                try:
                    # The timer leaves the watch as soon as a settle window can complete, so
                    # readiness is seen then, not at the Node's next heartbeat.
                    async with asyncio.timeout(window) as timer, contextlib.aclosing(kube.watch_node(
                            self.node, resource_version, max(1, math.ceil(window)))) as events:
                        async for kind, obj in events:
                            resource_version = obj["metadata"]["resourceVersion"]
                            if kind == "DELETED":
                                self.log.warning("node %s was deleted; waiting for it to come back", self.node)
                            node = {} if kind == "DELETED" else obj   # {}: observed as "not found"
                            verdict = tracker.observe(node, time.time())
                            self.log.info("node %s: %s", self.node, verdict.reason)
                            self.note(verdict)
                            if verdict.ready:
                                break
                            settle = tracker.next_check_in(time.time())
                            if settle is not None:
                                timer.reschedule(min(timer.when(), loop.time() + settle))
                except TimeoutError:
                    continue              # a timer tick: observe the last status again
                if verdict is not None and verdict.ready:
                    break
            except Gone:
                self.log.warning("watch of node %s expired (410 Gone); re-listing: writes in between were not "
                                 "seen, so a GPU count not seen reset is trusted only after %gs",
                                 self.node, max(self.fallback_seconds, self.settle_seconds))
                tracker.lost_continuity("the watch expired (410 Gone) and the Node was re-listed")
                resource_version = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - API hiccups must not end the wait
                self.log.warning("watching node %s failed (%s: %s); retrying from resourceVersion %s", self.node,
                                 type(exc).__name__, str(exc)[:200], resource_version)
                if time.time() >= self.deadline:
                    yield self._event("timeout", verdict, f"node {self.node} could not be read before "
                                      f"the deadline: {type(exc).__name__}")
                    return
                await asyncio.sleep(ERROR_BACKOFF_SECONDS)
        if "warning" in verdict.evidence:
            self.log.warning("node %s: %s", self.node, verdict.evidence["warning"])
        yield self._event("ready", verdict, f"node {self.node} is GPU-ready: {verdict.reason}")


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%SZ", time.gmtime(epoch))

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
from gpuboot.readiness import BootBaseline, ReadinessTracker, Verdict

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
    """Fires once: {"status": "ready"|"timeout", "node", "reason", "evidence", "echo"}."""

    def __init__(self, baseline: dict, deadline: float, settle_seconds: float = 5.0,
                 kubernetes_conn_id: str = "kubernetes_default", echo: dict | None = None) -> None:
        super().__init__()
        self.baseline = dict(baseline)
        self.deadline = float(deadline)
        self.settle_seconds = float(settle_seconds)
        self.kubernetes_conn_id = kubernetes_conn_id
        self.echo = dict(echo or {})
        self.history: list[str] = []

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"baseline": self.baseline, "deadline": self.deadline, "settle_seconds": self.settle_seconds,
                 "kubernetes_conn_id": self.kubernetes_conn_id, "echo": self.echo})

    @property
    def node(self) -> str:
        return self.baseline["node"]

    def make_tracker(self):
        """The readiness rule to apply (a seam for tests that prove the rule matters)."""
        return ReadinessTracker(BootBaseline.from_json(self.baseline), settle_seconds=self.settle_seconds)

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
        tracker = self.make_tracker()
        node: dict | None = None
        resource_version: str | None = None
        verdict: Verdict | None = None
        while True:
            now = time.time()
            try:
                if node is None:  # (re-)list: first pass, after 410 Gone or an API error
                    node = await kube.get_node(self.node)
                    resource_version = node["metadata"]["resourceVersion"]
                    verdict = tracker.observe(node, now)
                else:             # timer tick: the settle window may have completed
                    verdict = tracker.observe(node, now)
                self.note(verdict)
                if verdict.ready:
                    break
                if now >= self.deadline:
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
                if verdict.ready:
                    break
            except Gone:
                self.log.info("watch of node %s expired (410); re-listing", self.node)
                node = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - API hiccups must not end the wait
                self.log.warning("watching node %s failed (%s: %s); retrying", self.node,
                                 type(exc).__name__, str(exc)[:200])
                node = None
                if time.time() >= self.deadline:
                    yield self._event("timeout", verdict, f"node {self.node} could not be read before "
                                      f"the deadline: {type(exc).__name__}")
                    return
                await asyncio.sleep(ERROR_BACKOFF_SECONDS)
        yield self._event("ready", verdict, f"node {self.node} is GPU-ready: {verdict.reason}")


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%SZ", time.gmtime(epoch))

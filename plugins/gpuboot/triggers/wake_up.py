"""WakeUpTrigger: the timer a step waiting for capacity defers on, holding no worker slot; for a job
waiting in the job queue, also woken early by a release there.

Why a change counter and not only the timer: freed capacity should go to the first in line within
seconds, not at whichever waiter's 30 s timer fires next. The job queue counts its releases
(gpuboot.lifecycle.jobqueue, `changes`). Not lease renewals (every poll of every waiter would wake
all the others) and not arrivals: an arrival frees nothing, and its own place step runs the pass
for it at once (what a leader-based scheduler is woken by an arrival to do). The trigger reads that counter every `poll_seconds`, one
read per triggerer and queue however many waiters it runs (`queue_changes`), and fires as soon as
it moved past the value the step saw when it decided to wait; a lost read only leaves the timer.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from airflow.triggers.base import BaseTrigger

from gpuboot.hooks.kube import AsyncKubeClient
from gpuboot.lifecycle.jobqueue import changes_of
from gpuboot.triggers.events import ShortEvent

LOG = logging.getLogger(__name__)
QUEUE_POLL_SECONDS = 2.0
_READS: dict[tuple, tuple[float, asyncio.Future]] = {}


async def read_queue(kubernetes_conn_id: str, namespace: str, name: str, max_age: float) -> tuple[bool, dict | None]:
    """The job queue ConfigMap (None: none yet), read at most once per `max_age` seconds per triggerer:
    all its triggers that look at the queue (the waiters here, the readiness watches' preemption
    check) share the read in flight or just made. (False, None) when it could not be read."""
    key = (id(asyncio.get_running_loop()), kubernetes_conn_id, namespace, name)
    at, read = _READS.get(key, (-math.inf, None))
    if read is None or (read.done() and time.monotonic() - at >= max_age):
        read = asyncio.ensure_future(_read_queue(kubernetes_conn_id, namespace, name))
        _READS[key] = (time.monotonic(), read)
    return await asyncio.shield(read)


async def _read_queue(kubernetes_conn_id: str, namespace: str, name: str) -> tuple[bool, dict | None]:
    try:
        return True, await AsyncKubeClient(kubernetes_conn_id).read_configmap(namespace, name)
    except Exception as exc:      # the API server away or slow: the timers still fire
        LOG.warning("could not read the job queue %s/%s (%s); going on with the timers", namespace, name, exc)
        return False, None


async def queue_changes(kubernetes_conn_id: str, namespace: str, name: str, max_age: float) -> int | None:
    """The job queue's change counter (`read_queue`); None when it could not be read."""
    ok, configmap = await read_queue(kubernetes_conn_id, namespace, name, max_age)
    return changes_of(configmap) if ok else None


class WakeUpTrigger(BaseTrigger):
    """Fires {"status": "wake", "echo": echo} at `moment` (epoch seconds), or earlier, with
    "woken": "queue", once the job queue ConfigMap `queue` (namespace, name) counts more changes
    than `changes_seen` (None: a plain timer).

    Why `echo`: the state a resumed task needs travels in the event itself, so it
    survives every runner (dag.test() passes only the event to the resume method)."""

    def __init__(self, moment: float, echo: dict | None = None, queue: tuple[str, str] | list | None = None,
                 changes_seen: int | None = None, kubernetes_conn_id: str = "kubernetes_default",
                 poll_seconds: float = QUEUE_POLL_SECONDS) -> None:
        super().__init__()
        self.moment, self.echo = float(moment), dict(echo or {})
        self.queue = tuple(queue) if queue else None
        self.changes_seen, self.kubernetes_conn_id, self.poll_seconds = changes_seen, kubernetes_conn_id, poll_seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            "moment": self.moment, "echo": self.echo, "queue": list(self.queue) if self.queue else None,
            "changes_seen": self.changes_seen, "kubernetes_conn_id": self.kubernetes_conn_id,
            "poll_seconds": self.poll_seconds}

    async def run(self):
        watching = self.queue is not None and self.changes_seen is not None
        while (left := self.moment - time.time()) > 0:
            if not watching:
                await asyncio.sleep(left)
                break
            await asyncio.sleep(min(left, self.poll_seconds))
            changes = await queue_changes(self.kubernetes_conn_id, *self.queue, max_age=self.poll_seconds)
            if changes is not None and changes > self.changes_seen:
                yield ShortEvent({"status": "wake", "echo": self.echo, "woken": "queue",
                                  "summary": "woken by a release in the job queue"})
                return
        yield ShortEvent({"status": "wake", "echo": self.echo, "woken": "timer", "summary": "woke up to try again"})

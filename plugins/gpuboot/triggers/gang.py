"""GangTrigger: follows a launched gang in the triggerer, so no worker slot is held while it runs.

Every rank's log is streamed as it is written, each line prefixed `[rank N]`; the triggerer
writes a trigger's log into its task instance's log (Airflow 3: `<try log>.trigger.<id>.log`,
shown with the task log in the UI), so the lines appear while the job runs. Pod phases are
read by a list of the gang's pods by label, again at each change a watch from that list
reports, and at least every `poll_seconds` with the Nodes of running ranks (a rank on a node
that is no longer Ready died with it), and judged by gpuboot.core.gang.
It fires once, when every rank succeeded or the first one failed; the launch step then
applies the one fate (gpuboot.operators.launch). A triggerer that restarts replays the logs from
the start (lines may show twice), never misses the verdict.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from gpuboot.core.gang import CONTAINER, LABEL_ATTEMPT, LABEL_RANK, judge, pod_times
from gpuboot.core.model import LABEL_JOB, TERMINATED_PHASES
from gpuboot.hooks.kube import AsyncKubeClient, Gone

TAIL_LINES = 20          # the last log lines of each rank the trigger keeps for the failure message
PHASE_GONE = "Gone"      # the phase a follower is told for a pod no longer listed: its log ends there
DRAIN_SECONDS = 10.0     # how long the verdict waits for the log streams to deliver their last lines
REOPEN_SECONDS = 1.0     # a running rank's log stream that ended is opened again no sooner than this


def stamp_ns(stamp: str) -> int:
    """Nanoseconds since the epoch of a kubelet log timestamp (RFC3339Nano, trailing zeros trimmed)."""
    stamp = stamp.rstrip("Z")
    whole, _, fraction = stamp.partition(".")
    seconds = datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp()
    return int(seconds) * 1_000_000_000 + int((fraction or "0").ljust(9, "0")[:9])


class GangTrigger(BaseTrigger):
    """Fires {"status": "succeeded"|"failed", "failure": {rank, pod, reason, exit_code} | None,
    "namespace", "pods" (by rank), "job_id", "attempt", "times" (by rank: gpuboot.core.gang.pod_times),
    "tail" (the failed rank's last TAIL_LINES log lines as streamed: its pod may be gone by the time
    launch reads them)}."""

    def __init__(self, namespace: str, job_id: str, attempt: int, pods: list[str],
                 kubernetes_conn_id: str = "kubernetes_default", poll_seconds: float = 2.0,
                 started_at: float | None = None) -> None:
        super().__init__()
        self.namespace, self.job_id, self.attempt = namespace, job_id, int(attempt)
        self.pods = list(pods)
        self.kubernetes_conn_id, self.poll_seconds = kubernetes_conn_id, float(poll_seconds)
        self.started_at = started_at          # when launch created the gang (for its summary line)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"namespace": self.namespace, "job_id": self.job_id, "attempt": self.attempt, "pods": self.pods,
                 "kubernetes_conn_id": self.kubernetes_conn_id, "poll_seconds": self.poll_seconds,
                 "started_at": self.started_at})

    def _event(self, status: str, failure=None, times: list | None = None, tail: Sequence[str] = ()) -> TriggerEvent:
        return TriggerEvent({"status": status, "failure": failure.to_json() if failure else None,
                             "namespace": self.namespace, "pods": self.pods, "job_id": self.job_id,
                             "attempt": self.attempt, "started_at": self.started_at, "times": times or [],
                             "tail": list(tail)})

    async def on_kill(self) -> None:
        """The task was marked failed, cleared or its run deleted while the gang ran: delete its pods,
        so no pod runs on (and bills) with nothing watching it and no reservation held."""
        deleted = await AsyncKubeClient(self.kubernetes_conn_id).delete_pods(self.namespace, self.pods)
        self.log.warning("cancelled while the gang ran: deleted its pod(s) %s; the node goes back to the idle "
                         "rules", ", ".join(deleted) or "(none left)")

    async def run(self):
        kube = AsyncKubeClient(self.kubernetes_conn_id)
        world = len(self.pods)
        phases: dict[int, str] = {}
        updated = asyncio.Condition()     # notified each time `phases` is read anew
        tails = [collections.deque(maxlen=TAIL_LINES) for _ in range(world)]
        followers = [asyncio.create_task(self._follow_log(kube, rank, phases, updated, tails[rank]))
                     for rank in range(world)]
        selector = f"{LABEL_JOB}={self.job_id},{LABEL_ATTEMPT}={self.attempt}"
        delay = self.poll_seconds
        loop = asyncio.get_running_loop()
        nodes: dict[str, dict | None] = {}    # the running ranks' Nodes, all read again every poll_seconds
        nodes_read = -math.inf
        try:
            while True:
                try:
                    listed, version = await kube.list_pods(self.namespace, selector)
                    by_rank = {int(p["metadata"]["labels"][LABEL_RANK]): p for p in listed
                               if p["metadata"]["name"] in self.pods}
                    running = {(p.get("spec") or {}).get("nodeName") for p in by_rank.values()
                               if (p.get("status") or {}).get("phase") == "Running"} - {None}
                    if loop.time() - nodes_read >= self.poll_seconds:   # not per pod event: a gang's
                        nodes, nodes_read = {}, loop.time()             # start is hundreds of them
                    nodes = {n: nodes[n] if n in nodes else await _node_or_none(kube, n) for n in running}
                    delay = self.poll_seconds
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.log.warning("reading the gang's pods failed (%s: %s); retrying in %.0fs",
                                     type(exc).__name__, str(exc)[:200], delay)
                    await asyncio.sleep(delay)
                    delay = min(30.0, delay * 2)
                    continue
                for rank in range(world):       # a pod gone (deleted) has no more log to give
                    pod = by_rank.get(rank)
                    phases[rank] = PHASE_GONE if pod is None else (pod.get("status") or {}).get("phase") or "Pending"
                async with updated:
                    updated.notify_all()
                state = judge(by_rank, world, nodes, self.pods)
                if state.status != "running":
                    # the streams end with their containers: let them deliver the last lines
                    # (of every rank, or of the failed one: the others are about to be deleted)
                    ending = followers if state.failure is None else [followers[state.failure.rank]]
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.gather(*ending, return_exceptions=True),
                                               timeout=DRAIN_SECONDS)
                    if state.failure is not None:
                        self.log.error("gang %s: %s", self.job_id, state.failure.describe())
                    yield self._event(state.status, state.failure,
                                      [pod_times(by_rank.get(rank)) for rank in range(world)],
                                      tails[state.failure.rank] if state.failure is not None else ())
                    return
                await self._changed(kube, selector, version)
        finally:
            for task in followers:
                task.cancel()

    async def _changed(self, kube: AsyncKubeClient, selector: str, version: str | None) -> None:
        """Return at the first change to the gang's pods after the list at `version` (a watch from
        it: nothing written since is missed), or after `poll_seconds` without one, when the loop reads
        the running ranks' Nodes again (a lost node changes no pod)."""
        with contextlib.suppress(TimeoutError, Gone):        # Gone: the version expired, the loop re-lists
            async with asyncio.timeout(self.poll_seconds):
                try:
                    async with contextlib.aclosing(kube.watch_pods(self.namespace, selector, version,
                                                                   math.ceil(self.poll_seconds))) as events:
                        async for _ in events:
                            return
                except (asyncio.CancelledError, TimeoutError, Gone):
                    raise
                except Exception as exc:
                    self.log.warning("watching the gang's pods failed (%s: %s); reading them again in %.0fs",
                                     type(exc).__name__, str(exc)[:200], self.poll_seconds)
                    await asyncio.sleep(self.poll_seconds)

    async def _follow_log(self, kube: AsyncKubeClient, rank: int, phases: dict[int, str],
                          updated: asyncio.Condition, tail: collections.deque) -> None:
        """Stream one rank's log into this trigger's log; resume (dropping lines already seen by
        their timestamp) when the stream ends before the pod does. A stream that ends while the
        rank runs (the server cut it, or the container just exited) is opened again at once, at
        most once per REOPEN_SECONDS; one that would not open (not started) again when the rank's
        phase is seen to change, at most `poll_seconds` later. Once the phase is final, one last
        read takes what is left and the follower ends, which is what the verdict waits for."""
        name, last = self.pods[rank], 0
        loop = asyncio.get_running_loop()
        while True:
            opened = loop.time()
            since = None if not last else max(1, int(time.time() - last / 1e9) + 2)
            try:
                async for raw in kube.pod_log(self.namespace, name, CONTAINER, since_seconds=since):
                    stamp, _, text = raw.decode("utf-8", errors="replace").rstrip("\n").partition(" ")
                    try:
                        at = stamp_ns(stamp)
                    except ValueError:
                        at, text = last, f"{stamp} {text}"
                    if at and at <= last:
                        continue
                    last = at or last
                    self.log.info("[rank %d] %s", rank, text)
                    tail.append(text)
            except asyncio.CancelledError:
                raise
            except Exception:
                pass
            seen = phases.get(rank)
            if seen in TERMINATED_PHASES or seen == PHASE_GONE:
                return
            pause = self.poll_seconds
            if seen == "Running":
                pause = min(pause, max(0.0, REOPEN_SECONDS - (loop.time() - opened)))
            async with updated:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(updated.wait_for(lambda: phases.get(rank) != seen), pause)


async def _node_or_none(kube: AsyncKubeClient, name: str) -> dict | None:
    try:
        return await kube.get_node(name)
    except Exception as exc:
        if getattr(exc, "status", None) == 404:
            return None
        raise

"""Overcommit and admission monitor: watches the cluster and checks every change.

It watches Pods, Nodes and the reservation ledger ConfigMaps (root and shards) and, at every change,
asks of each node: is it promised more than it has? Promised = requests of the bound,
non-terminated pods + live ledger reservations not yet backed by a bound pod (the
arithmetic is gpuboot.core.inventory.build_inventory's, reused, not copied); has = the
node's allocatable with the GPU count of its instance type (label
aliyun.accelerator/nvidia_count), because during a boot the Node's own GPU figure
goes stale -> 0 -> real while the machine's GPUs do not change. It also records every
pod a kubelet refused (UnexpectedAdmissionError).

Why events are merged by resourceVersion: the three watches are separate streams,
and a pod that finished (freeing its GPU) may reach us after the ledger write that
reused the GPU, which would look like an overcommit that never existed. The API
server numbers every write with one global, increasing resourceVersion, so events
are applied in that order and only once every stream is known to be past them (its
own events, BOOKMARKs, or a list whose objects match what the stream delivered).
Each check therefore sees one real moment of the cluster. A stream that must list again (410
Gone) learns the changes of its gap all at once at the list's resourceVersion: the other
streams' events inside that gap are applied but not checked (`MonitorReport.relists` counts them).
"""
from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuboot.core.inventory import build_inventory
from gpuboot.core.model import LABEL_GPU_COUNT, Reservation
from gpuboot.core.resources import GPU, QuantityError, Resources
from gpuboot.lifecycle.ledger import CONFIGMAP, DATA_KEY, LABEL_LEDGER

log = logging.getLogger(__name__)

STREAMS = ("pods", "nodes", "ledger")
WATCH_SECONDS = 20
PROBE_SECONDS = 0.5


@dataclass(frozen=True)
class Overcommit:
    """A node promised more than it has at one moment (resourceVersion)."""

    node: str
    resource_version: int
    over: dict[str, int]
    promised: str
    capacity: str

    def line(self) -> str:
        return (f"node {self.node} at resourceVersion {self.resource_version}: over by {self.over} "
                f"(promised {self.promised}, has {self.capacity})")


@dataclass
class MonitorReport:
    checks: int = 0
    overcommits: list[Overcommit] = field(default_factory=list)   # one per episode (node goes over)
    max_overcommit: dict[str, int] = field(default_factory=dict)  # resource -> worst amount seen
    max_promised_gpus: int = 0                                    # cluster-wide, at one moment
    relists: int = 0                # streams listed again after 410 Gone (the moments in such a gap go unchecked)
    admission_failures: list[str] = field(default_factory=list)
    ledger: list[Reservation] = field(default_factory=list)       # live entries at the end
    first_promised: dict[str, float] = field(default_factory=dict)  # job id -> when its first reservation showed

    def leaked(self, now: float | None = None) -> list[Reservation]:
        """Live reservations that promise something (fence markers of the scale-down promise nothing)."""
        now = time.time() if now is None else now
        return [r for r in self.ledger if r.expires_at > now and any(r.resources.values())]

    def problems(self) -> list[str]:
        return ([o.line() for o in self.overcommits] + self.admission_failures
                + [f"leaked reservation {r.job_id}/{r.task} on {r.node} ({r.resources})" for r in self.leaked()])


def node_capacity(node: dict) -> Resources:
    """What the machine can hold: the Node's allocatable, GPUs at the instance type's count."""
    status, labels = node.get("status") or {}, (node.get("metadata") or {}).get("labels") or {}
    try:
        allocatable = Resources.parse(status.get("allocatable") or {}, field=f"node {node['metadata']['name']}")
    except QuantityError:
        allocatable = Resources()
    if labels.get(LABEL_GPU_COUNT, "").isdigit():
        allocatable = allocatable - {GPU: allocatable.gpus} + {GPU: int(labels[LABEL_GPU_COUNT])}
    return allocatable


def ledger_entries(configmap: dict | None) -> list[Reservation]:
    raw = ((configmap or {}).get("data") or {}).get(DATA_KEY) or "[]"
    return [Reservation.from_json(d) for d in json.loads(raw)]


def admission_failure(pod: dict) -> str | None:
    status = pod.get("status") or {}
    if "AdmissionError" in (status.get("reason") or "") or "devices unavailable" in (status.get("message") or ""):
        meta = pod.get("metadata") or {}
        return (f"pod {meta.get('namespace')}/{meta.get('name')} on {(pod.get('spec') or {}).get('nodeName')}: "
                f"{status.get('reason')}: {status.get('message')}")
    return None


class _Stream:
    """One watched resource: what it delivered (key -> object) and how far it is known complete.
    `target(core)` gives the list call: (CoreV1Api method, positional args, keyword args)."""

    def __init__(self, name: str, target: Callable[[Any], tuple[Callable, tuple, dict]]):
        self.name, self.target = name, target
        self.delivered: dict[str, dict] = {}
        self.watch = None       # the open kubernetes Watch (stopped to end the thread at once)
        self.mark = -1          # every event with resourceVersion <= mark has been delivered

    @staticmethod
    def key(obj: dict) -> str:
        meta = obj["metadata"]
        return meta.get("uid") or f"{meta.get('namespace')}/{meta['name']}"


class Monitor:
    """Start, let the jobs run, stop; `report` says what was seen. Use as a context manager."""

    def __init__(self, api_client_factory: Callable[[], Any], ledger_namespace: str = "default"):
        self._factory = api_client_factory
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, str, str, Any, float]] = []
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._state: dict[str, dict[str, dict]] = {s: {} for s in STREAMS}
        self._synced: set[str] = set()
        self._blind_until = 0       # after a re-list: the moments before its resourceVersion are not checked
        self._over: set[str] = set()
        self._seen_failures: set[str] = set()
        self._errors: list[str] = []
        self.report = MonitorReport()

        self._streams = {
            "pods": _Stream("pods", lambda core: (core.list_pod_for_all_namespaces, (), {})),
            "nodes": _Stream("nodes", lambda core: (core.list_node, (), {})),
            "ledger": _Stream("ledger", lambda core: (core.list_namespaced_config_map, (ledger_namespace,),
                                                      {"label_selector": f"{LABEL_LEDGER}={CONFIGMAP}"})),   # root and shards
        }
        self._local = threading.local()

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        for stream in self._streams.values():
            self._spawn(self._watch, stream)
        self._spawn(self._probe)
        self._spawn(self._merge)
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._synced != set(STREAMS):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"monitor: streams not listed within {timeout}s: {self._errors[-3:]}")
                self._cond.wait(0.1)

    def stop(self, timeout: float = 30.0) -> MonitorReport:
        """Catch every stream up to now, apply and check what is left, then stop the threads."""
        deadline = time.monotonic() + timeout
        for stream in self._streams.values():
            while not self._catch_up(stream):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"monitor: stream {stream.name} did not catch up within {timeout}s")
                time.sleep(0.05)
        with self._cond:
            self._drain()
            self.report.ledger = [r for cm in self._state["ledger"].values() for r in ledger_entries(cm)]
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for stream in self._streams.values():
            if stream.watch is not None:
                stream.watch.stop()
        for thread in self._threads:
            thread.join(timeout=5)
        return self.report

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"monitor-{target.__name__}")
        thread.start()
        self._threads.append(thread)

    # -- streams -----------------------------------------------------------------------------
    def _core(self):
        """A CoreV1Api per thread (its own connection pool)."""
        if not hasattr(self._local, "core"):
            from kubernetes import client
            self._local.core = client.CoreV1Api(self._factory())
        return self._local.core

    def _list(self, stream: _Stream) -> tuple[int, list[dict]]:
        func, args, kwargs = stream.target(self._core())
        body = json.loads(func(*args, _preload_content=False, **kwargs).data)
        return int(body["metadata"]["resourceVersion"]), body.get("items") or []

    def _push(self, stream: _Stream, rv: int, kind: str, payload: Any) -> None:
        with self._cond:
            heapq.heappush(self._heap, (rv, next(self._seq), stream.name, kind, payload, time.time()))
            stream.mark = max(stream.mark, rv)
            self._cond.notify_all()

    def _watch(self, stream: _Stream) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:   # (re-)list: a SYNC of the whole stream at the list's resourceVersion
                    rv, items = self._list(stream)
                    with self._cond:
                        stream.delivered = {stream.key(o): o for o in items}
                        if stream.name in self._synced:
                            # a re-list after 410: this stream's changes between its last event and `rv` come
                            # only now, all at once, so the other streams' events in that gap would be checked
                            # against its stale state (a pod ended long ago still running): skip those moments
                            self._blind_until = max(self._blind_until, rv)
                            self.report.relists += 1
                        self._push(stream, rv, "SYNC", items)
                    if stream.name == "pods":
                        for pod in items:
                            self._note_admission(pod)
                func, args, kwargs = stream.target(self._core())
                stream.watch = watch.Watch()
                for event in stream.watch.stream(func, *args, resource_version=str(rv), deserialize=False,
                                                  allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS,
                                                  **kwargs):
                    obj, kind = event["object"], event["type"]
                    rv = int(obj["metadata"]["resourceVersion"])
                    with self._cond:
                        if kind == "DELETED":
                            stream.delivered.pop(stream.key(obj), None)
                        elif kind != "BOOKMARK":
                            stream.delivered[stream.key(obj)] = obj
                        self._push(stream, rv, kind, obj)
                    if kind != "DELETED" and stream.name == "pods":
                        self._note_admission(obj)
                    if self._stop.is_set():
                        return
            except ApiException as exc:
                if exc.status == 410:
                    rv = None
                    continue
                self._error(stream, exc)
            except KeyError as exc:
                if exc.args == ("raw_object",):     # the client's Watch.stream(deserialize=False) cannot read an
                    rv = None                       # ERROR event: the API server's 410 Expired inside the stream
                    continue
                self._error(stream, exc)
            except Exception as exc:
                self._error(stream, exc)

    def _error(self, stream: _Stream, exc: Exception) -> None:
        if not self._stop.is_set():
            self._errors.append(f"{stream.name}: {type(exc).__name__}: {str(exc)[:200]}")
            log.warning("monitor watch of %s failed (%s); resuming", stream.name, self._errors[-1])
            self._stop.wait(0.2)

    def _catch_up(self, stream: _Stream) -> bool:
        """True when a fresh list shows exactly what the stream delivered: then every event up to
        the list's resourceVersion has arrived and the stream's mark can move there."""
        rv, items = self._list(stream)
        with self._cond:
            listed = {stream.key(o): o["metadata"]["resourceVersion"] for o in items}
            have = {k: o["metadata"]["resourceVersion"] for k, o in stream.delivered.items()}
            if listed != have:
                return False
            stream.mark = max(stream.mark, rv)
            self._cond.notify_all()
            return True

    def _probe(self) -> None:
        """Move quiet streams' marks forward so checks do not wait for a BOOKMARK."""
        while not self._stop.wait(PROBE_SECONDS):
            for stream in self._streams.values():
                if self._heap and stream.mark < self._heap[0][0]:
                    try:
                        self._catch_up(stream)
                    except Exception as exc:
                        self._error(stream, exc)

    # -- merge and check ---------------------------------------------------------------------
    def _merge(self) -> None:
        with self._cond:
            while not self._stop.is_set():
                self._drain()
                self._cond.wait(0.2)

    def _drain(self) -> None:
        """Apply, in resourceVersion order, every event all streams are known to be past."""
        horizon = min(s.mark for s in self._streams.values())
        while self._heap and self._heap[0][0] <= horizon:
            rv, _, name, kind, payload, at = heapq.heappop(self._heap)
            state = self._state[name]
            if kind == "SYNC":
                state.clear()
                state.update({_Stream.key(o): o for o in payload})
                self._synced.add(name)
                self._cond.notify_all()
            elif kind == "BOOKMARK":
                continue
            elif kind == "DELETED":
                state.pop(_Stream.key(payload), None)
            else:
                state[_Stream.key(payload)] = payload
            if self._synced == set(STREAMS) and rv >= self._blind_until:
                self._check(rv, at)

    def _check(self, rv: int, at: float) -> None:
        nodes = list(self._state["nodes"].values())
        pods = list(self._state["pods"].values())
        reservations = [r for cm in self._state["ledger"].values() for r in ledger_entries(cm)]
        for r in reservations:
            if any(r.resources.values()):
                self.report.first_promised.setdefault(r.job_id, at)
        views = {v.name: v for v in build_inventory(nodes, pods, [], {}, reservations, at)}
        self.report.checks += 1
        promised_gpus = 0
        for node in nodes:
            name = node["metadata"]["name"]
            promised, capacity = views[name].allocated, node_capacity(node)
            promised_gpus += promised.gpus
            over = promised.shortfall(capacity)
            if not over:
                self._over.discard(name)
                continue
            for resource, amount in over.items():
                self.report.max_overcommit[resource] = max(self.report.max_overcommit.get(resource, 0), amount)
            if name not in self._over:
                self._over.add(name)
                found = Overcommit(name, rv, dict(over), str(promised), str(capacity))
                self.report.overcommits.append(found)
                log.error("OVERCOMMIT %s", found.line())
        self.report.max_promised_gpus = max(self.report.max_promised_gpus, promised_gpus)

    def _note_admission(self, pod: dict) -> None:
        failure = admission_failure(pod)
        if failure and pod["metadata"].get("uid") not in self._seen_failures:
            self._seen_failures.add(pod["metadata"].get("uid"))
            self.report.admission_failures.append(failure)
            log.error("ADMISSION FAILURE %s", failure)

"""Kubernetes access for gpuboot through the cncf-kubernetes provider's hooks.

Everything returned is a plain dict in API form (camelCase), as the pure core expects.
Lists are read raw (no model deserialization) and paged, which keeps a 2,000-node,
20,000-pod cluster cheap to read.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from gpuboot.exceptions import Conflict, Gone, InvalidRequest, NotPermitted, Overloaded

ACTIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"
WATCH_SECONDS = 60      # a watch is re-opened at least this often (cheap; survives idle proxies)
PAGE = 500
POOL = 32               # connections kept per client: the ledger's and the claims' parallel calls, the placer's
                        # watches and lease thread (the client's default, 5 per core, churned a connection a call)
# What launching a job's pods needs in its namespace, (apiGroup, resource, verb): the Role
# gpuboot-jobs of deploy/kubernetes/rbac.yaml (tests/static/test_permissions.py keeps the two equal).
# The place step reviews them (KubeClient.denied) before it reserves or boots anything.
JOB_POD_RIGHTS = (("", "pods", "create"), ("", "pods", "get"), ("", "pods", "watch"), ("", "pods", "patch"),
                  ("", "pods", "delete"), ("", "pods/log", "get"), ("", "events", "list"), ("", "events", "watch"))

REFUSED = (400, 422)         # statuses no retry can change: InvalidRequest


def _raw(response) -> dict:
    return json.loads(response.data)


_paused = 0                  # threads inside collector_paused()
_resume = False              # whether the collector was on when the first of them came in
_pause_lock = threading.Lock()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a long list is read and parsed.

    Parsed JSON holds no cycles (reference counting frees it), yet each full collection walks
    every object alive, and the dicts of a large fleet's pods trigger many: the collections cost
    far more than the parsing itself (CHANGELOG.md, Placement). The collector is
    the process's: the last thread out turns it back on, and only if it was on before."""
    global _paused, _resume
    with _pause_lock:
        if _paused == 0:
            _resume = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _pause_lock:
            _paused -= 1
            if _paused == 0 and _resume:
                gc.enable()


THROTTLED_TRIES = 10     # a request the API server answers 429 is sent again this many times at most


def throttled_retries(backoff_factor: float = 0.2):
    """urllib3's retries for the Kubernetes client: as its default (connection and read errors of idempotent
    requests, three times), and a 429 of any verb, after the Retry-After the API server gives (else a short
    backoff), THROTTLED_TRIES times. Why every verb: kube-apiserver's priority and fairness answers 429 to a
    request it queued for too long or had no room to queue, before running it (deploy/kubernetes/
    flowcontrol.yaml queues the place steps' requests), so sending it again is safe, and it is what client-go
    does. The last 429 is returned as it is (an Overloaded to our writers, which back off further)."""
    from urllib3.util.retry import Retry

    class Throttled(Retry):
        def is_retry(self, method: str, status_code: int, has_retry_after: bool = False) -> bool:
            return status_code == 429 or super().is_retry(method, status_code, has_retry_after)

    return Throttled(total=THROTTLED_TRIES + 3, connect=3, read=3, redirect=3, status=THROTTLED_TRIES,
                     backoff_factor=backoff_factor, backoff_max=5, backoff_jitter=0.2, raise_on_status=False)


class KubeClient:
    """Synchronous access for operators (KubernetesHook(conn_id=...))."""

    def __init__(self, kubernetes_conn_id: str = "kubernetes_default") -> None:
        self.kubernetes_conn_id = kubernetes_conn_id

    @cached_property
    def hook(self):
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        return KubernetesHook(conn_id=self.kubernetes_conn_id)

    @cached_property
    def core(self):
        from kubernetes.client.rest import RESTClientObject

        core = self.hook.core_v1_client
        configuration = core.api_client.configuration
        mask_credentials(configuration)
        configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0, POOL)
        configuration.retries = throttled_retries()
        core.api_client.rest_client = RESTClientObject(configuration)
        return core

    def _list(self, method, **kwargs) -> list[dict]:
        return self._paged(method, **kwargs)[0]

    @staticmethod
    def _paged(method, **kwargs) -> tuple[list[dict], str]:
        """Every item of a LIST, PAGE at a time, and the resourceVersion the pages share (one snapshot)."""
        items: list[dict] = []
        token = None
        with collector_paused():
            while True:
                page = _raw(method(limit=PAGE, _continue=token, _preload_content=False, **kwargs))
                items.extend(page.get("items") or [])
                token = (page.get("metadata") or {}).get("continue")
                if not token:
                    return items, (page.get("metadata") or {}).get("resourceVersion") or ""

    def list_nodes(self) -> list[dict]:
        return self._list(self.core.list_node)

    def list_active_pods(self) -> list[dict]:
        """Non-terminated pods in every namespace (what still holds node resources)."""
        return self._list(self.core.list_pod_for_all_namespaces, field_selector=ACTIVE_PODS)

    def list_pods(self, label_selector: str) -> list[dict]:
        """Pods in every namespace, terminated ones included."""
        return self._list(self.core.list_pod_for_all_namespaces, label_selector=label_selector)

    def get_node(self, name: str) -> dict:
        return _raw(self.core.read_node(name, _preload_content=False))

    def list_versioned(self, kind: str) -> tuple[list[dict], str]:
        """Every Node (`kind` "nodes") or every non-terminated pod ("pods"), paged, and the
        collection's resourceVersion at the read (one consistent snapshot: the pages share it), which
        a watch of the same collection resumes from (`stream_events`)."""
        method, kwargs = self._collection(kind)
        return self._paged(method, **kwargs)

    def stream_events(self, kind: str, resource_version: str, timeout_seconds: int) -> Iterator[tuple[str, dict]]:
        """(type, object) of every event of one watch of `kind`'s collection from `resource_version`,
        BOOKMARKs included (they say how far the stream has come when nothing changes); raw, no model
        objects. Gone when the version is too old to resume from (410, as a status or in the stream);
        NotPermitted when this identity may not watch the collection (401, 403)."""
        from kubernetes.client.exceptions import ApiException

        method, kwargs = self._collection(kind)
        try:
            response = method(watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
                              timeout_seconds=timeout_seconds, _request_timeout=(10, timeout_seconds + 30),
                              _preload_content=False, **kwargs)
        except ApiException as exc:
            if exc.status == 410:
                raise Gone(str(exc.reason)) from None
            if exc.status in (401, 403):
                raise NotPermitted(f"{exc.status} {exc.reason}: watch {kind}") from None
            raise
        try:
            rest = b""
            for chunk in response.stream(64 * 1024, decode_content=True):
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        yield watch_event(line)
        finally:
            response.release_conn()

    def request_progress(self, kind: str) -> str:
        """A consistent LIST of one object of `kind`'s collection, for what it does on the API server:
        its watch cache catches up with etcd (asking etcd for a progress notification), so the next
        BOOKMARK of a watch of that collection passes every write so far, of any resource. A quiet
        collection's bookmarks otherwise stay at its own last write for up to etcd's 10 minutes."""
        method, kwargs = self._collection(kind)
        return _raw(method(limit=1, _preload_content=False, **kwargs))["metadata"]["resourceVersion"]

    def _collection(self, kind: str):
        if kind == "nodes":
            return self.core.list_node, {}
        if kind == "pods":
            return self.core.list_pod_for_all_namespaces, {"field_selector": ACTIVE_PODS}
        raise ValueError(f"kind {kind!r}: a cluster view keeps 'nodes' or 'pods'")

    def node_to_watch(self, name: str) -> tuple[dict, str]:
        """One Node and the resourceVersion to watch it from: the collection's at the read (a list
        of that one Node). A watch from it replays every write after the read; the Node's own
        resourceVersion is that of its last write, which on a node stopped for longer than the
        API server keeps history (etcd compaction, 5 min) is 410 Gone at once."""
        return _node_and_version(name, _raw(self.core.list_node(field_selector=f"metadata.name={name}",
                                                                _preload_content=False)))

    def node_writes_since(self, name: str, resource_version: str, timeout_seconds: int = 1) -> list[dict]:
        """Every state of one Node written after `resource_version`, oldest first (a short watch
        replays them); raises Gone when the version is too old to resume from."""
        return [obj if kind != "DELETED" else {"metadata": obj.get("metadata", {})}
                for kind, obj in self._watch(self.core.list_node, field_selector=f"metadata.name={name}",
                                             resource_version=resource_version, timeout_seconds=timeout_seconds)]

    def pod_states(self, namespace: str, name: str, timeout_seconds: float) -> Iterator[dict | None]:
        """One pod as it is written, for up to `timeout_seconds`: first as it is now (None: there
        is no such pod), then every change (None once it is deleted). A list of that one pod, then
        a watch from the list's resourceVersion, so no write in between is lost; a stream the
        server ends early is resumed from the last version seen, and re-listed if that is Gone."""
        selector = f"metadata.name={name}"
        deadline = time.monotonic() + timeout_seconds
        while True:
            listing = _raw(self.core.list_namespaced_pod(namespace, field_selector=selector, _preload_content=False))
            yield (listing.get("items") or [None])[0]
            version = listing["metadata"]["resourceVersion"]
            try:
                while (left := deadline - time.monotonic()) > 0:
                    for kind, obj in self._watch(self.core.list_namespaced_pod, namespace, field_selector=selector,
                                                 resource_version=version, timeout_seconds=max(1, math.ceil(left))):
                        version = obj["metadata"]["resourceVersion"]
                        yield None if kind == "DELETED" else obj
                        if time.monotonic() >= deadline:
                            return
                return
            except Gone:
                continue

    @staticmethod
    def _watch(method, *args, resource_version: str, timeout_seconds: int, **kwargs) -> Iterator[tuple[str, dict]]:
        """(type, object) of each ADDED / MODIFIED / DELETED event of one watch from `resource_version`;
        Gone when that version is too old to resume from (410, as an ERROR event or a status)."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        try:
            for event in watch.Watch().stream(method, *args, resource_version=resource_version,
                                              timeout_seconds=timeout_seconds, _request_timeout=timeout_seconds + 30,
                                              **kwargs):
                obj = event["raw_object"] or {}
                if event["type"] == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(str(obj.get("message")))
                    raise ApiException(status=obj.get("code"), reason=str(obj.get("message")))
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    yield event["type"], obj
        except ApiException as exc:
            if exc.status == 410:
                raise Gone(str(exc.reason)) from None
            raise

    def create_pod(self, namespace: str, body: dict) -> dict:
        return self._write(self.core.create_namespaced_pod, namespace, body)

    def refusal_of_pod(self, namespace: str, body: dict) -> InvalidRequest | None:
        """What the API server says of creating `body` (a dry run: validation and admission, nothing
        stored): None when it would accept it, or the pod exists already. Other errors are raised."""
        try:
            self._write(self.core.create_namespaced_pod, namespace, body, dry_run="All")
        except InvalidRequest as refused:
            return refused
        except Conflict:        # the pod exists (a re-run of place after launch): nothing to refuse
            return None
        return None

    def read_pod(self, namespace: str, name: str) -> dict | None:
        return self._read_or_none(self.core.read_namespaced_pod, name, namespace)

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        """Delete (idempotent: a pod already gone is fine)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=grace_seconds,
                                            _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def pod_log_tail(self, namespace: str, name: str, lines: int = 20, container: str | None = None) -> list[str]:
        """The last `lines` lines of a pod's log ([] when there is none, e.g. never started)."""
        from kubernetes.client.exceptions import ApiException

        try:
            response = self.core.read_namespaced_pod_log(name, namespace, container=container, tail_lines=lines,
                                                         _preload_content=False)
        except ApiException as exc:
            if exc.status in (400, 404):
                return []
            raise
        return response.data.decode("utf-8", errors="replace").splitlines()

    def namespace_exists(self, name: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.read_namespace(name, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def denied(self, namespace: str, rights: tuple[tuple[str, str, str], ...]) -> list[str] | None:
        """Which of `rights` ((apiGroup, resource, verb)) this identity lacks in `namespace`, as
        "verb resource", by one SelfSubjectAccessReview each (the API server's own RBAC decision);
        None when the reviews themselves are refused (a cluster that withdrew system:basic-user)."""
        from kubernetes.client.exceptions import ApiException

        missing = []
        for group, resource, verb in rights:
            name, _, sub = resource.partition("/")
            attributes = {"namespace": namespace, "group": group, "resource": name, "verb": verb,
                          **({"subresource": sub} if sub else {})}
            body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": attributes}}
            try:
                review = _raw(self.authorization.create_self_subject_access_review(body, _preload_content=False))
            except ApiException as exc:
                if exc.status in (401, 403, 404):
                    return None
                raise
            if not (review.get("status") or {}).get("allowed"):
                missing.append(f"{verb} {resource}")
        return missing

    @cached_property
    def authorization(self):
        from kubernetes import client

        return client.AuthorizationV1Api(self.core.api_client)

    def read_configmap(self, namespace: str, name: str, cached: bool = False) -> dict | None:
        """The ConfigMap, or None. `cached`: any version the API server has (resourceVersion=0), served
        from its watch cache: perhaps a little behind the last write, but no etcd read (a third less of
        the API server's CPU for a 20 KB ConfigMap, measured on the real one); for polls that a stale
        answer only delays."""
        if not cached:
            return self._read_or_none(self.core.read_namespaced_config_map, name, namespace)
        return self._read_or_none(self._get_any_version, "/api/v1/namespaces/{namespace}/configmaps/{name}",
                                  {"namespace": namespace, "name": name})

    def _get_any_version(self, path: str, path_params: dict, _preload_content: bool = False):
        """GET `path` with resourceVersion=0 (the generated read methods take no resourceVersion)."""
        return self.core.api_client.call_api(path, "GET", path_params, [("resourceVersion", "0")],
                                             {"Accept": "application/json"}, auth_settings=["BearerToken"],
                                             _return_http_data_only=True, _preload_content=_preload_content)

    @staticmethod
    def _read_or_none(method, *args) -> dict | None:
        """The object, or None when it does not exist (404); Overloaded when the API server still turned the
        read away (429) after the client's own tries (`throttled_retries`)."""
        from kubernetes.client.exceptions import ApiException

        try:
            return _raw(method(*args, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None
            if exc.status == 429:
                raise Overloaded(f"{exc.status} {exc.reason}") from None
            raise

    def create_configmap(self, namespace: str, body: dict) -> dict:
        return self._write(self.core.create_namespaced_config_map, namespace, body)

    def replace_configmap(self, namespace: str, body: dict) -> dict:
        """Replace guarded by body.metadata.resourceVersion (compare-and-swap)."""
        return self._write(self.core.replace_namespaced_config_map, body["metadata"]["name"], namespace, body)

    def merge_patch_configmap(self, namespace: str, name: str, body: dict) -> dict | None:
        """JSON merge patch of a ConfigMap (None removes a key), applied to the object as it is: Conflict
        only when the API server gives up its own retries; None when there is no such ConfigMap (404)."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self._write(self.core.patch_namespaced_config_map, name, namespace, body,
                               _content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def merge_patch_node(self, name: str, body: dict) -> dict:
        """JSON merge patch of a Node (None removes a key); guarded when body.metadata.resourceVersion is set."""
        return self._write(self.core.patch_node, name, body, _content_type="application/merge-patch+json")

    @staticmethod
    def _write(method, *args, **kwargs) -> dict:
        from kubernetes.client.exceptions import ApiException

        try:
            return _raw(method(*args, _preload_content=False, **kwargs))
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(f"{exc.status} {exc.reason}") from None
            if exc.status in REFUSED:
                raise InvalidRequest.of(exc) from None
            if exc.status == 429 or 500 <= (exc.status or 0) < 600:
                raise Overloaded(f"{exc.status} {exc.reason}") from None
            raise


@dataclass(frozen=True)
class NodeEvent:
    """One state of a watched Node. `relisted`: it comes from a fresh read after the watch could
    not resume (410 Gone), so writes before it may have been missed. `node` is {} once deleted."""

    node: dict
    relisted: bool = False


class NodeEvents:
    """Every state of one Node, in order, as one stream: list (when no version to resume from),
    watch from the last resourceVersion, resume after the server ends a watch, re-list on 410
    Gone, reconnect with capped exponential backoff after errors. A pump (`_NodePump`) puts the
    events into this reader's queue, so the reader can wait on its own timers (`next(timeout)`)
    without cancelling the watch. Use as `async with client.node_events(name, version) as events`.

    Readers of one Node on one loop and connection share one pump, so a burst of jobs booting
    the same 8-GPU node opens one watch, not one per job, and its events are parsed once (see
    `_NodePump.join` for when a reader can share and why it then misses nothing). The readers
    get the same dicts: read them, never change them."""

    def __init__(self, client: AsyncKubeClient, name: str, resource_version: str | None, log=None,
                 watch_seconds: int = WATCH_SECONDS, backoff: tuple[float, float] = (1.0, 30.0)) -> None:
        self.client, self.name, self.resource_version = client, name, resource_version
        self.log = log or logging.getLogger(__name__)
        self.watch_seconds, self.backoff = watch_seconds, backoff
        self._queue: asyncio.Queue[NodeEvent] = asyncio.Queue()
        self._after: int | None = None    # skip events up to this version (a shared pump may be behind it)
        self._pump: _NodePump | None = None

    async def __aenter__(self) -> NodeEvents:
        self._pump = _NodePump.join(self)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._pump is not None:
            await self._pump.leave(self)

    async def next(self, timeout: float | None) -> NodeEvent | None:
        """The next state, or None when `timeout` seconds pass first (the stream goes on)."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout=None if timeout is None else max(0.0, timeout))
        except TimeoutError:
            return None

    def _deliver(self, event: NodeEvent, version: int | None) -> None:
        if event.relisted:
            self._after = None           # a re-list: what came before it may be missing, for every reader
        elif self._after is not None:
            if version is not None and version <= self._after:
                return                   # this reader started after that write
            self._after = None
        self._queue.put_nowait(event)


def _node_and_version(name: str, listing: dict) -> tuple[dict, str]:
    """The one Node of a list by name, and the list's resourceVersion (`node_to_watch`)."""
    items = listing.get("items") or []
    if not items:
        raise LookupError(f"node {name} not found")
    return items[0], listing["metadata"]["resourceVersion"]


def _version(resource_version: str | None) -> int | None:
    """A resourceVersion as a number, or None. The API calls them opaque; etcd's (every cluster
    ACK runs) are integers, and a pump is shared only between readers whose versions parse."""
    try:
        return int(resource_version) if resource_version is not None else None
    except ValueError:
        return None


class _NodePump:
    """One list/watch loop of one Node feeding its readers. It keeps the events it has pumped
    (up to HISTORY), so a reader joining later from version r is given, from that history and
    then live, exactly the events after r: what a watch of its own from r would give."""

    HISTORY = 1_000
    _shared: ClassVar[dict[tuple, _NodePump]] = {}

    def __init__(self, first: NodeEvents, key: tuple | None) -> None:
        self.key, self.name, self.client = key, first.name, first.client
        self.watch_seconds, self.backoff = first.watch_seconds, first.backoff
        self.resource_version = first.resource_version
        self.floor = _version(first.resource_version)   # the history is complete from this version on
        self.history: collections.deque[tuple[NodeEvent, int | None]] = collections.deque()
        self.readers: list[NodeEvents] = [first]
        self.task = asyncio.create_task(self._run())

    @classmethod
    def join(cls, reader: NodeEvents) -> _NodePump:
        """Share the pump of this Node when it can serve `reader`: the reader resumes from a version
        (not a fresh list), both versions are numbers, and the pump's history is complete from at or
        before it. Otherwise the reader gets a pump of its own (shared with later readers). A reader
        shares the pump's fate: should the pump's own version expire (410) before it caught up, every
        reader is re-listed with it, flagged, which costs them the fallback window, never an early fire."""
        since = _version(reader.resource_version)
        key = (id(asyncio.get_running_loop()), reader.client.kubernetes_conn_id, reader.name)
        pump = cls._shared.get(key)
        live = pump is not None and not pump.task.done() and pump.task.get_loop() is asyncio.get_running_loop()
        if live and since is not None and pump.floor is not None and pump.floor <= since:
            reader._after = since
            for event, version in pump.history:
                reader._deliver(event, version)
            pump.readers.append(reader)
            return pump
        pump = cls(reader, key if since is not None else None)
        if pump.key is not None:
            cls._shared[pump.key] = pump     # replaces an older pump for new readers; that one runs on for its own
        return pump

    async def leave(self, reader: NodeEvents) -> None:
        self.readers.remove(reader)
        if self.readers:
            return
        if self.key is not None and self._shared.get(self.key) is self:
            del self._shared[self.key]
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task

    def _publish(self, event: NodeEvent, version: int | None) -> None:
        self.history.append((event, version))
        if len(self.history) > self.HISTORY:
            _, dropped = self.history.popleft()
            self.floor = dropped if dropped is not None and self.floor is not None else None
        for reader in self.readers:
            reader._deliver(event, version)

    def _warn(self, message: str, *args) -> None:
        for log in {id(r.log): r.log for r in self.readers}.values():
            log.warning(message, *args)

    async def _run(self) -> None:
        relist, delay = False, self.backoff[0]
        while True:
            try:
                if self.resource_version is None:
                    # The collection's version at the read, never the Node's own: a stopped node's
                    # last write can be older than the history, and a watch from it is Gone again.
                    node, self.resource_version = await self.client.node_to_watch(self.name)
                    if relist:
                        self.floor = None        # the history has a gap here: no later reader may rely on it
                    self._publish(NodeEvent(node, relisted=relist), _version(self.resource_version))
                async with contextlib.aclosing(self.client.watch_node(self.name, self.resource_version,
                                                                      self.watch_seconds, bookmarks=True)) as events:
                    async for kind, obj in events:
                        self.resource_version = obj["metadata"]["resourceVersion"]
                        if kind != "BOOKMARK":    # a bookmark only moves the version to resume from
                            self._publish(NodeEvent({} if kind == "DELETED" else obj), _version(self.resource_version))
                delay = self.backoff[0]                  # the server ended the watch: resume
            except Gone:
                self._warn("watch of node %s expired (410 Gone); re-listing", self.name)
                self.resource_version, relist = None, True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._warn("watching node %s failed (%s: %s); retrying from resourceVersion %s in %.0fs",
                           self.name, type(exc).__name__, str(exc)[:200], self.resource_version, delay)
                await asyncio.sleep(delay)
                delay = min(self.backoff[1], delay * 2)


def mask_credentials(configuration) -> None:
    """Register the credentials a kubeconfig gave a client (a ServiceAccount's bearer token, a
    basic-auth password) with Airflow's secrets masker. They come from the file named by the
    connection's `kube_config_path`, not from a connection field, so Airflow does not know them:
    without this, a token quoted in an error or a debug line would reach the task log as is."""
    from airflow.sdk.log import mask_secret

    for value in (getattr(configuration, "api_key", None) or {}).values():
        if isinstance(value, str) and value:
            mask_secret(value.removeprefix("Bearer ").strip())
    password = getattr(configuration, "password", None)
    if isinstance(password, str) and password:
        mask_secret(password)


def import_async_clients():
    """Import what a trigger's Kubernetes calls need, and return the provider's async hook class:
    the provider's hooks (with the `kubernetes` client) and kubernetes_asyncio, which takes
    seconds. Done once per process: here by the first trigger's preparation, or ahead of any
    trigger by gpuboot.ui.warmup when the triggerer starts."""
    import kubernetes_asyncio.client
    import kubernetes_asyncio.watch  # noqa: F401
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

    return AsyncKubernetesHook


def _prepared_hook(conn_id: str):
    """The provider's async hook with its configuration loaded, built in a worker thread.

    Everything here is synchronous and may take seconds on a busy triggerer: the first import of
    the provider's hooks and kubernetes_asyncio, reading the connection (a call to the supervisor,
    as the provider's own sync_to_async does), reading and parsing the kubeconfig, loading the CA
    and the credentials. Run on the triggerer's event loop it would stall every other trigger
    (Airflow logs "async thread was blocked"); here it runs once per trigger, off the loop, and the
    hook keeps the loaded configuration (for static credentials; exec plugins reload per call)."""
    from airflow.exceptions import AirflowNotFoundException
    from airflow.sdk import BaseHook

    AsyncKubernetesHook = import_async_clients()     # here, not on the loop

    try:
        extras = BaseHook.get_connection(conn_id).extra_dejson
    except AirflowNotFoundException:
        if conn_id != AsyncKubernetesHook.default_conn_name:
            raise
        extras = {}                      # as the provider does: the default connection may be absent
    key = (conn_id, json.dumps(extras, sort_keys=True, default=str))
    with _HOOKS_LOCK:
        built = _HOOKS.get(key)
        if built is not None and time.monotonic() - built[0] < HOOK_REUSE_SECONDS:
            return built[1]
    hook = AsyncKubernetesHook(conn_id=conn_id, connection_extras=extras)

    async def load() -> None:
        async with hook.get_conn():      # loads and keeps the kubeconfig; the client is closed at once
            pass

    asyncio.run(load())                  # a private loop in this thread: its file reads block nobody
    mask_credentials(hook.client_configuration)
    with _HOOKS_LOCK:
        _HOOKS[key] = (time.monotonic(), hook)
    return hook


# Prepared hooks, per connection (its extra as read): the threads that prepare them hold the GIL for
# most of their work, so a hundred triggers each preparing its own would still starve the loop. A
# changed connection gets a new hook; a kubeconfig file rewritten in place (a rotated token) is read
# again after HOOK_REUSE_SECONDS.
HOOK_REUSE_SECONDS = 300.0
_HOOKS: dict[tuple[str, str], tuple[float, Any]] = {}
_HOOKS_LOCK = threading.Lock()
_IN_FLIGHT: dict[tuple[int, str], asyncio.Future] = {}


class AsyncKubeClient:
    """Asynchronous access for triggers (AsyncKubernetesHook), one node at a time. Nothing it
    does blocks the event loop: the hook is prepared in a worker thread (`_prepared_hook`)."""

    def __init__(self, kubernetes_conn_id: str = "kubernetes_default") -> None:
        self.kubernetes_conn_id = kubernetes_conn_id
        self._hook: asyncio.Future | None = None

    async def hook(self):
        """The prepared hook, looked up once per client; triggers starting together share one
        preparation in flight (a burst of 100 waits costs one connection read, not 100)."""
        if self._hook is None or (self._hook.done() and self._hook.exception() is not None):
            key = (id(asyncio.get_running_loop()), self.kubernetes_conn_id)
            flight = _IN_FLIGHT.get(key)
            if flight is None:
                flight = asyncio.ensure_future(asyncio.to_thread(_prepared_hook, self.kubernetes_conn_id))
                _IN_FLIGHT[key] = flight
                flight.add_done_callback(lambda _: _IN_FLIGHT.pop(key, None))
            self._hook = flight
        return await asyncio.shield(self._hook)

    async def get_node(self, name: str) -> dict:
        hook = await self.hook()            # first: it imports kubernetes_asyncio off the loop
        from kubernetes_asyncio import client

        async with hook.get_conn() as api:
            response = await _checked(await client.CoreV1Api(api).read_node(name, _preload_content=False))
            return json.loads(await response.read())

    async def read_configmap(self, namespace: str, name: str) -> dict | None:
        """The ConfigMap, or None when it does not exist (404)."""
        hook = await self.hook()
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        async with hook.get_conn() as api:
            try:
                response = await _checked(await client.CoreV1Api(api).read_namespaced_config_map(
                    name, namespace, _preload_content=False))
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            return json.loads(await response.read())

    async def node_to_watch(self, name: str) -> tuple[dict, str]:
        """One Node and the collection's resourceVersion at the read (see KubeClient.node_to_watch)."""
        hook = await self.hook()
        from kubernetes_asyncio import client

        async with hook.get_conn() as api:
            response = await _checked(await client.CoreV1Api(api).list_node(
                field_selector=f"metadata.name={name}", _preload_content=False))
            return _node_and_version(name, json.loads(await response.read()))

    def node_events(self, name: str, resource_version: str | None, log=None) -> NodeEvents:
        """The one stream of a Node's states (see NodeEvents), from `resource_version` when given."""
        return NodeEvents(self, name, resource_version, log)

    def watch_node(self, name: str, resource_version: str | None, timeout_seconds: int,
                   bookmarks: bool = False) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield (event type, node dict) for one Node until the server ends the watch
        after `timeout_seconds`; raises Gone when `resource_version` is too old. With `bookmarks`,
        BOOKMARK events too: their version is where a quiet Node's watch resumes without 410."""
        return self._watch(lambda core, **at: core.list_node(field_selector=f"metadata.name={name}", watch=True, **at),
                           resource_version, timeout_seconds, bookmarks)

    def watch_pods(self, namespace: str, label_selector: str, resource_version: str,
                   timeout_seconds: int) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield (event type, pod dict) for the pods `label_selector` matches, as watch_node does."""
        return self._watch(lambda core, **at: core.list_namespaced_pod(namespace, label_selector=label_selector,
                                                                       watch=True, **at),
                           resource_version, timeout_seconds)

    async def _watch(self, open_watch, resource_version: str | None, timeout_seconds: int,
                     bookmarks: bool = False) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The events of the watch `open_watch(CoreV1Api, **at)` opens, from `resource_version`.

        The stream is read raw, one JSON line per event, rather than through kubernetes_asyncio's
        Watch: that one builds a default ApiClient per watch (loading the system CA bundle, a long
        pause on the loop) and turns every event into model objects, only for us to want the dict."""
        hook = await self.hook()            # first: it imports kubernetes_asyncio off the loop
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        async with hook.get_conn() as api:
            try:
                response = await _checked(await open_watch(
                    client.CoreV1Api(api), resource_version=resource_version, allow_watch_bookmarks=bookmarks,
                    timeout_seconds=max(1, int(timeout_seconds)), _request_timeout=timeout_seconds + 30,
                    _preload_content=False))
            except ApiException as exc:
                if exc.status == 410:
                    raise Gone(str(exc.reason)) from None
                raise
            try:
                while line := await response.content.readline():
                    kind, obj = watch_event(line)
                    if bookmarks or kind != "BOOKMARK":
                        yield kind, obj
            finally:
                response.release()

    async def list_pods(self, namespace: str, label_selector: str) -> tuple[list[dict], str]:
        """(the pods `label_selector` matches, the list's resourceVersion: where a watch of them starts)."""
        hook = await self.hook()            # first: it imports kubernetes_asyncio off the loop
        from kubernetes_asyncio import client

        async with hook.get_conn() as api:
            response = await _checked(await client.CoreV1Api(api).list_namespaced_pod(
                namespace, label_selector=label_selector, _preload_content=False))
            listed = json.loads(await response.read())
            return listed.get("items") or [], (listed.get("metadata") or {}).get("resourceVersion")

    async def delete_pods(self, namespace: str, names: list[str]) -> list[str]:
        """Delete each pod named (its kubelet stops the containers); the names that were there."""
        hook = await self.hook()
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        deleted = []
        async with hook.get_conn() as api:
            for name in names:
                try:
                    await client.CoreV1Api(api).delete_namespaced_pod(name, namespace, _preload_content=False)
                    deleted.append(name)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
        return deleted

    async def pod_log(self, namespace: str, name: str, container: str,
                      since_seconds: int | None = None) -> AsyncIterator[bytes]:
        """Yield a pod's log lines, timestamped ("<RFC3339Nano> <line>"), following until the
        container ends or the server closes the stream; only the last `since_seconds` when given
        (the client has no sinceTime: a resuming reader drops what it has seen by timestamp)."""
        hook = await self.hook()
        from kubernetes_asyncio import client

        async with hook.get_conn() as api:
            kwargs = {"since_seconds": since_seconds} if since_seconds else {}
            response = await _checked(await client.CoreV1Api(api).read_namespaced_pod_log(
                name, namespace, container=container, follow=True, timestamps=True, _preload_content=False,
                **kwargs))
            try:
                async for line in response.content:
                    yield line
            finally:
                response.release()


async def _checked(response):
    """`response` if its status is 2xx, else the ApiException the sync client would raise.

    kubernetes_asyncio checks the status only when it preloads the body: a raw response
    (_preload_content=False, how these reads avoid its model objects) of a 404, 403 or 400
    would otherwise read as the object asked for, a Status in its place."""
    if 200 <= response.status <= 299:
        return response
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        body = (await response.read()).decode("utf-8", errors="replace")
    finally:
        response.release()
    with contextlib.suppress(ValueError, AttributeError):
        body = json.loads(body).get("message") or body
    raise ApiException(status=response.status, reason=f"{response.reason}: {str(body)[:300]}")


def watch_event(line: bytes | str) -> tuple[str, dict]:
    """(type, object) of one line of a watch stream; an ERROR event raises (Gone for 410), as the
    API server reports an expired resourceVersion inside the stream."""
    event = json.loads(line)
    kind, obj = event.get("type"), event.get("object")
    if not kind or not isinstance(obj, dict):
        raise RuntimeError(f"malformed watch event: {str(line)[:200]}")
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise Gone(str(obj.get("message")))
        raise RuntimeError(f"watch failed: {obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
    return kind, obj

"""What the kubelets need of the Kubernetes API, and its two implementations.

The emulated kubelets (simcloud.machines.kubelet) are one code path whichever API server
backs the cloud; they talk to it only through `KubeletApi`:

* `StoreApi`: simcloud's own API server, in process (simcloud.kube.store). Every call is done
  when it returns (the coroutines never suspend), so the kubelets' writes land in call order.
* `HttpApi`: any API server over HTTPS (the real kube-apiserver). `for_node(name)` gives the
  view of node `name`'s own kubelet: its bearer token is user system:node:<name> in group
  system:nodes, so the Node authorizer and NodeRestriction judge each write as they judge a
  real kubelet's. Writes of Node and Pod status go through the `status` subresource;
  `mutate` is GET (or the last copy seen), apply, PUT with that resourceVersion, and again
  on 409 Conflict; mutations of one object are applied in call order. Pods are followed with
  ONE list+watch for the whole fleet (a dedicated read-only identity), not one per node:
  the stream is what costs on a small machine, and every write is still made as the node.

Calls raise simcloud.kube.errors.ApiError with the server's code, reason and message.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import secrets
import ssl
from collections.abc import Callable, Iterable
from typing import Protocol

from simcloud.kube.errors import ApiError

log = logging.getLogger(__name__)


class KubeletApi(Protocol):
    """The calls a kubelet makes (as node `for_node(name)`); objects are plain JSON dicts."""

    def for_node(self, name: str) -> KubeletApi: ...

    async def create(self, resource: str, obj: dict) -> dict: ...

    async def get(self, resource: str, namespace: str | None, name: str) -> dict: ...

    async def mutate(self, resource: str, namespace: str | None, name: str, fn: Callable[[dict], None]) -> dict: ...

    async def remove(self, resource: str, namespace: str | None, name: str, uid: str | None = None) -> None: ...

    async def record_event(self, involved: dict, reason: str, message: str, type: str = "Normal",
                           component: str = "kubelet") -> None: ...

    def peek(self, resource: str) -> Iterable[dict]: ...

    def subscribe(self, resource: str) -> asyncio.Queue: ...

    def unsubscribe(self, resource: str, queue: asyncio.Queue) -> None: ...


class StoreApi:
    """simcloud's own store, in process: one view serves every node."""

    def __init__(self, store) -> None:
        self.store = store

    def for_node(self, name: str) -> StoreApi:
        return self

    async def create(self, resource: str, obj: dict) -> dict:
        return self.store.create(resource, obj)

    async def get(self, resource: str, namespace: str | None, name: str) -> dict:
        return self.store.get(resource, namespace, name)

    async def mutate(self, resource: str, namespace: str | None, name: str, fn: Callable[[dict], None]) -> dict:
        return self.store.mutate(resource, namespace, name, fn)

    async def remove(self, resource: str, namespace: str | None, name: str, uid: str | None = None) -> None:
        current = self.store.read(resource, namespace, name)
        if uid and current["metadata"].get("uid") != uid:
            raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, "
                                            f"UID in object meta: {current['metadata'].get('uid')}")
        self.store.remove(resource, namespace, name)

    async def record_event(self, involved: dict, reason: str, message: str, type: str = "Normal",
                           component: str = "kubelet") -> None:
        self.store.record_event(involved, reason, message, type=type, component=component)

    def peek(self, resource: str) -> Iterable[dict]:
        return self.store.peek(resource)

    def subscribe(self, resource: str) -> asyncio.Queue:
        """Every object there is now as ADDED, then every change (an informer's view)."""
        queue = self.store.subscribe(resource)
        for obj in self.store.list(resource)[0]:
            queue.put_nowait(("ADDED", obj))
        return queue

    def unsubscribe(self, resource: str, queue: asyncio.Queue) -> None:
        self.store.unsubscribe(resource, queue)


# ---------------------------------------------------------------------- over HTTP
_PATHS = {   # resource -> (API prefix, namespaced)
    "nodes": ("/api/v1", False), "pods": ("/api/v1", True), "events": ("/api/v1", True),
    "namespaces": ("/api/v1", False), "leases": ("/apis/coordination.k8s.io/v1", True),
}
_STATUS_WRITES = ("nodes", "pods")   # a kubelet writes only their status


def resource_path(resource: str, namespace: str | None = None, name: str | None = None) -> str:
    prefix, namespaced = _PATHS[resource]
    path = f"{prefix}/namespaces/{namespace}/{resource}" if namespaced and namespace else f"{prefix}/{resource}"
    return f"{path}/{name}" if name else path


class HttpApi:
    """The API server at `server` (https URL, CA `ca_pem`) for a fleet of kubelets.

    tokens: node name -> that node's bearer token; watch_token: an identity that may list and watch
    all pods (the fleet's one pod watch)."""

    def __init__(self, server: str, ca_pem: bytes, tokens: dict[str, str], watch_token: str,
                 *, timeout: float = 30.0) -> None:
        self.server = server.rstrip("/")
        self.tokens, self.watch_token = dict(tokens), watch_token
        self._tls = ssl.create_default_context(cadata=ca_pem.decode())
        self._timeout = timeout
        self._session = None
        self._latest: dict[tuple, dict] = {}          # (resource, ns, name) -> newest copy seen
        self._locks: dict[tuple, asyncio.Lock] = {}
        self._pods: dict[str, dict] = {}              # uid -> pod, from the watch
        self._subscribers: list[asyncio.Queue] = []
        self._watch_task: asyncio.Task | None = None
        self._views: dict[str, _NodeView] = {}

    def session(self):
        if self._session is None:
            import aiohttp
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._tls, limit=64),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout))
        return self._session

    def for_node(self, name: str) -> _NodeView:
        if name not in self._views:
            self._views[name] = _NodeView(self, name, self.tokens[name])
        return self._views[name]

    async def remove(self, resource: str, namespace: str | None, name: str, uid: str | None = None) -> None:
        """Without a node: a pod bound to a node no kubelet here serves. On a real control plane that is
        the pod garbage collector's (kube-controller-manager), not a kubelet's, so nothing is done."""

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch_task
        if self._session is not None:
            await self._session.close()

    async def request(self, token: str, method: str, path: str, body: dict | None = None,
                      params: dict | None = None) -> dict:
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body)
        import aiohttp
        async with self.session().request(method, self.server + path, data=data, headers=headers, params=params,
                                          timeout=aiohttp.ClientTimeout(total=self._timeout)) as response:
            text = await response.text()
            if response.status >= 400:
                raise _error(response.status, text)
            return json.loads(text) if text else {}

    # -- the informer: one list+watch of pods for the whole fleet --------------------------------
    def peek(self, resource: str) -> Iterable[dict]:
        if resource != "pods":
            raise ValueError("only pods are followed over HTTP")
        return list(self._pods.values())

    def subscribe(self, resource: str) -> asyncio.Queue:
        if resource != "pods":
            raise ValueError("only pods are followed over HTTP")
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)
        if self._watch_task is None:
            self._watch_task = asyncio.ensure_future(self._follow_pods())
        else:
            for pod in self._pods.values():
                queue.put_nowait(("ADDED", copy.deepcopy(pod)))
        return queue

    def unsubscribe(self, resource: str, queue: asyncio.Queue) -> None:
        self._subscribers = [q for q in self._subscribers if q is not queue]

    def _emit(self, kind: str, pod: dict) -> None:
        meta = pod["metadata"]
        if kind == "DELETED":
            self._pods.pop(meta["uid"], None)
            self._latest.pop(("pods", meta["namespace"], meta["name"]), None)
        else:
            self._pods[meta["uid"]] = pod
            self._seen("pods", pod)
        for queue in self._subscribers:
            queue.put_nowait((kind, copy.deepcopy(pod)))

    async def _follow_pods(self) -> None:
        """List, then watch from the list's resourceVersion; on 410 Gone or a broken stream list
        again, telling subscribers what vanished meanwhile (DELETED) and what is there (ADDED)."""
        import aiohttp
        params = {"fieldSelector": "spec.nodeName!="}
        while True:
            try:
                listed = await self.request(self.watch_token, "GET", resource_path("pods"), params=params)
                fresh = {p["metadata"]["uid"]: p for p in listed.get("items") or []}
                for uid, pod in list(self._pods.items()):
                    if uid not in fresh:
                        self._emit("DELETED", pod)
                for pod in fresh.values():
                    pod.setdefault("apiVersion", "v1")
                    pod.setdefault("kind", "Pod")
                    self._emit("ADDED", pod)
                version = listed["metadata"]["resourceVersion"]
                while True:
                    version = await self._watch(params, version)
            except asyncio.CancelledError:
                raise
            except (ApiError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.info("kubelets: pod watch ended (%s); listing again", exc)
                await asyncio.sleep(0.5)

    async def _watch(self, params: dict, version: str) -> str:
        import aiohttp
        query = {**params, "watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": "300"}
        headers = {"Authorization": f"Bearer {self.watch_token}", "Accept": "application/json"}
        async with self.session().get(self.server + resource_path("pods"), params=query, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=None, sock_read=400)) as response:
            if response.status >= 400:
                raise _error(response.status, await response.text())
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    raise _error(int(obj.get("code") or 500), json.dumps(obj))
                version = obj["metadata"].get("resourceVersion", version)
                if kind != "BOOKMARK":
                    obj.setdefault("apiVersion", "v1")
                    obj.setdefault("kind", "Pod")
                    self._emit(kind, obj)
        return version

    def _seen(self, resource: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        key = (resource, meta.get("namespace"), meta.get("name"))
        old = self._latest.get(key)
        if old is None or _rv(old) <= _rv(obj):
            self._latest[key] = obj


class _NodeView:
    """One node's kubelet: every call made with that node's token."""

    def __init__(self, api: HttpApi, name: str, token: str) -> None:
        self.api, self.name, self.token = api, name, token

    def for_node(self, name: str) -> _NodeView:
        return self.api.for_node(name)

    async def create(self, resource: str, obj: dict) -> dict:
        namespace = (obj.get("metadata") or {}).get("namespace")
        created = await self.api.request(self.token, "POST", resource_path(resource, namespace), obj)
        self.api._seen(resource, created)
        return created

    async def get(self, resource: str, namespace: str | None, name: str) -> dict:
        obj = await self.api.request(self.token, "GET", resource_path(resource, namespace, name))
        self.api._seen(resource, obj)
        return obj

    async def mutate(self, resource: str, namespace: str | None, name: str, fn: Callable[[dict], None]) -> dict:
        """GET (or the newest copy seen), apply `fn`, PUT with its resourceVersion; on 409 read and
        apply again. One object's mutations run one at a time, in call order."""
        key = (resource, namespace, name)
        lock = self.api._locks.setdefault(key, asyncio.Lock())
        path = resource_path(resource, namespace, name)
        put_path = path + "/status" if resource in _STATUS_WRITES else path
        async with lock:
            for attempt in range(20):
                current = self.api._latest.get(key) if attempt == 0 else None
                cached = current is not None
                if current is None:
                    current = await self.get(resource, namespace, name)
                new = copy.deepcopy(current)
                fn(new)
                try:
                    written = await self.api.request(self.token, "PUT", put_path, new)
                except ApiError as exc:
                    # NodeRestriction judges the whole body before the resourceVersion is checked: a stale
                    # copy whose taints the controller has changed since is refused 403, not 409
                    if exc.code == 409 or (cached and exc.code in (403, 422)):
                        self.api._latest.pop(key, None)
                        continue
                    raise
                self.api._seen(resource, written)
                return written
            raise ApiError(409, "Conflict", f"{resource} {name}: still conflicting after 20 attempts")

    async def remove(self, resource: str, namespace: str | None, name: str, uid: str | None = None) -> None:
        """A kubelet's final delete: grace period 0, on the uid it knows (a newer object of the same
        name is left alone)."""
        body: dict = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
        if uid:
            body["preconditions"] = {"uid": uid}
        await self.api.request(self.token, "DELETE", resource_path(resource, namespace, name), body)

    async def record_event(self, involved: dict, reason: str, message: str, type: str = "Normal",
                           component: str = "kubelet") -> None:
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        now = _now()
        ref = {"apiVersion": involved.get("apiVersion", "v1"), "kind": involved.get("kind", "Pod"),
               "name": meta.get("name"), "uid": meta.get("uid")}
        if meta.get("namespace"):
            ref["namespace"] = namespace
        await self.api.request(self.token, "POST", resource_path("events", namespace), {
            "metadata": {"name": f"{meta.get('name')}.{secrets.token_hex(8)}", "namespace": namespace},
            "involvedObject": ref, "reason": reason, "message": message, "type": type,
            "source": {"component": component, "host": self.name}, "reportingComponent": component,
            "reportingInstance": self.name, "firstTimestamp": now, "lastTimestamp": now, "count": 1})

    def peek(self, resource: str) -> Iterable[dict]:
        return self.api.peek(resource)

    def subscribe(self, resource: str) -> asyncio.Queue:
        return self.api.subscribe(resource)

    def unsubscribe(self, resource: str, queue: asyncio.Queue) -> None:
        self.api.unsubscribe(resource, queue)


def _rv(obj: dict) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def _now() -> str:
    import time
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _error(status: int, text: str) -> ApiError:
    try:
        body = json.loads(text)
        return ApiError(int(body.get("code") or status), body.get("reason") or "Unknown", body.get("message") or text)
    except (ValueError, AttributeError):
        return ApiError(status, "Unknown", text[:500])

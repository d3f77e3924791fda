"""The object store shared by the Kubernetes API and the in-process controllers.

A versioned map per resource, like etcd behind the real API server: one global,
monotonic resourceVersion, a change history per resource (like the apiserver's watch
cache) so watches can resume from a resourceVersion, and queues for in-process watchers.
The history is bounded per resource as the watch cache bounds it (at most HISTORY_LIMIT events;
those older than FRESH_SECONDS go once more than FRESH_MIN_EVENTS are kept) and by age for all of
them: every version written more than `history_seconds` ago is compacted, as the apiserver's
periodic etcd compaction (5 min) does, so a watch from it is 410 Gone whatever the resource. Each resource keeps its keys sorted, so a list page
(`limit` + continue after the last key) costs O(log n + page), not a scan of everything.

Creates and API updates are defaulted and validated (simcloud.kube.admission, simcloud.kube.validation:
422 with causes) before they are stored, and take `dry_run` (validated, nothing stored);
in-process controllers write through `mutate`, which trusts them.

Stored objects are never edited in place: every write stores a new dict. Public
methods hand out deep copies; the API's hot paths read the stored objects
through `select`/`peek`/`watch` and only serialize them (read-only by contract).
Everything runs in one asyncio loop, so there are no locks.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from simcloud.kube import admission, validation
from simcloud.kube.errors import ApiError, invalid
from simcloud.kube.patching import PatchError, apply_patch
from simcloud.kube.resources import RESOURCES, ResourceInfo
from simcloud.kube.selectors import SelectorError, parse_field_selector, parse_label_selector

HISTORY_LIMIT = 100 * 1024    # kube-apiserver's watch cache holds at most this many events per resource (k8s.io/
                              # apiserver pkg/storage/cacher, defaultUpperBoundCapacity): 10k heartbeating nodes must
                              # not push a watch of pods or nodes out of its history within seconds
HISTORY_SECONDS = 300.0     # kube-apiserver --etcd-compaction-interval default
FRESH_SECONDS = 75.0        # the watch cache sizes itself to hold at least this long of events (DefaultEventFreshDuration)
FRESH_MIN_EVENTS = 100      # ... and at least this many (defaultLowerBoundCapacity); older ones past both may go
CACHE_LAG_SECONDS = 0.2     # a GET with resourceVersion=0 may show an object as it was this long ago (`read_cached`)
NAMESPACE_FINALIZE_SECONDS = 5.0   # a deleted namespace stays Terminating this long at least (1.37: ~5 s)
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class Page(NamedTuple):
    items: list[dict]      # stored objects (read-only), in key order
    more: bool             # more matching objects follow the last item
    remaining: int         # objects of the scanned range after the last item (exact without selectors)


class WatchEvent(NamedTuple):
    rv: int
    type: str          # ADDED | MODIFIED | DELETED
    obj: dict          # the stored object (read-only)
    old: dict | None   # the previous version (MODIFIED), for selector transitions


@dataclass
class _Subscriber:
    queue: asyncio.Queue
    raw: bool          # True: WatchEvent with shared read-only objects (the API); False: (type, copy)


def clone(obj):
    """A deep copy of JSON data (dicts, lists, scalars): what stored objects are made of.

    Several times faster than copy.deepcopy, which dominated creating and listing
    thousands of objects.
    """
    if type(obj) is dict:
        return {k: clone(v) for k, v in obj.items()}
    if type(obj) is list:
        return [clone(v) for v in obj]
    return obj


def now_rfc3339(offset_seconds: float = 0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=offset_seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _random_suffix(n: int = 5) -> str:
    return "".join(random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(n))


def not_found(resource: str, name: str) -> ApiError:
    info = RESOURCES.get(resource)
    details = {"name": name, "kind": resource}
    if info and info.group:
        details["group"] = info.group
    qualified = f"{resource}.{info.group}" if info and info.group else resource
    return ApiError(404, "NotFound", f'{qualified} "{name}" not found', details)


def conflict(resource: str, name: str, why: str = "the object has been modified; please apply your changes to "
                                                   "the latest version and try again") -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": {why}',
                    {"name": name, "kind": resource})


def too_large_resource_version(requested: int, current: int) -> ApiError:
    """storage.NewTooLargeResourceVersionError: a Timeout the client may retry after a second."""
    return ApiError(504, "Timeout", f"Timeout: Too large resource version: {requested}, current: {current}",
                    {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                     "retryAfterSeconds": 1})


def _namespace_range(keys: list[tuple[str, str]], namespace: str) -> tuple[int, int]:
    """The slice of sorted (namespace, name) keys in `namespace` (not in one whose name extends it)."""
    return bisect_left(keys, (namespace,)), bisect_left(keys, (namespace + "\0",))


def _is_terminal(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class Store:
    def __init__(self, history_limit: int = HISTORY_LIMIT, history_seconds: float = HISTORY_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self._objects: dict[str, dict[tuple[str, str], dict]] = {name: {} for name in RESOURCES}
        self._keys: dict[str, list[tuple[str, str]]] = {name: [] for name in RESOURCES}   # sorted
        self._rv = 0
        self._history: dict[str, deque[WatchEvent]] = {name: deque() for name in RESOURCES}
        self._history_at: dict[str, deque[float]] = {name: deque() for name in RESOURCES}   # when each was written
        self._history_limit = history_limit
        self._compacted_rv: dict[str, int] = dict.fromkeys(RESOURCES, 0)
        self._history_seconds, self._clock = history_seconds, clock
        self._written: deque[tuple[float, int]] = deque()   # (when, rv) of the writes not yet compacted by age
        self._aged_rv = 0                                    # newest rv compacted by age (all resources)
        self._cache_rv: dict[str, int] = dict.fromkeys(RESOURCES, 0)   # how far each watch cache has come
        self._subscribers: dict[str, list[_Subscriber]] = {name: [] for name in RESOURCES}
        self._event_keys: dict[tuple, tuple[str, str]] = {}
        # (resource, key) -> (when, the object before) of the writes of the last CACHE_LAG_SECONDS (`read_cached`)
        self._before: dict[tuple[str, tuple[str, str]], tuple[float, dict | None]] = {}
        self._before_order: deque[tuple[float, tuple[str, tuple[str, str]]]] = deque()
        self._terminating: dict[str, float] = {}      # namespace -> when its finalizer may be removed
        self.defaulters = dict(admission.DEFAULTERS)   # per resource; the server configures some
        for ns in INITIAL_NAMESPACES:
            self.create("namespaces", {"metadata": {"name": ns}})

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def info(resource: str) -> ResourceInfo:
        try:
            return RESOURCES[resource]
        except KeyError:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {}) from None

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def _key(self, resource: str, namespace: str | None, name: str) -> tuple[str, str]:
        return ((namespace or "default") if RESOURCES[resource].namespaced else "", name)

    def _stored(self, resource: str, namespace: str | None, name: str) -> dict:
        if self._terminating:
            self._finalize_namespaces()
        obj = self._objects[self.info(resource).name].get(self._key(resource, namespace, name))
        if obj is None:
            raise not_found(resource, name)
        return obj

    def cache_version(self, resource: str) -> int:
        """How far `resource`'s watch cache has come: the version of its own last write, or of the last
        progress asked for it (`request_progress`). kube-apiserver's cacher learns other resources'
        writes only from etcd progress notifications, which etcd sends every 10 minutes unless asked:
        a watch BOOKMARK carries this, never the store's global resourceVersion (kinder than the real one)."""
        return self._cache_rv[self.info(resource).name]

    def request_progress(self, resource: str) -> None:
        """A consistent LIST of `resource` (no resourceVersion): the cacher waits until it has caught up
        with etcd's current revision, asking etcd for a progress notification, so its version moves on."""
        self._cache_rv[self.info(resource).name] = self._rv

    def _emit(self, resource: str, kind: str, obj: dict, old: dict | None) -> None:
        event = WatchEvent(self._rv, kind, obj, old)
        self._remember_before(resource, self._key_of_resource(resource, obj), old)
        self._cache_rv[resource] = self._rv
        self._written.append((self._clock(), self._rv))
        self._age_out()
        history, at = self._history[resource], self._history_at[resource]
        history.append(event)
        at.append(self._clock())
        stale = self._clock() - FRESH_SECONDS
        while len(history) > self._history_limit or (history and history[0].rv <= self._aged_rv) or (
                len(history) > FRESH_MIN_EVENTS and at[0] < stale):
            at.popleft()
            self._compacted_rv[resource] = max(self._compacted_rv[resource], history.popleft().rv)
        for sub in self._subscribers[resource]:
            sub.queue.put_nowait(event if sub.raw else (kind, clone(obj)))

    def _commit(self, resource: str, key: tuple[str, str], new: dict, old: dict | None) -> dict:
        """Store `new` under a fresh resourceVersion unless nothing changed (the real no-op update)."""
        if old is not None:
            new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            if new == old:
                return old
        else:
            insort(self._keys[resource], key)
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        self._objects[resource][key] = new
        self._emit(resource, "ADDED" if old is None else "MODIFIED", new, old)
        return new

    # ------------------------------------------------------------------ reads
    def get(self, resource: str, namespace: str | None, name: str) -> dict:
        return clone(self._stored(resource, namespace, name))

    def read(self, resource: str, namespace: str | None, name: str) -> dict:
        """The stored object itself (read-only, never edit it): for serializing without a copy."""
        return self._stored(resource, namespace, name)

    def read_cached(self, resource: str, namespace: str | None, name: str) -> dict:
        """The object as a GET with resourceVersion=0 may see it: served from the watch cache, which can be
        behind the last write. Harsher than kube-apiserver's cache (milliseconds behind, as a rule): an
        object written in the last CACHE_LAG_SECONDS is served as it was before that write (404 if that
        write created it), so clients that read this way are tested against a cache that lags."""
        key = (self.info(resource).name, self._key(resource, namespace, name))
        self._forget_before()
        if key in self._before:
            obj = self._before[key][1]
            if obj is None:
                raise not_found(resource, name)
            return obj
        return self._stored(resource, namespace, name)

    def _remember_before(self, resource: str, key: tuple[str, str], old: dict | None) -> None:
        """`old` as `read_cached` serves it for CACHE_LAG_SECONDS, unless a write in that window already
        left an older one (the cache is then behind both)."""
        self._forget_before()
        if (resource, key) not in self._before:
            now = self._clock()
            self._before[(resource, key)] = (now, old)
            self._before_order.append((now, (resource, key)))

    def _forget_before(self) -> None:
        cutoff = self._clock() - CACHE_LAG_SECONDS
        while self._before_order and self._before_order[0][0] <= cutoff:
            _, key = self._before_order.popleft()
            if key in self._before and self._before[key][0] <= cutoff:
                del self._before[key]

    def peek(self, resource: str) -> Iterable[dict]:
        """All stored objects of `resource`, uncopied: for in-process readers that never mutate them."""
        return self._objects[self.info(resource).name].values()

    def select(self, resource: str, namespace: str | None = None, label_selector: str | None = None,
               field_selector: str | None = None) -> list[dict]:
        """Matching stored objects (read-only), in namespace/name order as etcd lists them."""
        return self.page(resource, namespace, label_selector, field_selector).items

    def page(self, resource: str, namespace: str | None = None, label_selector: str | None = None,
             field_selector: str | None = None, *, after: tuple[str, str] | None = None,
             limit: int | None = None, at: int | None = None) -> Page:
        """Up to `limit` matching stored objects (read-only) with keys after `after`, in key order;
        `at`: as they were at that resourceVersion (a `continue` page reads the first page's snapshot,
        as etcd serves it; 410 Expired once the history that rebuilds it is gone).

        Costs O(log n) to find the start plus the objects scanned, so paging through a
        resource is linear overall (the list verb's `limit`/`continue`).
        """
        info = self.info(resource)
        if self._terminating:
            self._finalize_namespaces()
        try:
            labels = parse_label_selector(label_selector)
            fields = parse_field_selector(field_selector, resource)
        except SelectorError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from None
        if at is not None and at < self._rv:
            keys, objects = self._as_of(info.name, at)
        else:
            keys, objects = self._keys[info.name], self._objects[info.name]
        name = fields.value_for("metadata.name")
        if name is not None:   # one-object lookups (a watch of one node) need no scan
            if info.namespaced and namespace:
                keys = [(namespace, name)]
            elif info.namespaced:
                keys = [k for k in keys if k[1] == name]
            else:
                keys = [("", name)]
            keys = [k for k in keys if k in objects]
            lo, hi = 0, len(keys)
        elif info.namespaced and namespace:
            lo, hi = _namespace_range(keys, namespace)
        else:
            lo, hi = 0, len(keys)
        if after is not None:
            lo = max(lo, bisect_right(keys, tuple(after)))
        items = []
        filtered = not (labels.empty and fields.empty)
        i = lo
        while i < hi:
            obj = objects[keys[i]]
            if not filtered or (labels.matches(obj["metadata"].get("labels")) and fields.matches(obj)):
                if limit is not None and 0 < limit <= len(items):
                    return Page(items, True, hi - i)
                items.append(obj)
            i += 1
        return Page(items, False, 0)

    def _as_of(self, resource: str, at: int) -> tuple[list[tuple[str, str]], dict[tuple[str, str], dict]]:
        """The sorted keys and objects of `resource` at resourceVersion `at`: today's with every later
        change undone, newest first (an ADDED did not exist then; a MODIFIED or DELETED one was its `old`)."""
        if at < self.oldest_watchable(resource):
            raise ApiError(410, "Expired", "The provided continue parameter is too old to display a consistent "
                                           "list result. You can start a new list without the continue parameter.")
        then: dict[tuple[str, str], dict | None] = {}
        for event in reversed(self._history[resource]):
            if event.rv <= at:
                break
            then[self.key_of(event.obj)] = event.old if event.type != "ADDED" else None
        if not then:
            return self._keys[resource], self._objects[resource]
        objects = {**self._objects[resource], **{k: o for k, o in then.items() if o is not None}}
        for key, was in then.items():
            if was is None:
                objects.pop(key, None)
        return sorted(objects), objects

    @staticmethod
    def key_of(obj: dict) -> tuple[str, str]:
        return obj["metadata"].get("namespace", ""), obj["metadata"]["name"]

    def list(self, resource: str, namespace: str | None = None, label_selector: str | None = None,
             field_selector: str | None = None) -> tuple[list[dict], str]:
        items = self.select(resource, namespace, label_selector, field_selector)
        return clone(items), self.resource_version

    # ------------------------------------------------------------------ writes
    def create(self, resource: str, obj: dict, dry_run: bool = False) -> dict:
        """Default, validate (422) and store `obj`; `dry_run` returns what would be stored."""
        info = self.info(resource)
        obj = clone(obj)
        meta = obj.setdefault("metadata", {})
        if info.namespaced:
            namespace = meta.setdefault("namespace", "default")
            if self._terminating:
                self._finalize_namespaces()
            if ("", namespace) not in self._objects["namespaces"]:
                raise not_found("namespaces", namespace)
            if namespace in self._terminating:          # the NamespaceLifecycle admission plugin
                raise ApiError(403, "Forbidden", f'{info.name} "{meta.get("name") or meta.get("generateName", "")}" is '
                               f"forbidden: unable to create new content in namespace {namespace} because it is "
                               "being terminated", {"name": meta.get("name", ""), "kind": info.name, "causes": [{
                                   "reason": "NamespaceTerminating", "field": "metadata.namespace",
                                   "message": f"namespace {namespace} is being terminated"}]})
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(info.kind, "", [("metadata.name", "FieldValueRequired",
                                               "Required value: name or generateName is required")])
            meta["name"] = meta["generateName"] + _random_suffix()
        bad_name = validation.name_causes(info, meta["name"])
        key = self._key(resource, meta.get("namespace"), meta["name"])
        if not bad_name and key in self._objects[resource]:
            raise ApiError(409, "AlreadyExists", f'{info.name} "{meta["name"]}" already exists',
                           {"name": meta["name"], "kind": info.name})
        obj["kind"], obj["apiVersion"] = info.kind, info.api_version
        if resource in self.defaulters:
            try:
                self.defaulters[resource](obj)
            except ApiError as refused:      # the defaulter's own checks (containers) join the name's
                causes = [(c["field"], c["reason"], c["message"]) for c in (refused.details or {}).get("causes", [])]
                if refused.code != 422 or not bad_name:
                    raise
                raise invalid(info.kind, meta["name"], [*bad_name, *causes]) from None
        for transient in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(transient, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        validation.validate(info, obj, first=bad_name)
        if dry_run:
            return clone(obj)
        return clone(self._commit(resource, key, obj, None))

    def _update(self, resource: str, current: dict, new: dict, subresource: str | None,
                dry_run: bool = False) -> dict:
        info = RESOURCES[resource]
        meta, old_meta = new.setdefault("metadata", {}), current["metadata"]
        name = old_meta["name"]
        if meta.get("name", name) != name:
            raise ApiError(400, "BadRequest",
                           f"the name of the object ({meta['name']}) does not match the name on the URL ({name})")
        if meta.get("namespace") not in (None, "", old_meta.get("namespace")) and info.namespaced:
            raise ApiError(400, "BadRequest",
                           "the namespace of the provided object does not match the namespace sent on the request")
        if meta.get("resourceVersion") not in (None, "", old_meta["resourceVersion"]):
            raise conflict(resource, name)
        if subresource == "status":
            result = clone(current)
            result["status"] = clone(new.get("status") or {})
        elif subresource:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        else:
            result = clone(new)
            rmeta = result["metadata"]
            for fixed in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                          "deletionGracePeriodSeconds", "generation"):
                if fixed in old_meta:
                    rmeta[fixed] = old_meta[fixed]
                else:
                    rmeta.pop(fixed, None)
            result["kind"], result["apiVersion"] = info.kind, info.api_version
            if "status" in info.subresources:
                result["status"] = clone(current.get("status", {}))
            if resource == "pods":
                admission.check_pod_update(current, result)
            if result.get("spec") != current.get("spec"):
                rmeta["generation"] = old_meta.get("generation", 1) + 1
        validation.validate(info, result, current)
        if dry_run:
            return clone(result)
        return clone(self._commit(resource, self._key_of_resource(resource, current), result, current))

    def _key_of_resource(self, resource: str, obj: dict) -> tuple[str, str]:
        return self._key(resource, obj["metadata"].get("namespace"), obj["metadata"]["name"])

    def replace(self, resource: str, namespace: str | None, name: str, obj: dict,
                subresource: str | None = None, dry_run: bool = False) -> dict:
        """PUT: 409 Conflict when the body's resourceVersion is set and stale."""
        return self._update(resource, self._stored(resource, namespace, name), obj, subresource, dry_run)

    def patch(self, resource: str, namespace: str | None, name: str, body, content_type: str,
              subresource: str | None = None, dry_run: bool = False) -> dict:
        """Apply the patch; a result that does not decode as the kind is 422 (the real `patch` field error)."""
        current = self._stored(resource, namespace, name)
        try:
            patched = apply_patch(clone(current), body, content_type)
        except PatchError as exc:
            reasons = {400: "BadRequest", 415: "UnsupportedMediaType", 422: "Invalid"}
            raise ApiError(exc.code, reasons.get(exc.code, "Invalid"), str(exc)) from None
        if not isinstance(patched, dict):
            raise ApiError(400, "BadRequest", "patch must produce an object")
        errors = validation.decode_errors(RESOURCES[resource], patched)
        if errors:
            raise validation.undecodable_patch(patched, errors)
        return self._update(resource, current, patched, subresource, dry_run)

    def mutate(self, resource: str, namespace: str | None, name: str, fn: Callable[[dict], None]) -> dict:
        """For in-process controllers: `fn` edits a copy; the store versions it and emits MODIFIED."""
        current = self._stored(resource, namespace, name)
        new = clone(current)
        fn(new)
        new["metadata"]["name"] = current["metadata"]["name"]
        if "namespace" in current["metadata"]:
            new["metadata"]["namespace"] = current["metadata"]["namespace"]
        return clone(self._commit(resource, self._key_of_resource(resource, current), new, current))

    def delete(self, resource: str, namespace: str | None, name: str, grace_period_seconds: int | None = None,
               preconditions: dict | None = None, dry_run: bool = False) -> dict:
        """Graceful for bound, running pods (the kubelet finishes with `remove`); immediate otherwise."""
        current = self._stored(resource, namespace, name)
        meta = current["metadata"]
        preconditions = preconditions or {}
        for field_name in ("uid", "resourceVersion"):
            expected = preconditions.get(field_name)
            if expected and expected != meta.get(field_name):
                raise conflict(resource, name, f"Precondition failed: {field_name.upper() if field_name == 'uid' else 'ResourceVersion'} "
                                               f"in precondition: {expected}, {field_name} in object meta: {meta.get(field_name)}")
        if dry_run:
            return clone(current)
        if resource == "namespaces":
            return self._terminate_namespace(current)
        if resource == "pods" and current["spec"].get("nodeName") and not _is_terminal(current):
            grace = grace_period_seconds
            if grace is None:
                grace = current["spec"].get("terminationGracePeriodSeconds", 30)
            if grace != 0:
                existing = meta.get("deletionGracePeriodSeconds")
                if existing is not None and existing <= grace:
                    return clone(current)

                def mark(pod: dict) -> None:
                    pod["metadata"]["deletionTimestamp"] = now_rfc3339(grace)
                    pod["metadata"]["deletionGracePeriodSeconds"] = grace
                return self.mutate(resource, namespace, name, mark)
        return self._remove(resource, current)

    def _terminate_namespace(self, current: dict) -> dict:
        """A deleted namespace turns Terminating (new content refused with 403), its content is deleted
        (bound pods gracefully, through their kubelet), and the namespace itself goes once that content is
        gone and NAMESPACE_FINALIZE_SECONDS have passed, as the namespace controller does it."""
        name = current["metadata"]["name"]
        if name in self._terminating:
            return clone(current)
        self._terminating[name] = self._clock() + NAMESPACE_FINALIZE_SECONDS

        def terminating(ns: dict) -> None:
            ns["metadata"]["deletionTimestamp"] = now_rfc3339()
            ns["metadata"]["deletionGracePeriodSeconds"] = 0
            ns.setdefault("spec", {})["finalizers"] = ["kubernetes"]
            ns.setdefault("status", {})["phase"] = "Terminating"
        marked = self.mutate("namespaces", None, name, terminating)
        for resource, info in RESOURCES.items():
            if info.namespaced:
                for obj in list(self._namespace_content(resource, name)):
                    with contextlib.suppress(ApiError):
                        self.delete(resource, name, obj["metadata"]["name"])
        return marked

    def _namespace_content(self, resource: str, namespace: str) -> list[dict]:
        """What page() would list, read without finalizing (page() finalizes, which calls this)."""
        keys = self._keys[resource]
        lo, hi = _namespace_range(keys, namespace)
        return [self._objects[resource][k] for k in keys[lo:hi]]

    def _finalize_namespaces(self) -> None:
        """Remove the Terminating namespaces that are due and empty (checked lazily, on reads and writes)."""
        now = self._clock()
        for name, due in list(self._terminating.items()):
            if now < due or any(self._namespace_content(r, name) for r, i in RESOURCES.items() if i.namespaced):
                continue
            del self._terminating[name]
            current = self._objects["namespaces"].get(("", name))
            if current is not None:
                self._remove("namespaces", current)

    def bind(self, namespace: str, name: str, node_name: str) -> dict:
        """Assign a pending pod to a node (the pods/binding subresource): 409 when already bound."""
        pod = self._stored("pods", namespace, name)
        bound_to = pod["spec"].get("nodeName")
        if bound_to:
            raise conflict("pods/binding", name, f'pod {name} is already assigned to node "{bound_to}"')
        if pod["metadata"].get("deletionTimestamp"):
            raise conflict("pods/binding", name, f"pod {name} is being deleted, cannot be assigned to a host")

        def assign(p: dict) -> None:
            p["spec"]["nodeName"] = node_name
            conditions = [c for c in p.setdefault("status", {}).get("conditions") or [] if c.get("type") != "PodScheduled"]
            p["status"]["conditions"] = [{"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now_rfc3339()}, *conditions]
        return self.mutate("pods", namespace, name, assign)

    def remove(self, resource: str, namespace: str | None, name: str) -> None:
        """Final removal (the kubelet, once a deleted pod's processes are gone)."""
        self._remove(resource, self._stored(resource, namespace, name))

    def _remove(self, resource: str, current: dict) -> dict:
        if resource == "namespaces":
            ns = current["metadata"]["name"]
            for other, info in RESOURCES.items():
                if info.namespaced:
                    for obj in self.select(other, ns):
                        self._remove(other, obj)
        key = self._key_of_resource(resource, current)
        del self._objects[resource][key]
        keys = self._keys[resource]
        del keys[bisect_left(keys, key)]
        self._rv += 1
        gone = {**current, "metadata": {**current["metadata"], "resourceVersion": str(self._rv)}}
        self._emit(resource, "DELETED", gone, current)
        return clone(gone)

    # ------------------------------------------------------------------ watching
    def _age_out(self) -> int:
        """Compact every version older than `history_seconds`: the newest of them is the oldest
        resourceVersion a watch may still start from (it asks for the changes after it)."""
        cutoff = self._clock() - self._history_seconds
        while self._written and self._written[0][0] < cutoff:
            self._aged_rv = self._written.popleft()[1]
        return self._aged_rv

    def oldest_watchable(self, resource: str) -> int:
        """The oldest resourceVersion a watch of `resource` can resume from (older: 410 Gone)."""
        return max(self._compacted_rv[self.info(resource).name], self._age_out())

    def compact(self) -> int:
        """Forget every change so far (a watch from an older resourceVersion is 410 Gone) and end
        the API's open watch streams (a None on their queues), as an API server restart does."""
        for resource in RESOURCES:
            self._history[resource].clear()
            self._history_at[resource].clear()
            self._compacted_rv[resource] = self._rv
            for sub in self._subscribers[resource]:
                if sub.raw:
                    sub.queue.put_nowait(None)
        return self._rv

    def subscribe(self, resource: str) -> asyncio.Queue:
        """In-process watchers get every (type, object copy) of `resource` from now on."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers[self.info(resource).name].append(_Subscriber(queue, raw=False))
        return queue

    def unsubscribe(self, resource: str, queue: asyncio.Queue) -> None:
        self._subscribers[resource] = [s for s in self._subscribers[resource] if s.queue is not queue]

    def open_watches(self) -> dict[str, int]:
        """Watch streams the API serves now, per resource (clients' watches, not in-process ones)."""
        return {resource: n for resource, subs in self._subscribers.items() if (n := sum(s.raw for s in subs))}

    def watch(self, resource: str, since: int | None) -> tuple[list[WatchEvent], asyncio.Queue]:
        """Raw (read-only) events after resourceVersion `since` already kept, plus a queue for later ones.

        `since=None` starts from now. A `since` older than the kept history is 410 Gone (reason
        Expired); one newer than any written is 504 (reason Timeout), as the watch cache answers.
        """
        info = self.info(resource)
        backlog: list[WatchEvent] = []
        if since is not None:
            if since > self._rv:
                raise too_large_resource_version(since, self._rv)
            compacted = self.oldest_watchable(info.name)
            if since < compacted:
                raise ApiError(410, "Expired", f"too old resource version: {since} ({compacted})")
            history = self._history[info.name]
            backlog = [e for e in history if e.rv > since] if history and history[-1].rv > since else []
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers[info.name].append(_Subscriber(queue, raw=True))
        return backlog, queue

    # ------------------------------------------------------------------ events
    def record_event(self, involved: dict, reason: str, message: str, type: str = "Normal",
                     component: str = "simcloud") -> dict:
        """Create (or bump the count of an identical) core/v1 Event about `involved`."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        key = (namespace, meta.get("uid"), reason, message, type, component)
        now = now_rfc3339()
        known = self._event_keys.get(key)
        if known and ("events" in self._objects) and known in self._objects["events"]:
            def bump(event: dict) -> None:
                event["count"] = event.get("count", 1) + 1
                event["lastTimestamp"] = now
            return self.mutate("events", *known, bump)
        ref = {"kind": involved.get("kind"), "name": meta.get("name"), "uid": meta.get("uid"),
               "apiVersion": involved.get("apiVersion"), "resourceVersion": meta.get("resourceVersion")}
        if meta.get("namespace"):
            ref["namespace"] = meta["namespace"]
        event = {
            "metadata": {"name": f"{meta.get('name', 'unknown')}.{time.time_ns():x}", "namespace": namespace},
            "involvedObject": {k: v for k, v in ref.items() if v is not None},
            "reason": reason, "message": message, "type": type,
            "source": {"component": component},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "reportingComponent": component, "reportingInstance": "",
        }
        created = self.create("events", event)
        self._event_keys[key] = (namespace, created["metadata"]["name"])
        return created

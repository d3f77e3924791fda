"""The Kubernetes REST API of the local cloud, over the shared `Store`.

Speaks the wire protocol real clients expect: every request authenticated and authorized
first (simcloud.kube.auth: 401/403), discovery (incl. OpenAPI v3 paths), CRUD with meta/v1
Status errors, field validation (unknown fields: Warn by default, Strict refuses), the
typed decode and field rules of simcloud.kube.validation (400/422), `dryRun=All`, list paging,
chunked watch streams, pod logs, binding, TokenRequest, access reviews, and server-side
Tables for kubectl. `make_k8s_app(store, log_source, faults, auth)` returns the aiohttp app.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec
from aiohttp import web

from simcloud.config import Faults
from simcloud.kube import openapi, protobuf, validation
from simcloud.kube.auth import Auth, request_attributes, token_request
from simcloud.kube.errors import ApiError
from simcloud.kube.resources import KUBERNETES_VERSION, RESOURCES, ResourceInfo
from simcloud.kube.selectors import SelectorError, parse_field_selector, parse_label_selector
from simcloud.kube.store import Store, WatchEvent, conflict, not_found, now_rfc3339
from simcloud.kube.tables import make_table

log = logging.getLogger("simcloud.k8s")

SERVER_VERSION = {"major": "1", "minor": KUBERNETES_VERSION.split(".")[1], "gitVersion": KUBERNETES_VERSION,
                  "gitCommit": "simcloud", "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z",
                  "goVersion": "go1.26.0",
                  "compiler": "gc", "platform": "linux/amd64"}
DEFAULT_WATCH_TIMEOUT = 1800.0        # the real server picks 30-60 minutes
BOOKMARK_EVERY = 60.0                 # the watch cache's bookmarkFrequency (when bookmarks are allowed)
BOOKMARK_BEFORE_DEADLINE = 2.0        # ... and one this long before the watch's timeoutSeconds ends
FUTURE_RV_WAIT = 3.0                  # the watch cache waits this long for a resourceVersion it has not seen
LOG_FIRST_CHUNK_WAIT = 0.25           # how long a log stream may take to fail before we commit to 200
_WRITE_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
_SUBRESOURCE_VERBS = {"status": ("{kind}", ["get", "patch", "update"]), "log": ("Pod", ["get"]),
                      "binding": ("Binding", ["create"]), "token": ("TokenRequest", ["create"])}
_SUBRESOURCE_GROUPS = {"token": {"group": "authentication.k8s.io", "version": "v1"}}
_CREATE_ONLY = {"selfsubjectaccessreviews", "selfsubjectrulesreviews"}     # reviews: answered, never stored
_RBAC_WRITES = {"roles", "clusterroles", "rolebindings", "clusterrolebindings"}
TOKEN_SECONDS = 3600
USER = web.RequestKey("user", object)     # the authenticated (or impersonated) simcloud.kube.auth.User


class LogSource(Protocol):
    def stream(self, namespace: str, pod: dict, container: str | None, *, follow: bool, timestamps: bool,
               since_seconds: int | None, since_time: str | None, tail_lines: int | None,
               limit_bytes: int | None) -> AsyncIterator[bytes]: ...


def _dumps(obj, pretty: bool = False) -> bytes:
    """Compact JSON; msgspec encodes a large pod list several times faster than the json module."""
    if pretty:
        return json.dumps(obj, indent=2).encode()
    return msgspec.json.encode(obj)


def _json(obj, status: int = 200, pretty: bool = False) -> web.Response:
    return web.Response(body=_dumps(obj, pretty), status=status, content_type="application/json")


def _error(err: ApiError) -> web.Response:
    return _json(err.status(), err.code)


def _bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def _method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource",
                    {})


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


def _int_param(query, name: str) -> int | None:
    raw = query.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise _bad_request(f"{name}: Invalid value: \"{raw}\": must be an integer") from None


def _table_version(accept: str) -> str | None:
    """The meta.k8s.io Table version kubectl asks for in Accept (first acceptable), or None."""
    for media in accept.split(","):
        params = dict(p.strip().split("=", 1) for p in media.split(";")[1:] if "=" in p)
        if params.get("as") == "Table" and params.get("g", "meta.k8s.io") == "meta.k8s.io":
            return f"meta.k8s.io/{params.get('v', 'v1')}"
    return None


# --------------------------------------------------------------------------- discovery
def _resource_list(group_version: str) -> dict:
    resources = []
    for info in RESOURCES.values():
        if info.api_version != group_version:
            continue
        entry = {"name": info.name, "singularName": info.singular, "namespaced": info.namespaced,
                 "kind": info.kind, "verbs": ["create"] if info.name in _CREATE_ONLY else _WRITE_VERBS}
        if info.short_names:
            entry["shortNames"] = list(info.short_names)
        if info.name == "pods":
            entry["categories"] = ["all"]
        resources.append(entry)
        for sub in info.subresources:
            kind, verbs = _SUBRESOURCE_VERBS[sub]
            resources.append({"name": f"{info.name}/{sub}", "singularName": "", "namespaced": info.namespaced,
                              **_SUBRESOURCE_GROUPS.get(sub, {}), "kind": kind.format(kind=info.kind),
                              "verbs": verbs})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}


def _groups() -> list[dict]:
    names = sorted({info.group for info in RESOURCES.values() if info.group})
    return [{"name": g, "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
             "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"}} for g in names]


# --------------------------------------------------------------------------- paths
class Target:
    """What a resource path names: /api/v1[/watch][/namespaces/NS]/RESOURCE[/NAME[/SUB]]."""

    def __init__(self, group_version: str, tail: str):
        parts = [p for p in tail.split("/") if p]
        self.watch_path = bool(parts) and parts[0] == "watch"
        if self.watch_path:
            parts = parts[1:]
        self.namespace: str | None = None
        if len(parts) >= 3 and parts[0] == "namespaces" and parts[2] in RESOURCES \
                and RESOURCES[parts[2]].namespaced:
            self.namespace, parts = parts[1], parts[2:]
        if not parts or len(parts) > 3 or parts[0] not in RESOURCES \
                or RESOURCES[parts[0]].api_version != group_version:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        self.info: ResourceInfo = RESOURCES[parts[0]]
        self.resource = self.info.name
        self.name = parts[1] if len(parts) > 1 else None
        self.sub = parts[2] if len(parts) > 2 else None
        if self.sub and self.sub not in self.info.subresources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        if self.info.namespaced and self.namespace is None and self.name is not None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})


# --------------------------------------------------------------------------- continue tokens
def _encode_continue(rv: str, key: tuple[str, str]) -> str:
    """The list's resourceVersion and the last key sent: the next page starts right after it."""
    return base64.urlsafe_b64encode(json.dumps({"rv": rv, "start": list(key)}).encode()).decode()


def _decode_continue(token: str) -> tuple[str, tuple[str, str]]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        rv, start = data["rv"], data["start"]
        if not (isinstance(rv, str) and rv.isdigit() and isinstance(start, list) and len(start) == 2
                and all(isinstance(part, str) for part in start)):
            raise ValueError("malformed")
        return rv, (start[0], start[1])
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise _bad_request(f"continue key is not valid: {token!r}; start the list again without "
                           "`continue`") from None


class K8sApi:
    def __init__(self, store: Store, log_source: LogSource, faults: Faults, auth: Auth,
                 bookmark_seconds: float | None = None):
        self.store, self.log_source, self.faults, self.auth = store, log_source, faults, auth
        self.bookmark_seconds = bookmark_seconds     # None: BOOKMARK_EVERY

    # -------------------------------------------------------------- dispatch
    async def resource(self, request: web.Request) -> web.StreamResponse:
        group = request.match_info.get("group")
        group_version = f"{group}/{request.match_info['version']}" if group else request.match_info["version"]
        target = Target(group_version, request.match_info["tail"])
        method = request.method
        if target.resource in _CREATE_ONLY:
            if method != "POST" or target.name is not None:
                raise _method_not_allowed()
            review = await self._review(request)
            if target.resource == "selfsubjectrulesreviews":
                return _json(self.auth.rules_review(request[USER], review), 201)
            return _json(self.auth.access_review(request[USER], review), 201)
        dry_run = validation.dry_run(request.query)
        if method == "GET":
            if target.sub == "log":
                return await self.pod_log(request, target)
            if target.watch_path or _truthy(request.query.get("watch")):
                return await self.watch(request, target)
            if target.name is None:
                return self.list(request, target)
            return self.respond(request, target, self.get(request, target))
        if method == "POST":
            if target.sub == "binding":
                return await self.bind(request, target)
            if target.sub == "token":
                return await self.create_token(request, target)
            if target.name is not None or target.sub:
                raise _method_not_allowed()
            return await self.create(request, target, dry_run)
        if method in ("PUT", "PATCH"):
            if target.name is None or target.sub not in (None, "status"):
                raise _method_not_allowed()
            if target.resource == "configmaps" and self.faults.k8s_conflict_burst > 0:
                self.faults.k8s_conflict_burst -= 1
                raise conflict(target.resource, target.name)
            body, content_type = await request.read(), request.headers.get("Content-Type", "")
            if method == "PATCH":
                patch = self._patch_object(body, content_type)
                warnings = self._check_fields(request, target, patch)
                if patch is not None:   # the patch without the dropped fields
                    body = _dumps(patch)
                if target.resource in _RBAC_WRITES:    # judge the patched object, then apply for real
                    self.auth.check_rbac_write(request[USER], target.resource, target.namespace, self.store.patch(
                        target.resource, target.namespace, target.name, body, content_type, target.sub, dry_run=True))
                obj = self.store.patch(target.resource, target.namespace, target.name, body, content_type,
                                       target.sub, dry_run=dry_run)
            else:
                new = self._decode(body, content_type)
                warnings = self._check_fields(request, target, new)
                self._check_types(target, new)
                self.auth.check_rbac_write(request[USER], target.resource, target.namespace, new)
                obj = self.store.replace(target.resource, target.namespace, target.name, new, target.sub,
                                         dry_run=dry_run)
            return self.respond(request, target, obj, warnings=warnings)
        if method == "DELETE":
            if target.sub:
                raise _method_not_allowed()
            return await self.delete(request, target, dry_run)
        raise _method_not_allowed()

    async def _review(self, request: web.Request) -> dict:
        """A review body: JSON, or the protobuf `kubectl auth can-i` always sends."""
        body, content_type = await request.read(), request.headers.get("Content-Type", "")
        if content_type.split(";")[0].strip() == "application/vnd.kubernetes.protobuf":
            try:
                return protobuf.review(body)
            except (protobuf.ProtobufError, UnicodeDecodeError) as exc:
                raise _bad_request(f"the body of the request could not be decoded: {exc}") from None
        return self._decode(body, content_type)

    @staticmethod
    def _check_types(target: Target, obj: dict) -> None:
        """The typed decode of a create/update body: a field of the wrong JSON type is 400."""
        errors = validation.decode_errors(target.info, obj)
        if errors:
            raise validation.undecodable_body(target.info, errors)

    @staticmethod
    def _decode(body: bytes, content_type: str = "application/json") -> dict:
        """A JSON request body. Protobuf/CBOR bodies (kubectl 1.32's typed `create` generators) are 415."""
        media = content_type.split(";", maxsplit=1)[0].strip().lower()
        if body and media not in ("", "application/json", "*/*"):
            raise ApiError(415, "UnsupportedMediaType",
                           f'the body of the request was in an unknown format - accepted media types include: '
                           f'application/json (simcloud does not speak "{media}")', {})
        try:
            obj = json.loads(body or b"{}")
        except ValueError as exc:
            raise _bad_request(f"the body of the request could not be decoded: {exc}") from None
        if not isinstance(obj, dict):
            raise _bad_request("the body of the request must be a JSON object")
        return obj

    @staticmethod
    def _patch_object(body: bytes, content_type: str) -> dict | None:
        """The object a merge or strategic merge patch spells out (None for JSON patches and bad bodies)."""
        if "merge-patch" not in content_type:
            return None
        try:
            obj = json.loads(body or b"{}")
        except ValueError:
            return None      # the store answers the decode error
        return obj if isinstance(obj, dict) else None

    @staticmethod
    def _check_fields(request: web.Request, target: Target, obj: dict | None) -> list[str]:
        """Server-side field validation: unknown fields are dropped with a warning (Warn, the default,
        and Ignore, silently) or refused with a 400 (Strict)."""
        mode = request.query.get("fieldValidation") or "Warn"
        if mode not in openapi.FIELD_VALIDATION:
            raise _bad_request(f'fieldValidation: Invalid value: "{mode}": must be one of '
                               f'{", ".join(openapi.FIELD_VALIDATION)}')
        if obj is None or target.sub:
            return []
        problems = [f'unknown field "{path}"' for path in openapi.drop_unknown_fields(target.info, obj)]
        if mode == "Ignore":
            return []
        if problems and mode == "Strict":
            kind = f'{target.info.kind} in version "{target.info.version}"'
            raise _bad_request(f"{kind} cannot be handled as a {target.info.kind}: strict decoding error: "
                               + ", ".join(problems))
        return problems

    def respond(self, request: web.Request, target: Target, obj: dict, status: int = 200,
                warnings: list[str] = ()) -> web.Response:
        table = _table_version(request.headers.get("Accept", ""))
        if table:
            obj = make_table(target.resource, [obj], obj["metadata"].get("resourceVersion", ""),
                             api_version=table, include_object=request.query.get("includeObject", "Metadata"))
        response = _json(obj, status, _truthy(request.query.get("pretty")))
        for warning in warnings:    # RFC 7234 warn-code 299, as the apiserver sends them (kubectl prints them)
            response.headers.add("Warning", '299 - ' + json.dumps(warning))
        return response

    # -------------------------------------------------------------- verbs
    def get(self, request: web.Request, target: Target) -> dict:
        """One object; with resourceVersion=0 ("any version") from the watch cache, which may be behind
        (`Store.read_cached`). Other versions are served the latest, which is never older than asked."""
        read = self.store.read_cached if _int_param(request.query, "resourceVersion") == 0 else self.store.read
        return read(target.resource, target.namespace, target.name)

    def list(self, request: web.Request, target: Target) -> web.Response:
        query = request.query
        rv, after = self.store.resource_version, None
        token = query.get("continue")
        if token:   # later pages report the first page's resourceVersion, like the real server's snapshot
            rv, after = _decode_continue(token)
        elif not query.get("resourceVersion"):      # a consistent read brings the watch cache up to now
            self.store.request_progress(target.resource)
        page = self.store.page(target.resource, target.namespace, query.get("labelSelector"),
                               query.get("fieldSelector"), after=after, limit=_int_param(query, "limit"),
                               at=int(rv) if token else None)
        items, remaining = page.items, page.remaining
        next_token = _encode_continue(rv, self.store.key_of(items[-1])) if page.more else None
        table = _table_version(request.headers.get("Accept", ""))
        if table:
            body = make_table(target.resource, items, rv, api_version=table,
                              include_object=query.get("includeObject", "Metadata"), continue_token=next_token)
        else:
            meta: dict = {"resourceVersion": rv}
            if next_token:
                meta["continue"] = next_token
                if not query.get("labelSelector") and not query.get("fieldSelector"):
                    meta["remainingItemCount"] = remaining
            body = {"kind": f"{target.info.kind}List", "apiVersion": target.info.api_version,
                    "metadata": meta, "items": items}
        return _json(body, pretty=_truthy(query.get("pretty")))

    async def create(self, request: web.Request, target: Target, dry_run: bool = False) -> web.Response:
        obj = self._decode(await request.read(), request.headers.get("Content-Type", ""))
        meta = obj.setdefault("metadata", {})
        if target.info.namespaced:
            if target.namespace is None:
                raise _method_not_allowed()
            if meta.get("namespace") not in (None, "", target.namespace):
                raise _bad_request("the namespace of the provided object does not match the namespace sent on "
                                   "the request")
            meta["namespace"] = target.namespace
        warnings = self._check_fields(request, target, obj)
        self._check_types(target, obj)
        self.auth.check_rbac_write(request[USER], target.resource, target.namespace, obj)
        if target.resource == "pods":
            obj["status"] = {}          # the server owns pod status
        created = self.store.create(target.resource, obj, dry_run=dry_run)
        return self.respond(request, target, created, 201, warnings)

    async def create_token(self, request: web.Request, target: Target) -> web.Response:
        """TokenRequest (`kubectl create token SA`): a bearer token for an existing ServiceAccount."""
        spec = self._decode(await request.read()).get("spec")
        audiences = spec.get("audiences") if isinstance(spec, dict) else None
        token = self.auth.issue_token(target.namespace or "default", target.name, audiences)
        return _json(token_request(token, spec if isinstance(spec, dict) else None, now_rfc3339(TOKEN_SECONDS)), 201)

    async def delete(self, request: web.Request, target: Target, dry_run: bool = False) -> web.Response:
        options = self._decode(await request.read()) if request.can_read_body else {}
        grace = options.get("gracePeriodSeconds")
        if grace is None:
            grace = _int_param(request.query, "gracePeriodSeconds")
        if target.name is None:   # deletecollection
            items = [dict(o) for o in self.store.select(target.resource, target.namespace,
                                                         request.query.get("labelSelector"),
                                                         request.query.get("fieldSelector"))]
            deleted = [self.store.delete(target.resource, o["metadata"].get("namespace"), o["metadata"]["name"],
                                         grace, dry_run=dry_run) for o in items]
            return _json({"kind": f"{target.info.kind}List", "apiVersion": target.info.api_version,
                          "metadata": {"resourceVersion": self.store.resource_version}, "items": deleted})
        obj = self.store.delete(target.resource, target.namespace, target.name, grace, options.get("preconditions"),
                                dry_run)
        return self.respond(request, target, obj)

    async def bind(self, request: web.Request, target: Target) -> web.Response:
        binding = self._decode(await request.read())
        node = (binding.get("target") or {}).get("name")
        if not node:
            raise ApiError(422, "Invalid", f'Binding "{target.name}" is invalid: target.name: Required value', {
                "name": target.name, "kind": "Binding",
                "causes": [{"reason": "FieldValueRequired", "message": "Required value", "field": "target.name"}]})
        self.store.bind(target.namespace, target.name, node)
        return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)

    # -------------------------------------------------------------- pod log
    async def pod_log(self, request: web.Request, target: Target) -> web.StreamResponse:
        if target.resource != "pods":
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        pod = self.store.get("pods", target.namespace, target.name)
        q = request.query
        chunks = self.log_source.stream(
            target.namespace or "default", pod, q.get("container") or None, follow=_truthy(q.get("follow")),
            timestamps=_truthy(q.get("timestamps")), since_seconds=_int_param(q, "sinceSeconds"),
            since_time=q.get("sinceTime") or None, tail_lines=_int_param(q, "tailLines"),
            limit_bytes=_int_param(q, "limitBytes")).__aiter__()
        # Errors (container not started, ambiguous container) come first: answer them as a Status,
        # but do not hold the headers back while a quiet, followed container prints nothing yet.
        first = asyncio.ensure_future(chunks.__anext__())
        done, _ = await asyncio.wait({first}, timeout=LOG_FIRST_CHUNK_WAIT)
        if done:
            try:
                pending_chunk = first.result()
            except StopAsyncIteration:
                return web.Response(body=b"", content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "text/plain", "Cache-Control": "no-cache"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        cut = self.faults.log_stream_cut_seconds if _truthy(q.get("follow")) else 0.0
        try:
            with contextlib.suppress(TimeoutError):   # the fault: the stream ends while the container runs
                async with asyncio.timeout(cut if cut > 0 else None):
                    if not done:
                        try:
                            pending_chunk = await first
                        except StopAsyncIteration:
                            await response.write_eof()
                            return response
                    await response.write(pending_chunk)
                    async for chunk in chunks:
                        await response.write(chunk)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        except ApiError as err:   # failed after we committed to 200: end the stream with the reason
            await response.write(f"{err.message}\n".encode())
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose:
                await aclose()
        return response

    # -------------------------------------------------------------- watch
    async def watch(self, request: web.Request, target: Target) -> web.StreamResponse:
        q = request.query
        field_selector = q.get("fieldSelector") or ""
        if target.name:
            field_selector = ",".join(filter(None, [field_selector, f"metadata.name={target.name}"]))
        try:
            labels = parse_label_selector(q.get("labelSelector"))
            fields = parse_field_selector(field_selector, target.resource)
        except SelectorError as exc:
            raise _bad_request(str(exc)) from None
        timeout = _int_param(q, "timeoutSeconds")
        deadline = time.monotonic() + (timeout if timeout and timeout > 0 else DEFAULT_WATCH_TIMEOUT)
        bookmarks = _truthy(q.get("allowWatchBookmarks"))
        table = _table_version(request.headers.get("Accept", ""))
        include_object = q.get("includeObject", "Metadata")
        rv_param = q.get("resourceVersion") or ""
        since = None
        if rv_param not in ("", "0"):
            try:
                since = int(rv_param)
            except ValueError:
                raise _bad_request(f'resourceVersion: Invalid value: "{rv_param}": must be an integer') from None

        def matches(obj: dict | None) -> bool:
            if obj is None:
                return False
            if target.namespace and obj["metadata"].get("namespace") != target.namespace:
                return False
            return labels.matches(obj["metadata"].get("labels")) and fields.matches(obj)

        initial: list[WatchEvent] = []
        queue = None
        start = since or 0        # a BOOKMARK goes only past the version the watch started from
        if since is not None:
            await self._wait_for_version(since)
        try:
            if since is None:
                rv_now = start = int(self.store.resource_version)
                initial = [WatchEvent(rv_now, "ADDED", o, None)
                           for o in self.store.select(target.resource, target.namespace, q.get("labelSelector"),
                                                      field_selector)]
            backlog, queue = self.store.watch(target.resource, since)
            gone = None
        except ApiError as err:    # after a parsed resourceVersion, the real server answers in the stream
            if err.code not in (410, 504):
                raise
            backlog, gone = [], err

        response = web.StreamResponse(headers={"Content-Type": "application/json",
                                               "Transfer-Encoding": "chunked"})
        await response.prepare(request)
        sent_columns = False

        async def send(kind: str, obj: dict) -> None:
            nonlocal sent_columns
            if table and kind in ("ADDED", "MODIFIED", "DELETED"):
                obj = make_table(target.resource, [obj], obj["metadata"].get("resourceVersion", ""),
                                 api_version=table, include_object=include_object, with_columns=not sent_columns)
                sent_columns = True
            await response.write(_dumps({"type": kind, "object": obj}) + b"\n")

        try:
            if gone is not None:
                await send("ERROR", gone.status())
                return response
            for event in initial + backlog:
                await self._send_event(send, event, matches)
            every = self.bookmark_seconds or BOOKMARK_EVERY
            next_bookmark = self._next_bookmark(time.monotonic(), every, deadline, timeout)
            while True:
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0 or request.transport is None or request.transport.is_closing():
                    break
                if bookmarks and now >= next_bookmark and queue.empty():
                    # The cacher's rule (cacheWatcher.process): a bookmark at the watch cache's version,
                    # sent only when that is past the version the watch started from; and here only once
                    # every event up to it has been sent (the queue drained).
                    cached = self.store.cache_version(target.resource)
                    if cached > start:
                        await send("BOOKMARK", {"kind": target.info.kind, "apiVersion": target.info.api_version,
                                                "metadata": {"resourceVersion": str(cached)}})
                    next_bookmark = self._next_bookmark(now, every, deadline, timeout)
                    continue
                wait = min(remaining, 1.0, max(next_bookmark - now, 0.0) if bookmarks else 1.0)
                try:
                    event = queue.get_nowait() if not queue.empty() else await asyncio.wait_for(queue.get(), wait)
                except TimeoutError:
                    continue
                if event is None:     # the store was compacted: end the stream like a restarting server
                    break
                await self._send_event(send, event, matches)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            if queue is not None:
                self.store.unsubscribe(target.resource, queue)
        return response

    async def _wait_for_version(self, since: int) -> None:
        """Give a resourceVersion from the future FUTURE_RV_WAIT seconds to be written, as the watch
        cache does before answering 504 "Too large resource version"."""
        deadline = time.monotonic() + FUTURE_RV_WAIT
        while since > int(self.store.resource_version) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    @staticmethod
    def _next_bookmark(now: float, every: float, deadline: float, timeout: int | None) -> float:
        """The cacher's nextBookmarkTime: every `every` seconds, or just before the client's own
        timeoutSeconds runs out (so it can resume from the bookmark's resourceVersion), if sooner."""
        due, last_call = now + every, deadline - BOOKMARK_BEFORE_DEADLINE
        return min(due, last_call) if timeout and timeout > 0 and last_call > now else due

    @staticmethod
    async def _send_event(send, event: WatchEvent, matches) -> bool:
        """Send `event` as the watcher sees it through its selectors (moving out of a selector is DELETED,
        carrying the object as it was when it last matched, as the watch cache does)."""
        now_matches, was_matching = matches(event.obj), matches(event.old)
        if event.type == "DELETED":
            kind = "DELETED" if was_matching or now_matches else None
        elif event.type == "ADDED":
            kind = "ADDED" if now_matches else None
        elif now_matches:
            kind = "MODIFIED" if was_matching else "ADDED"
        else:
            kind = "DELETED" if was_matching else None
            if kind:    # leaving the selector: the object as it last matched, at the change's version
                await send(kind, {**event.old, "metadata": {**event.old["metadata"],
                                                           "resourceVersion": event.obj["metadata"]["resourceVersion"]}})
                return True
        if kind:
            await send(kind, event.obj)
        return kind is not None


# --------------------------------------------------------------------------- app
def make_k8s_app(store: Store, log_source: LogSource, faults: Faults, auth: Auth, *,
                 debug: bool = False, bookmark_seconds: float | None = None,
                 unadmitted_prefixes: tuple[str, ...] = ()) -> web.Application:
    """The Kubernetes API server app; every request authenticated and authorized by `auth`, except
    paths under `unadmitted_prefixes` (routes the caller adds that check their caller themselves:
    the server's admin routes under /_simcloud); `debug=True` logs every request."""
    api = K8sApi(store, log_source, faults, auth, bookmark_seconds)

    def admit(request: web.Request) -> None:
        """Authentication (401), impersonation and RBAC (403), before anything is read or decoded."""
        user = auth.authenticate(request.headers.get("Authorization"), request.path)
        user = auth.impersonate(user, request.headers)
        auth.check(request_attributes(user, request.method, request.path, request.query))
        request[USER] = user

    @web.middleware
    async def middleware(request: web.Request, handler):
        if faults.k8s_latency_ms > 0:
            await asyncio.sleep(faults.k8s_latency_ms / 1000)
        started = time.monotonic()
        try:
            if not request.path.startswith(unadmitted_prefixes):
                admit(request)
            response = await handler(request)
        except ApiError as err:
            response = _error(err)
        except web.HTTPException as exc:
            if exc.status == 404:
                response = _error(ApiError(404, "NotFound", "the server could not find the requested resource", {}))
            elif exc.status == 405:
                response = _error(_method_not_allowed())
            else:
                raise
        except Exception as exc:
            log.exception("internal error serving %s %s", request.method, request.path)
            response = _error(ApiError(500, "InternalError", f"Internal error occurred: {type(exc).__name__}"))
        if debug:
            log.info("%s %s?%s -> %s (%.1f ms)", request.method, request.path, request.query_string,
                     response.status, (time.monotonic() - started) * 1000)
        return response

    async def version(_: web.Request) -> web.Response:
        return _json(SERVER_VERSION)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def core_versions(request: web.Request) -> web.Response:
        return _json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": request.host}]})

    async def core_resources(_: web.Request) -> web.Response:
        return _json(_resource_list("v1"))

    async def group_list(_: web.Request) -> web.Response:
        return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": _groups()})

    async def group(request: web.Request) -> web.Response:
        for g in _groups():
            if g["name"] == request.match_info["group"]:
                return _json({"kind": "APIGroup", "apiVersion": "v1", **g})
        raise not_found("groups", request.match_info["group"])

    async def group_resources(request: web.Request) -> web.Response:
        gv = f"{request.match_info['group']}/{request.match_info['version']}"
        if not any(v["groupVersion"] == gv for g in _groups() for v in g["versions"]):
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        return _json(_resource_list(gv))

    async def openapi_root(_: web.Request) -> web.Response:
        return _json(openapi.v3_root())

    async def openapi_document(request: web.Request) -> web.Response:
        doc = openapi.v3_document(request.match_info["prefix"].strip("/"))
        if doc is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        return web.Response(body=doc, content_type="application/json")

    async def openapi_v2(request: web.Request) -> web.Response:
        body, content_type = openapi.v2_document(request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application(middlewares=[middleware], client_max_size=64 * 1024 * 1024)
    for path, handler in (("/version", version), ("/healthz", health), ("/readyz", health), ("/livez", health),
                          ("/api", core_versions), ("/api/v1", core_resources), ("/apis", group_list),
                          ("/apis/{group}", group), ("/apis/{group}/{version}", group_resources),
                          ("/openapi/v2", openapi_v2), ("/openapi/v3", openapi_root)):
        app.router.add_get(path, handler)
        app.router.add_get(path + "/", handler)    # the generated clients ask for "/version/", "/api/v1/"
    app.router.add_get("/openapi/v3/{prefix:.+}", openapi_document)
    app.router.add_route("*", "/api/{version:v1}/{tail:.+}", api.resource)
    app.router.add_route("*", "/apis/{group}/{version}/{tail:.+}", api.resource)
    return app

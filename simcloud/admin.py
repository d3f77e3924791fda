"""The admin surface of a running simcloud: faults and a state summary, server and client side.

Served on the Kubernetes port: `GET /_simcloud/faults`, `PATCH /_simcloud/faults` (a JSON
object of fault -> new value, see simcloud.config.Faults), `GET /_simcloud/state`, and
`POST /_simcloud/compact` (drop the watch history and end open watches: 410 on resume), and
`POST /_simcloud/serviceaccount-token` ({"namespace", "name"} -> {"token", "user"}: a token of
an existing ServiceAccount; only with the admin bearer token of the workdir's kubeconfig).
The client helpers find the server through `WORKDIR/simcloud.json`; `apply_manifests` creates
objects through the Kubernetes API itself, as the admin.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simcloud.config import Faults

if TYPE_CHECKING:
    from aiohttp import web

    from simcloud.kube.auth import Auth

log = logging.getLogger(__name__)
ADMIN_PREFIX = "/_simcloud"


def admin_routes(faults: Faults, state: Callable[[], Any], compact: Callable[[], Any],
                 issue_token: Callable[[str | None, str, str], Any],
                 unsupported: dict[str, str] | None = None) -> list[web.RouteDef]:
    """state/compact/issue_token may be coroutine functions (the real backend asks its API server).
    issue_token(authorization header, namespace, name) -> token; it raises ApiError unless the
    header carries the admin token. unsupported: fault -> why this cloud cannot inject it (a PATCH
    setting it to anything but its default is refused, 400, rather than silently ignored)."""
    from aiohttp import web  # server side only: keeps the fault CLI quick to start

    from simcloud.kube.auth import service_account_user
    from simcloud.kube.errors import ApiError

    async def get_faults(_request: web.Request) -> web.Response:
        return web.json_response(faults.to_dict())

    async def patch_faults(request: web.Request) -> web.Response:
        try:
            changes = await request.json()
            if not isinstance(changes, dict):
                raise ValueError("expected a JSON object of fault -> value")
            defaults = Faults().to_dict()
            for key, value in changes.items():
                if key in (unsupported or {}) and value != defaults.get(key) and value not in ([], {}, 0, None):
                    raise ValueError(f"fault {key} cannot be injected here: {unsupported[key]}")
            faults.update(changes)
        except (KeyError, ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc.args[0] if exc.args else exc)}, status=400)
        log.info("faults changed: %s", json.dumps(changes))
        return web.json_response(faults.to_dict())

    async def get_state(_request: web.Request) -> web.Response:
        return web.json_response(await _result(state()))

    async def post_compact(_request: web.Request) -> web.Response:
        """Like an API server restart after an etcd compaction: history dropped, open watches ended,
        so every watcher resuming from its resourceVersion gets 410 Gone and must re-list."""
        return web.json_response({"compacted_resource_version": await _result(compact())})

    async def post_token(request: web.Request) -> web.Response:
        """A token for a named ServiceAccount, so a test can act as it (the admin token is required)."""
        try:
            body = await request.json()
            namespace, name = body["namespace"], body["name"]
            token = await _result(issue_token(request.headers.get("Authorization"), namespace, name))
        except ApiError as err:
            return web.json_response({"error": err.message}, status=err.code)
        except (KeyError, ValueError, TypeError):
            return web.json_response({"error": 'expected {"namespace": ..., "name": ...}'}, status=400)
        return web.json_response({"token": token, "user": service_account_user(namespace, name).name})

    return [web.get(f"{ADMIN_PREFIX}/faults", get_faults), web.patch(f"{ADMIN_PREFIX}/faults", patch_faults),
            web.get(f"{ADMIN_PREFIX}/state", get_state), web.post(f"{ADMIN_PREFIX}/compact", post_compact),
            web.post(f"{ADMIN_PREFIX}/serviceaccount-token", post_token)]


async def _result(value):
    return await value if inspect.isawaitable(value) else value


def store_token_issuer(auth: Auth) -> Callable[[str | None, str, str], str]:
    """issue_token of simcloud's own API server: its Auth mints the token (admin callers only)."""
    from simcloud.kube.auth import MASTERS
    from simcloud.kube.errors import ApiError

    def issue(authorization: str | None, namespace: str, name: str) -> str:
        if MASTERS not in auth.authenticate(authorization, ADMIN_PREFIX).groups:
            raise ApiError(403, "Forbidden", "the admin token is required")
        return auth.issue_token(namespace, name)
    return issue


# ---------------------------------------------------------------------- client side
class AdminError(RuntimeError):
    """The admin endpoint refused a request; the message is the server's."""


def admin_url(workdir: Path) -> str:
    info = Path(workdir) / "simcloud.json"
    try:
        return json.loads(info.read_text())["admin_url"]
    except FileNotFoundError:
        raise AdminError(f"{info} not found: is `python -m simcloud serve --workdir {workdir}` running?") from None


def request(workdir: Path, path: str, method: str = "GET", body: dict | None = None, timeout: float = 10,
            token: str | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(admin_url(workdir) + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError):
            detail = json.loads(detail).get("error", detail)
        raise AdminError(f"{method} {path}: {exc.code}: {detail}") from None


def get_faults(workdir: Path) -> dict:
    return request(workdir, "/faults")


def set_faults(workdir: Path, **changes) -> dict:
    return request(workdir, "/faults", "PATCH", changes)


def get_state(workdir: Path) -> dict:
    return request(workdir, "/state")


def compact(workdir: Path) -> int:
    return request(workdir, "/compact", "POST", {})["compacted_resource_version"]


def serviceaccount_token(workdir: Path, namespace: str, name: str) -> str:
    """A bearer token of ServiceAccount `namespace/name` (which must exist)."""
    from simcloud.workdir import token_of
    admin_token = token_of(Path(workdir) / "kubeconfig")
    return request(workdir, "/serviceaccount-token", "POST", {"namespace": namespace, "name": name},
                   token=admin_token, timeout=120)["token"]     # a 10,000-node cloud answers slowly


def write_serviceaccount_files(workdir: Path, namespace: str, name: str, kubeconfig: Path,
                               connections: Path | None = None, context_namespace: str = "default") -> str:
    """A kubeconfig (and optionally an Airflow connections.json) acting as the ServiceAccount; returns its token."""
    from simcloud.kube.auth import service_account_user
    from simcloud.workdir import write_identity
    token = serviceaccount_token(workdir, namespace, name)
    write_identity(workdir, service_account_user(namespace, name).name, token, kubeconfig, connections,
                   context_namespace)
    return token


def apply_manifests(workdir: Path, *manifests: Path | str, api_client=None) -> list[str]:
    """Create every object of these YAML files as the admin of the workdir's kubeconfig, as an
    administrator applies deploy/kubernetes/ to a real cluster; an object that already exists is
    left as it is (a re-run changes nothing). Returns "kind/name created|unchanged" lines."""
    import yaml
    from kubernetes import config, utils
    from kubernetes.utils import FailToCreateError

    client = api_client or config.new_client_from_config(config_file=str(Path(workdir) / "kubeconfig"))
    done = []
    for path in manifests:
        for obj in (o for o in yaml.safe_load_all(Path(path).read_text()) if o):
            name = f"{obj['kind'].lower()}/{obj['metadata']['name']}"
            try:
                utils.create_from_dict(client, obj)
                done.append(f"{name} created")
            except FailToCreateError as exc:
                if not all(getattr(e, "status", None) == 409 for e in exc.api_exceptions):
                    raise
                done.append(f"{name} unchanged")
    return done


def parse_assignments(items: list[str]) -> dict:
    """`key=value` words -> fault changes. Lists take commas (`never_ready=a,b`; empty clears);
    other values are numbers."""
    kinds = {f.name: type(getattr(Faults(), f.name)) for f in fields(Faults)}
    changes: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got {item!r}")
        if key not in kinds:
            raise ValueError(f"unknown fault {key!r}; known: {', '.join(sorted(kinds))}")
        if kinds[key] is list:
            changes[key] = [v.strip() for v in value.split(",") if v.strip()]
        elif kinds[key] is dict:   # node:value,node:value
            pairs = [v.strip().partition(":") for v in value.split(",") if v.strip()]
            if any(not sep for _, sep, _ in pairs):
                raise ValueError(f"fault {key}: expected node:value pairs separated by commas, got {value!r}")
            changes[key] = {k: v for k, _, v in pairs}
        else:
            try:
                changes[key] = kinds[key](value)
            except ValueError:
                raise ValueError(f"fault {key}: expected a {kinds[key].__name__}, got {value!r}") from None
    return changes

"""Find, without running anything, which Kubernetes and ECS API methods some Python code uses.

Why static: the permissions we ship (deploy/) must cover every call the plugin can make,
including calls on error paths no test reaches. The universe of API method names comes from
the installed client libraries themselves (the `kubernetes` API classes and the ECS SDK
client), so a call is recognised whatever object it is made on; a method handed to a helper
or to `Watch().stream(...)` counts as used.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class Use:
    """One reference to an API method in source code."""

    api: str        # "kube" or "ecs"
    name: str       # kube: client method name; ecs: action name (StartInstances)
    watch: bool     # kube list_* used as a watch (Watch().stream(list_x) or watch=True)
    where: str      # file:line

    def __str__(self) -> str:
        suffix = " (watch)" if self.watch else ""
        return f"{self.name}{suffix} at {self.where}"


def _installed(distribution_name: str, path: str) -> Path:
    """A file of an installed distribution, found without importing it (imports are slow)."""
    from importlib.metadata import distribution

    return Path(distribution(distribution_name).locate_file(path))


_KUBE_DEF = re.compile(r"^    def ([a-z]\w*)\(self", re.MULTILINE)


@cache
def kube_methods() -> dict[str, list[str]]:
    """Public method name -> the `kubernetes.client` API modules defining it (CoreV1Api first)."""
    api_dir = _installed("kubernetes", "kubernetes/client/api")
    modules = sorted(api_dir.glob("*_api.py"), key=lambda p: (p.name != "core_v1_api.py", p.name))
    found: dict[str, list[str]] = {}
    for module in modules:
        for name in _KUBE_DEF.findall(module.read_text()):
            if not name.endswith("_with_http_info"):
                found.setdefault(name, []).append(module.name)
    return found


_CALL_API = re.compile(r"call_api\(\s*'([^']+)',\s*'([A-Z]+)'")
_API_PREFIX = re.compile(r"^/(?:api/v1|apis/([^/]+)/[^/]+)(/.*)?$")
_HTTP_VERB = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def kube_rest(name: str, module: str | None = None) -> tuple[str, str, str]:
    """(apiGroup, resource[/subresource], RBAC verb) a client method requests, read from the
    generated client's own URL template and HTTP method, so the mapping is not guessed."""
    module = module or kube_methods()[name][0]
    source = _installed("kubernetes", f"kubernetes/client/api/{module}").read_text()
    body = source[source.index(f"    def {name}_with_http_info(self"):]
    path, http = _CALL_API.search(body).groups()
    group, rest = _API_PREFIX.match(path).groups()
    parts = [p for p in (rest or "").split("/") if p]
    if parts[:2] == ["namespaces", "{namespace}"]:
        parts = parts[2:]
    resource, named = parts[0], len(parts) > 1
    if len(parts) > 2:
        resource = f"{resource}/{parts[2]}"
    if http in _HTTP_VERB:
        verb = _HTTP_VERB[http]
    elif http == "GET":
        verb = "get" if named else "list"
    else:  # DELETE
        verb = "delete" if named else "deletecollection"
    if name.startswith("connect_"):
        verb = "create"  # exec/attach/portforward upgrade the connection: RBAC "create"
    return group or "", resource, verb


@cache
def ecs_methods() -> dict[str, str]:
    """ECS SDK client method name (sync, async, *_with_options) -> OpenAPI action name."""
    tree = ast.parse(_installed("alibabacloud-ecs20140526", "alibabacloud_ecs20140526/client.py").read_text())
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            for sub in ast.walk(node):
                if isinstance(sub, ast.keyword) and sub.arg == "action" and isinstance(sub.value, ast.Constant):
                    found[node.name] = sub.value.value
    # Plain `start_instances(request)` delegates to the *_with_options form.
    for name in list(found):
        for suffix in ("_with_options_async", "_with_options"):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                found.setdefault(base + ("_async" if suffix.endswith("async") else ""), found[name])
    return found


# Calls that watch the list method passed first: the client's Watch().stream, and KubeClient._watch
# (gpuboot.hooks.kube), which hands it to Watch().stream.
WATCHING_CALLS = {"stream", "_watch"}


def _is_watch(node: ast.Attribute, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(node)
    if isinstance(parent, ast.Call):
        if parent.func is node:
            return any(k.arg == "watch" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in parent.keywords)
        func = parent.func
        return isinstance(func, ast.Attribute) and func.attr in WATCHING_CALLS and parent.args[:1] == [node]
    return False


def scan_source(source: str, where: str, only: set[str] | None = None) -> list[Use]:
    """API uses in one module; `only` limits the scan to the named top-level/class functions."""
    tree = ast.parse(source)
    roots: list[ast.AST] = [tree]
    if only is not None:
        roots = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in only]
    kube, ecs = kube_methods(), ecs_methods()
    ecs_actions = set(ecs.values())
    uses: list[Use] = []
    for root in roots:
        parents = {child: parent for parent in ast.walk(root) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(root):
            at = f"{where}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute):
                if node.attr in kube:
                    uses.append(Use("kube", node.attr, _is_watch(node, parents), at))
                elif node.attr in ecs:
                    uses.append(Use("ecs", ecs[node.attr], False, at))
                elif node.attr.endswith("Request") and node.attr[: -len("Request")] in ecs_actions:
                    uses.append(Use("ecs", node.attr[: -len("Request")], False, at))
    return uses


def scan_files(paths: list[Path], root: Path) -> list[Use]:
    uses: list[Use] = []
    for path in paths:
        uses.extend(scan_source(path.read_text(), str(path.relative_to(root))))
    return uses


def provider_dir() -> Path:
    return _installed("apache-airflow-providers-cncf-kubernetes", "airflow/providers/cncf/kubernetes")


# The modules that make up KubernetesPodOperator at run time (sync and deferrable paths).
POD_OPERATOR_MODULES = ("operators/pod.py", "utils/pod_manager.py", "triggers/pod.py")
HOOK_MODULE = "hooks/kubernetes.py"


def pod_operator_uses() -> list[Use]:
    """API uses of KubernetesPodOperator: its modules, plus the hook methods they call
    (followed through the hook's own calls to its other methods)."""
    base = provider_dir()
    uses: list[Use] = []
    called: set[str] = set()
    for rel in POD_OPERATOR_MODULES:
        source = (base / rel).read_text()
        uses.extend(scan_source(source, f"cncf-kubernetes/{rel}"))
        called |= {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    hook_source = (base / HOOK_MODULE).read_text()
    hook_tree = ast.parse(hook_source)
    hook_methods = {n.name: n for n in ast.walk(hook_tree) if isinstance(n, ast.ClassDef)
                    and n.name in ("KubernetesHook", "AsyncKubernetesHook") for n in n.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    todo, seen = [m for m in called if m in hook_methods], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        body_attrs = {n.attr for n in ast.walk(hook_methods[name]) if isinstance(n, ast.Attribute)}
        todo.extend(a for a in body_attrs if a in hook_methods and a not in seen)
    uses.extend(scan_source(hook_source, f"cncf-kubernetes/{HOOK_MODULE}", only=seen))
    return uses

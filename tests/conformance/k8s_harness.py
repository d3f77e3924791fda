"""An in-process Kubernetes API server (store + scheduler + API app) for the K8S conformance tests.

The aiohttp app runs in its own event loop on a background thread, bound to
127.0.0.1 on a free port over HTTP (the Python clients, `core_v1()`, `configure()`) and on
another over HTTPS (the `kubeconfig` kubectl uses: client-go sends tokens only over TLS),
so synchronous clients and kubectl can call it from the test thread. Every request needs
a token: the admin's (`admin_token`) or a ServiceAccount's (`token_for`, `kubeconfig_for`). `on_loop` runs a function inside that loop, the only place the
store may be touched. Logs come from a tiny in-memory LogSource.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from aiohttp import web

from simcloud.config import Faults
from simcloud.harness import wait_until  # noqa: F401 - re-exported for the K8S tests
from simcloud.kube.api import make_k8s_app
from simcloud.kube.auth import Auth
from simcloud.kube.errors import ApiError
from simcloud.kube.scheduler import Scheduler
from simcloud.kube.store import Store
from simcloud.tls import serving_context
from simcloud.workdir import kubeconfig_text

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]


class MemoryLogs:
    """A LogSource double: lines appended by tests; a follow ends once the pod is terminal."""

    def __init__(self, store: Store):
        self.store = store
        self.lines: dict[tuple[str, str], list[bytes]] = {}

    async def stream(self, namespace, pod, container, *, follow, timestamps, since_seconds, since_time,
                     tail_lines, limit_bytes):
        name = pod["metadata"]["name"]
        names = [c["name"] for c in pod["spec"]["containers"]]
        if container is None and len(names) > 1:
            raise ApiError(400, "BadRequest", f"a container name must be specified for pod {name}, "
                                              f"choose one of: [{' '.join(names)}]")
        container = container or names[0]
        if not pod["spec"].get("nodeName"):
            raise ApiError(400, "BadRequest",
                           f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating')
        key, sent = (namespace, name), 0
        lines = self.lines.setdefault(key, [])
        if tail_lines is not None:
            sent = max(0, len(lines) - tail_lines)
        while True:
            while sent < len(lines):
                line = lines[sent]
                sent += 1
                yield (b"2026-01-01T00:00:00.000000000Z " + line) if timestamps else line
            try:
                phase = self.store.read("pods", namespace, name)["status"].get("phase")
            except ApiError:
                return
            if not follow or phase in ("Succeeded", "Failed"):
                return
            await asyncio.sleep(0.02)


@dataclass
class K8sServer:
    store: Store
    faults: Faults
    logs: MemoryLogs
    port: int
    loop: asyncio.AbstractEventLoop
    kubeconfig: Path
    workdir: Path
    auth: Auth
    ca_pem: bytes
    https_port: int
    scheduler: Scheduler | None = None
    _stop: Callable[[], None] = field(default=lambda: None)

    @property
    def backend(self) -> str:
        return "simcloud"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def on_loop(self, fn: Callable[[], T]) -> T:
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=10)

    @property
    def admin_token(self) -> str:
        return self.auth.admin_token

    def ssl_context(self) -> None:
        """For raw HTTP clients: `url` is plain HTTP (the real plane's adapter returns its CA's context)."""
        return None

    def configure(self, config, token: str | None = None):
        """Point a `kubernetes` or `kubernetes_asyncio` Configuration at the server with a bearer token
        (the admin's unless `token`)."""
        config.host = self.url
        config.api_key = {"BearerToken": token or self.admin_token}
        config.api_key_prefix = {"BearerToken": "Bearer"}
        return config

    def core_v1(self, token: str | None = None):
        import kubernetes
        config = self.configure(kubernetes.client.Configuration(), token)
        return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))

    def token_for(self, namespace: str, name: str) -> str:
        """A token of ServiceAccount namespace/name (created if missing), as TokenRequest issues it."""
        def issue() -> str:
            try:
                self.store.read("serviceaccounts", namespace, name)
            except ApiError:
                self.store.create("serviceaccounts", {"metadata": {"name": name, "namespace": namespace}})
            return self.auth.issue_token(namespace, name)
        return self.on_loop(issue)

    def kubeconfig_for(self, user: str, token: str) -> Path:
        """A kubeconfig on the HTTPS port acting as `user` with `token` (kubectl sends tokens only over TLS)."""
        path = self.workdir / f"kubeconfig-{user.replace(':', '-')}"
        path.write_text(kubeconfig_text(f"https://127.0.0.1:{self.https_port}", user, token, ca_pem=self.ca_pem))
        return path

    def create_namespace(self, name: str) -> None:
        self.on_loop(lambda: self.store.create("namespaces", {"metadata": {"name": name}}))

    def add_node(self, name: str, **kwargs) -> dict:
        return self.on_loop(lambda: self.store.create("nodes", make_node(name, **kwargs)))


def make_node(name: str, *, ready: bool = True, gpu: int = 0, cpu: str = "8", memory: str = "32Gi",
              labels: dict | None = None, taints: list | None = None, unschedulable: bool = False,
              ip: str = "10.0.0.10") -> dict:
    allocatable = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi"}
    if gpu:
        allocatable["nvidia.com/gpu"] = str(gpu)
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                              **(labels or {})}},
        "spec": {"providerID": f"cn-hangzhou.i-{name}", "taints": taints or [],
                 **({"unschedulable": True} if unschedulable else {})},
        "status": {
            "capacity": dict(allocatable), "allocatable": allocatable,
            "conditions": [{"type": "Ready", "status": "True" if ready else "Unknown",
                            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                            "message": "kubelet is posting ready status" if ready else "Kubelet stopped posting node status.",
                            "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.32.4", "osImage": "Alibaba Cloud Linux 3", "kernelVersion": "5.10.134",
                         "containerRuntimeVersion": "containerd://1.7.22", "bootID": "boot-1",
                         "architecture": "amd64", "operatingSystem": "linux", "machineID": name, "systemUUID": name,
                         "kubeProxyVersion": ""},
        },
    }


def pod_body(name: str, *, node_selector: dict | None = None, gpu: int = 0, cpu: str | None = None,
             tolerations: list | None = None, affinity: dict | None = None, labels: dict | None = None) -> dict:
    resources = {}
    if gpu:
        resources["limits"] = {"nvidia.com/gpu": str(gpu)}
    if cpu:
        resources["requests"] = {"cpu": cpu}
    spec: dict = {"containers": [{"name": "main", "image": "python:3.11", "command": ["python", "-c", "print(1)"],
                                  "resources": resources}], "restartPolicy": "Never"}
    if node_selector:
        spec["nodeSelector"] = node_selector
    if tolerations:
        spec["tolerations"] = tolerations
    if affinity:
        spec["affinity"] = affinity
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def start_server(workdir: Path, *, scheduler: bool = True, history_limit: int | None = None) -> K8sServer:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    async def boot():
        store = Store(history_limit=history_limit) if history_limit else Store()
        faults = Faults()
        logs = MemoryLogs(store)
        auth = Auth(store)
        runner = web.AppRunner(make_k8s_app(store, logs, faults, auth), access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        tls, ca_pem = serving_context(workdir / "tls", ["127.0.0.1"])
        https = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)   # for kubectl: credentials only over TLS
        await https.start()
        sched = Scheduler(store) if scheduler else None
        if sched:
            sched.start()
        holder.update(store=store, faults=faults, logs=logs, runner=runner, scheduler=sched, auth=auth,
                      port=site._server.sockets[0].getsockname()[1], ca_pem=ca_pem,
                      https_port=https._server.sockets[0].getsockname()[1])
        ready.set()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(boot())
        loop.run_forever()

    thread = threading.Thread(target=run, name="k8s-harness", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the in-process Kubernetes API did not start within 10s")

    def stop():
        async def shutdown():
            if holder["scheduler"]:
                await holder["scheduler"].stop()
            await holder["runner"].cleanup()
        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(kubeconfig_text(f"https://127.0.0.1:{holder['https_port']}", "simcloud-admin",
                                          holder["auth"].admin_token, ca_pem=holder["ca_pem"]))
    return K8sServer(holder["store"], holder["faults"], holder["logs"], holder["port"], loop, kubeconfig, workdir,
                     holder["auth"], holder["ca_pem"], holder["https_port"], holder["scheduler"], stop)


@pytest.fixture
def k8s(request, tmp_path):
    """simcloud's API server in process; under --kube=real (tests marked both_backends) the module's real
    control plane (conftest's real_cluster), reset after each test, so the same assertions hold against
    kube-apiserver itself."""
    if os.environ.get("GPUBOOT_KUBE") == "real":
        cluster = request.getfixturevalue("real_cluster")
        yield cluster
        cluster.reset()
        return
    server = start_server(tmp_path)
    yield server
    server._stop()


# --------------------------------------------------------------------------- kubectl
KUBECTLS = {
    "kubectl-1.32": shutil.which("kubectl") or "/usr/bin/kubectl",
    "kubectl-1.20": str(REPO / ".tools/debian-kubectl/usr/bin/kubectl"),
}
KUBECTL_PARAMS = [
    pytest.param(path, id=name, marks=[pytest.mark.kubectl,
                                       pytest.mark.skipif(not os.access(path, os.X_OK), reason=f"{path} missing")])
    for name, path in KUBECTLS.items()
]


def kubectl(binary: str, server: K8sServer, *args: str, check: bool = True, timeout: float = 30,
            kubeconfig: Path | None = None) -> subprocess.CompletedProcess:
    """Run kubectl against `server` (as the admin, or the identity of `kubeconfig`) with a private HOME
    and discovery cache."""
    kubeconfig = kubeconfig or server.kubeconfig
    env = {**os.environ, "HOME": str(server.workdir), "KUBECONFIG": str(kubeconfig)}
    cmd = [binary, "--kubeconfig", str(kubeconfig), "--cache-dir", str(server.workdir / "kcache"), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr}\n{result.stdout}")
    return result

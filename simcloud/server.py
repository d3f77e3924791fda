"""Assemble the local cloud in one event loop and serve it on two ports of --host (default 127.0.0.1).

Store + Scheduler + node-lifecycle controller + EcsCloud + Kubelets + ContainerRunner, the Kubernetes API (with the
admin routes `/_simcloud/faults` and `/_simcloud/state`) on one port over HTTP and on a
second over HTTPS (kubectl sends credentials only over TLS; the kubeconfig names this one),
and the ECS API on a third. Once they listen it writes, in the workdir:

* `kubeconfig`        cluster https://HOST:K8SHTTPSPORT (HOST 127.0.0.1 unless --host) with its private CA,
                      the admin token user (group system:masters), current-context set   (mode 0600)
* `ecs.json`          endpoint, region, access_key_id, access_key_secret   (mode 0600)
* `connections.json`  Airflow connections `kubernetes_default` and `alibaba_ecs_default`
                      (the `dag.test(conn_file_path=...)` format; each value also works as
                      the JSON form of an `AIRFLOW_CONN_*` variable)            (mode 0600)
* `simcloud.json`     ports, URLs, admin URL, pid (no secrets)

and prints one line containing `simcloud ready`. ServiceAccount tokens, kubeconfigs and
connections: `python -m simcloud token` (simcloud.admin). SIGTERM/SIGINT stop it cleanly: container
processes killed, sockets closed. The access key secret is never printed or logged.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import os
import random
import signal
import socket
import ssl
import sys
import time
from pathlib import Path

from aiohttp import web

from simcloud.admin import ADMIN_PREFIX, admin_routes, store_token_issuer
from simcloud.config import Faults
from simcloud.ecs.api import make_ecs_app
from simcloud.ecs.model import EcsCloud
from simcloud.fleet import BENCH_NAMESPACE, Fleet, ecs_instance, new_boot_id, node_object, placeholder_pod
from simcloud.kube import admission
from simcloud.kube.api import make_k8s_app
from simcloud.kube.auth import ADMIN_USER, Auth
from simcloud.kube.node_lifecycle import NodeLifecycleController
from simcloud.kube.scheduler import Scheduler
from simcloud.kube.store import Store
from simcloud.machines.api import StoreApi
from simcloud.machines.containers import ContainerRunner, rfc3339
from simcloud.machines.kubelet import Kubelets
from simcloud.tls import serving_context
from simcloud.workdir import kubeconfig_text, kubernetes_connection
from simcloud.workdir import write_file as _write

log = logging.getLogger("simcloud")



def cluster_summary(kubelets, nodes, pods) -> tuple[list[dict], dict[str, int]]:
    """The state summary's nodes (the API's view joined with the kubelet's own) and pod phase counts,
    whichever API server the objects come from."""
    kubelet = {k["name"]: k for k in kubelets}
    rows = []
    for obj in nodes:
        status = obj.get("status") or {}
        ready = next((c["status"] for c in status.get("conditions") or [] if c["type"] == "Ready"), "Unknown")
        rows.append({**kubelet.get(obj["metadata"]["name"], {"name": obj["metadata"]["name"]}),
                     "ready": ready, "provider_id": obj["spec"].get("providerID"),
                     "allocatable_gpu": (status.get("allocatable") or {}).get("nvidia.com/gpu"),
                     "node_boot_id": (status.get("nodeInfo") or {}).get("bootID"),
                     "taints": [f"{t['key']}:{t['effect']}" for t in obj["spec"].get("taints") or []]})
    phases: dict[str, int] = {}
    for pod in pods:
        phase = (pod.get("status") or {}).get("phase", "Pending")
        phases[phase] = phases.get(phase, 0) + 1
    return rows, phases

class Cloud:
    """Everything one simcloud process holds, wired together but not yet listening."""

    def __init__(self, fleet: Fleet, workdir: Path, seed: int | None = None, host: str = "127.0.0.1") -> None:
        self.fleet, self.workdir, self.host = fleet, Path(workdir), host
        self.rng = random.Random(seed)
        self.faults: Faults = fleet.faults
        timings = fleet.timings
        self.store = Store(history_seconds=timings.watch_history_seconds)
        self.store.defaulters["pods"] = functools.partial(     # --default-*-toleration-seconds
            admission.default_pod, toleration_seconds=int(timings.default_toleration_seconds))
        self.cloud = EcsCloud(fleet.region, fleet.timings, fleet.faults)
        self.runner = ContainerRunner(self.workdir / "containers")
        self.kubelets = Kubelets(StoreApi(self.store), self.cloud, self.runner, fleet.timings, fleet.faults,
                                 random.Random(self.rng.random()))
        self.scheduler = Scheduler(self.store)
        self.node_lifecycle = NodeLifecycleController(self.store, fleet.timings)
        self._populate()
        self.auth = Auth(self.store)
        self.k8s_app = make_k8s_app(self.store, self.runner, self.faults, self.auth,
                                    bookmark_seconds=timings.watch_bookmark_seconds,
                                    unadmitted_prefixes=(ADMIN_PREFIX,))
        self.k8s_app.router.add_routes(admin_routes(self.faults, self.state, self.store.compact,
                                                    store_token_issuer(self.auth)))
        self.ecs_app = make_ecs_app(self.cloud, {fleet.access_key_id: fleet.access_key_secret}, self.faults,
                                    rng=random.Random(self.rng.random()))
        self._runners: list[web.AppRunner] = []
        self.k8s_port = self.k8s_https_port = self.ecs_port = 0
        self.ca_pem = b""

    def _populate(self) -> None:
        """The ECS side of the fleet; its Nodes are registered by the kubelets at start."""
        fleet = self.fleet
        for t in fleet.instance_types.values():   # a fleet TypeSpec is an ECS InstanceType
            self.cloud.add_instance_type(t)
        if fleet.pods_per_node:
            self.store.create("namespaces", {"metadata": {"name": BENCH_NAMESPACE}})
        for spec in fleet.nodes:
            self.cloud.add_instance(ecs_instance(spec, fleet.region))
            self.kubelets.add(spec)

    async def _register_nodes(self) -> None:
        now = rfc3339()
        for spec in self.fleet.nodes:
            running = spec.status == "Running"
            await self.kubelets.register(spec, node_object(spec, self.fleet.region, new_boot_id(self.rng)), running)
            if running:
                for i in range(self.fleet.pods_per_node):
                    self.store.create("pods", placeholder_pod(spec.name, i, spec.private_ip, now))

    def state(self) -> dict:
        """Instances, nodes (API view joined with the kubelet's own) and pod counts."""
        nodes, phases = cluster_summary(self.kubelets.state(), self.store.peek("nodes"), self.store.peek("pods"))
        return {"region": self.fleet.region, "instances": self.cloud.state(), "nodes": nodes, "pods": phases,
                "faults": self.faults.to_dict(), "watches": self.store.open_watches()}

    async def start(self, k8s_port: int = 0, ecs_port: int = 0, k8s_https_port: int = 0) -> None:
        await self._register_nodes()
        tls, self.ca_pem = serving_context(self.workdir / "tls", [self.host])
        (k8s_address, self.k8s_port), (_, self.k8s_https_port) = await self._listen(
            self.k8s_app, (k8s_port, None), (k8s_https_port, tls))
        ((_, self.ecs_port),) = await self._listen(self.ecs_app, (ecs_port, None))
        # Pods are processes on this machine: they reach the API at the address it is bound to
        # (the IP --host resolved to; a wildcard bind through loopback).
        self.runner.k8s_host = "127.0.0.1" if k8s_address == "0.0.0.0" else k8s_address
        self.runner.k8s_port = self.k8s_port
        self.scheduler.start()
        self.node_lifecycle.start()
        self.kubelets.start()

    async def _listen(self, app: web.Application, *ports: tuple[int, ssl.SSLContext | None]) -> list[tuple[str, int]]:
        """Serve `app` on (--host, port) for each (port, TLS context or None); returns the bound addresses."""
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        self._runners.append(runner)
        bound = []
        for port, tls in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, port))
            await web.SockSite(runner, sock, ssl_context=tls).start()
            bound.append(sock.getsockname()[:2])
        return bound

    async def stop(self) -> None:
        await self.kubelets.stop()
        await self.scheduler.stop()
        await self.node_lifecycle.stop()
        await self.runner.shutdown()
        self.cloud.close()
        for runner in reversed(self._runners):
            await runner.cleanup()

    # ------------------------------------------------------------------ workdir files
    @property
    def k8s_url(self) -> str:
        return f"http://{self.host}:{self.k8s_port}"

    @property
    def k8s_https_url(self) -> str:
        return f"https://{self.host}:{self.k8s_https_port}"

    @property
    def ecs_endpoint(self) -> str:
        return f"http://{self.host}:{self.ecs_port}"

    def write_files(self) -> None:
        fleet, wd = self.fleet, self.workdir
        kubeconfig = wd / "kubeconfig"
        _write(kubeconfig, kubeconfig_text(self.k8s_https_url, ADMIN_USER, self.auth.admin_token,
                                           ca_pem=self.ca_pem), private=True)
        write_ecs_files(wd, fleet, kubeconfig, self.host, self.ecs_port)
        _write(wd / "simcloud.json", json.dumps({
            "pid": os.getpid(), "k8s_port": self.k8s_port, "ecs_port": self.ecs_port, "k8s_url": self.k8s_url,
            "k8s_https_port": self.k8s_https_port, "k8s_https_url": self.k8s_https_url,
            "ecs_endpoint": self.ecs_endpoint, "admin_url": self.k8s_url + ADMIN_PREFIX, "region": fleet.region,
            "kubeconfig": str(kubeconfig.resolve())}, indent=2))


KUBELET_WATCH_USER = "simcloud:kubelet-pod-watch"
# Faults simcloud's own API server injects: on the real control plane there is nothing to inject them.
REAL_UNSUPPORTED_FAULTS = ("k8s_latency_ms", "k8s_conflict_burst", "log_stream_cut_seconds")


def kubelet_address(index: int) -> str:
    """The InternalIP of the index-th node under the real API server: a loopback address the
    machine can bind (127.0.0.2 and up), where its kubelet endpoint listens."""
    return f"127.0.{index // 250}.{index % 250 + 2}"


class RealCloud:
    """The local cloud on the real Kubernetes control plane (simcloud.real_control_plane): etcd,
    kube-apiserver, kube-scheduler and kube-controller-manager (node lifecycle, evictions,
    ServiceAccounts, garbage collection) replace simcloud's own API server, scheduler and
    node-lifecycle controller. The ECS emulator and the kubelets are the same as on simcloud's
    own server; each kubelet writes as its node (simcloud.machines.api.HttpApi) and serves
    container logs (simcloud.machines.endpoint). simcloud's small HTTP server keeps the ECS API
    and the /_simcloud admin routes (faults, state, compact, ServiceAccount tokens).

    The control plane's processes are started, restarted and stopped from one long-lived thread:
    they are killed with it (PR_SET_PDEATHSIG), so a killed simcloud leaves none behind."""

    def __init__(self, fleet: Fleet, workdir: Path, seed: int | None = None, host: str = "127.0.0.1",
                 binary: str | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from simcloud.real_control_plane import RealControlPlane
        self.fleet, self.workdir, self.host = fleet, Path(workdir), host
        self.rng = random.Random(seed)
        self.faults: Faults = fleet.faults
        timings = fleet.timings
        self.cloud = EcsCloud(fleet.region, timings, fleet.faults)
        self.runner = ContainerRunner(self.workdir / "containers")
        self.addresses = {spec.name: kubelet_address(i) for i, spec in enumerate(fleet.nodes)}
        self.plane = RealControlPlane(
            self.workdir / "k8s", binary,
            node_monitor_period=max(0.5, timings.node_monitor_period_seconds),
            node_monitor_grace_period=timings.node_monitor_grace_seconds,
            # The machines' device plugins are the emulated kubelets' own (the GPU stale -> 0 -> real
            # pattern): a DaemonSet here is the record of one that owns its pods, and no controller
            # should run, adopt, release or delete pods for it.
            controllers=("*", "-daemonset"),
            kubelet_ips=list(self.addresses.values()),
            default_toleration_seconds=int(timings.default_toleration_seconds))
        for spec in fleet.nodes:
            self.plane.add_node_token(spec.name)
        self.watcher = self.plane.add_user(KUBELET_WATCH_USER)
        self._plane_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="control-plane")
        for t in fleet.instance_types.values():
            self.cloud.add_instance_type(t)
        for spec in fleet.nodes:
            self.cloud.add_instance(ecs_instance(spec, fleet.region))
        self.api = None
        self.kubelets: Kubelets | None = None
        self.endpoint = None
        self.app = web.Application()
        self.app.router.add_routes(admin_routes(self.faults, self.state, self.compact, self.issue_token,
                                                unsupported=dict.fromkeys(REAL_UNSUPPORTED_FAULTS, (
                                                    "it is made by simcloud's own API server; the real "
                                                    "kube-apiserver serves this cloud"))))
        self.ecs_app = make_ecs_app(self.cloud, {fleet.access_key_id: fleet.access_key_secret}, self.faults,
                                    rng=random.Random(self.rng.random()))
        self._runners: list[web.AppRunner] = []
        self.admin_port = self.ecs_port = 0

    async def _in_plane_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._plane_thread, fn, *args)

    async def start(self, k8s_port: int = 0, ecs_port: int = 0) -> None:
        from simcloud.machines.api import HttpApi
        from simcloud.machines.endpoint import KubeletEndpoint
        if k8s_port:
            raise ValueError("--k8s-port: the real API server takes a free port of its own")
        await self._in_plane_thread(self.plane.start)
        self._grant_pod_watch()
        plane = self.plane
        assert plane.pki is not None and plane.kubelet_cert is not None
        self.runner.k8s_host, self.runner.k8s_port = "127.0.0.1", plane.ports["apiserver"]
        self.api = HttpApi(plane.server_url, plane.pki.ca_pem,
                           {name: plane.identities[f"node-{name}"].token for name in self.addresses},
                           self.watcher.token)
        self.kubelets = Kubelets(self.api, self.cloud, self.runner, self.fleet.timings, self.fleet.faults,
                                 random.Random(self.rng.random()))
        self.endpoint = KubeletEndpoint(self.runner, self._find_pod, self.addresses,
                                        tuple(map(str, plane.kubelet_cert)), str(plane.pki.ca_cert))
        port = await self.endpoint.start()
        limit = asyncio.Semaphore(16)

        async def register(spec) -> None:
            obj = node_object(spec, self.fleet.region, new_boot_id(self.rng))
            obj["status"]["addresses"] = [{"type": "InternalIP", "address": self.addresses[spec.name]},
                                          {"type": "Hostname", "address": spec.name}]
            obj["status"]["daemonEndpoints"] = {"kubeletEndpoint": {"Port": port}}
            async with limit:
                await self.kubelets.register(spec, obj, spec.status == "Running")
        for spec in self.fleet.nodes:
            self.kubelets.add(spec)
        await asyncio.gather(*(register(spec) for spec in self.fleet.nodes))
        if self.fleet.pods_per_node:
            await self._in_plane_thread(self._create_fillers)
        self.kubelets.start()
        ((_, self.admin_port),) = await self._listen(self.app, 0)
        ((_, self.ecs_port),) = await self._listen(self.ecs_app, ecs_port)

    def _create_fillers(self) -> None:
        """`pods_per_node` placeholder pods on every Running node, through kube-apiserver (simcloud's own
        store makes them directly): bound by nodeName, Pending to the API server (it resets a created
        pod's status), which placement counts as it counts Running ones; the kubelets leave them alone."""
        from concurrent.futures import ThreadPoolExecutor

        status, text = self.plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": BENCH_NAMESPACE}})
        if status not in (201, 409):
            raise RuntimeError(f"POST namespace {BENCH_NAMESPACE}: {status} {text[:300]!r}")
        now = rfc3339()
        pods = [placeholder_pod(spec.name, i, self.addresses[spec.name], now) for spec in self.fleet.nodes
                if spec.status == "Running" for i in range(self.fleet.pods_per_node)]

        def create(pod: dict) -> None:
            for _ in range(120):        # the namespace's default ServiceAccount comes a moment after it
                status, text = self.plane.request("POST", f"/api/v1/namespaces/{BENCH_NAMESPACE}/pods", pod,
                                                  timeout=60)
                if status in (201, 409):
                    return
                if b"serviceaccount" not in text.lower():
                    break
                time.sleep(0.5)
            raise RuntimeError(f"POST pod {pod['metadata']['name']}: {status} {text[:300]!r}")

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(create, pods))

    def _grant_pod_watch(self) -> None:
        """The kubelets' one pod watch: get, list and watch pods, nothing else."""
        name = "simcloud:kubelet-pod-watch"
        for path, body in (
                ("/apis/rbac.authorization.k8s.io/v1/clusterroles", {
                    "metadata": {"name": name},
                    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]}),
                ("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
                    "metadata": {"name": name},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                  "name": KUBELET_WATCH_USER}]})):
            status, text = self.plane.request("POST", path, body)
            if status not in (201, 409):
                raise RuntimeError(f"POST {path}: {status} {text[:300]!r}")

    def _find_pod(self, namespace: str, name: str) -> dict | None:
        assert self.api is not None
        return next((p for p in self.api.peek("pods")
                     if p["metadata"]["namespace"] == namespace and p["metadata"]["name"] == name), None)

    async def _listen(self, app: web.Application, port: int) -> list[tuple[str, int]]:
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        self._runners.append(runner)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        await web.SockSite(runner, sock).start()
        return [sock.getsockname()[:2]]

    async def stop(self) -> None:
        if self.kubelets is not None:
            await self.kubelets.stop()
        await self.runner.shutdown()
        if self.endpoint is not None:
            await self.endpoint.stop()
        if self.api is not None:
            await self.api.close()
        self.cloud.close()
        for runner in reversed(self._runners):
            await runner.cleanup()
        await self._in_plane_thread(self.plane.stop)
        self._plane_thread.shutdown(wait=True)

    # ------------------------------------------------------------------ admin
    async def _admin_get(self, path: str) -> dict:
        assert self.api is not None
        return await self.api.request(self.plane.admin.token, "GET", path)

    async def state(self) -> dict:
        """The same summary as simcloud's own server, read from the real API server."""
        nodes, phases = cluster_summary(self.kubelets.state() if self.kubelets else [],
                                        (await self._admin_get("/api/v1/nodes")).get("items") or [],
                                        (await self._admin_get("/api/v1/pods")).get("items") or [])
        return {"region": self.fleet.region, "instances": self.cloud.state(), "nodes": nodes, "pods": phases,
                "faults": self.faults.to_dict(), "watches": await self._open_watches(), "kube": "real"}

    async def _open_watches(self) -> dict[str, int]:
        """Watches the API server serves now, per resource, from its metric apiserver_longrunning_requests
        (the controllers' own informers included: compare two readings)."""
        assert self.api is not None
        import aiohttp
        watches: dict[str, int] = {}
        async with self.api.session().get(self.plane.server_url + "/metrics",
                                          headers={"Authorization": f"Bearer {self.plane.admin.token}"},
                                          timeout=aiohttp.ClientTimeout(total=10)) as response:
            text = await response.text()
        for line in text.splitlines():
            if line.startswith("apiserver_longrunning_requests{") and 'verb="WATCH"' in line:
                labels, _, value = line.rpartition(" ")
                resource = labels.split('resource="', 1)[1].split('"', 1)[0]
                watches[resource] = watches.get(resource, 0) + int(float(value))
        return {r: n for r, n in watches.items() if n}

    async def compact(self) -> int:
        """etcd compacted at its current revision, then kube-apiserver restarted (its watch cache is
        rebuilt): a watch resumed from an older resourceVersion is answered 410 Gone, and open
        watches end, as simcloud's own compact does."""
        revision = await self._in_plane_thread(self.plane.compact)
        await self._in_plane_thread(self.plane.restart, "kube-apiserver")
        return revision

    async def issue_token(self, authorization: str | None, namespace: str, name: str) -> str:
        from simcloud.kube.errors import ApiError
        from simcloud.real_control_plane import ControlPlaneError
        if (authorization or "").partition(" ")[2].strip() != self.plane.admin.token:
            raise ApiError(403, "Forbidden", "the admin token is required")
        try:
            return await asyncio.to_thread(self.plane.serviceaccount_token, namespace, name)
        except ControlPlaneError as exc:
            raise ApiError(404 if " 404" in str(exc) else 500, "Failure", str(exc)) from None

    # ------------------------------------------------------------------ workdir files
    @property
    def k8s_url(self) -> str:
        return self.plane.server_url

    @property
    def ecs_endpoint(self) -> str:
        return f"http://{self.host}:{self.ecs_port}"

    def write_files(self) -> None:
        assert self.plane.pki is not None
        fleet, wd = self.fleet, self.workdir
        kubeconfig = wd / "kubeconfig"
        _write(kubeconfig, kubeconfig_text(self.plane.server_url, "admin", self.plane.admin.token,
                                           ca_pem=self.plane.pki.ca_pem), private=True)
        write_ecs_files(wd, fleet, kubeconfig, self.host, self.ecs_port)
        _write(wd / "simcloud.json", json.dumps({
            "pid": os.getpid(), "kube": "real", "k8s_port": self.plane.ports["apiserver"], "ecs_port": self.ecs_port,
            "k8s_url": self.k8s_url, "k8s_https_port": self.plane.ports["apiserver"],
            "k8s_https_url": self.k8s_url, "ecs_endpoint": self.ecs_endpoint,
            "admin_url": f"http://{self.host}:{self.admin_port}{ADMIN_PREFIX}", "region": fleet.region,
            "kubeconfig": str(kubeconfig.resolve()), "control_plane": str(self.plane.workdir)}, indent=2))


def write_ecs_files(wd: Path, fleet: Fleet, kubeconfig: Path, host: str, ecs_port: int) -> None:
    """ecs.json and connections.json (kubernetes_default on `kubeconfig`, alibaba_ecs_default)."""
    _write(wd / "ecs.json", json.dumps({
        "endpoint": f"http://{host}:{ecs_port}", "region": fleet.region,
        "access_key_id": fleet.access_key_id, "access_key_secret": fleet.access_key_secret}, indent=2),
        private=True)
    _write(wd / "connections.json", json.dumps({
        "kubernetes_default": kubernetes_connection(kubeconfig),
        "alibaba_ecs_default": {"conn_type": "gpuboot_ecs", "login": fleet.access_key_id,
                                "password": fleet.access_key_secret,
                                "extra": {"region_id": fleet.region,
                                          # the scheme in the URL, not a 4-character "protocol": "http"
                                          # (Airflow would warn it is too short to mask; gpuboot.hooks.ecs)
                                          "endpoint": f"http://{host}:{ecs_port}"}},
    }, indent=2), private=True)


async def serve(fleet: Fleet, workdir: Path, k8s_port: int = 0, ecs_port: int = 0, seed: int | None = None,
                host: str = "127.0.0.1", kube: str = "simcloud") -> None:
    """Run until SIGTERM/SIGINT."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cloud: Cloud | RealCloud = RealCloud(fleet, workdir, seed, host) if kube == "real" else Cloud(fleet, workdir, seed, host)
    try:
        await cloud.start(k8s_port, ecs_port)
        cloud.write_files()
        # The fleet's objects live as long as the server: frozen, the full collections that
        # request garbage triggers skip them (10,000 nodes and 80,000 pods: pauses of 0.1-0.7 s).
        gc.collect()
        gc.freeze()
        running = sum(1 for n in fleet.nodes if n.status == "Running")
        print(f"simcloud ready: kubernetes {cloud.k8s_url} ({kube}) ecs {cloud.ecs_endpoint} region {fleet.region} "
              f"nodes {len(fleet.nodes)} ({running} running) workdir {workdir}", flush=True)
        await stop.wait()
        log.info("simcloud stopping")
    finally:
        await cloud.stop()
    print("simcloud stopped", flush=True)


def main_serve(fleet: Fleet, workdir: Path, k8s_port: int, ecs_port: int, seed: int | None,
               host: str = "127.0.0.1", kube: str = "simcloud") -> int:
    logging.basicConfig(level=os.environ.get("SIMCLOUD_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(fleet, workdir, k8s_port, ecs_port, seed, host, kube))
    return 0

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
from pathlib import Path

from aiohttp import web

from simcloud.admin import ADMIN_PREFIX, admin_routes
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
from simcloud.machines.containers import ContainerRunner, rfc3339
from simcloud.machines.kubelet import Kubelets
from simcloud.tls import serving_context
from simcloud.workdir import kubeconfig_text, kubernetes_connection
from simcloud.workdir import write_file as _write

log = logging.getLogger("simcloud")


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
        self.kubelets = Kubelets(self.store, self.cloud, self.runner, fleet.timings, fleet.faults,
                                 random.Random(self.rng.random()))
        self.scheduler = Scheduler(self.store)
        self.node_lifecycle = NodeLifecycleController(self.store, fleet.timings)
        self._populate()
        self.auth = Auth(self.store)
        self.k8s_app = make_k8s_app(self.store, self.runner, self.faults, self.auth,
                                    bookmark_seconds=timings.watch_bookmark_seconds,
                                    unadmitted_prefixes=(ADMIN_PREFIX,))
        self.k8s_app.router.add_routes(admin_routes(self.faults, self.state, self.store.compact, self.auth))
        self.ecs_app = make_ecs_app(self.cloud, {fleet.access_key_id: fleet.access_key_secret}, self.faults,
                                    rng=random.Random(self.rng.random()))
        self._runners: list[web.AppRunner] = []
        self.k8s_port = self.k8s_https_port = self.ecs_port = 0
        self.ca_pem = b""

    def _populate(self) -> None:
        fleet = self.fleet
        for t in fleet.instance_types.values():   # a fleet TypeSpec is an ECS InstanceType
            self.cloud.add_instance_type(t)
        now = rfc3339()
        if fleet.pods_per_node:
            self.store.create("namespaces", {"metadata": {"name": BENCH_NAMESPACE}})
        for spec in fleet.nodes:
            self.cloud.add_instance(ecs_instance(spec, fleet.region))
            running = spec.status == "Running"
            self.kubelets.register(spec, node_object(spec, fleet.region, new_boot_id(self.rng)), running)
            if running:
                for i in range(fleet.pods_per_node):
                    self.store.create("pods", placeholder_pod(spec.name, i, spec.private_ip, now))

    def state(self) -> dict:
        """Instances, nodes (API view joined with the kubelet's own) and pod counts."""
        kubelet = {k["name"]: k for k in self.kubelets.state()}
        nodes = []
        for obj in self.store.peek("nodes"):
            status = obj.get("status") or {}
            ready = next((c["status"] for c in status.get("conditions") or [] if c["type"] == "Ready"), "Unknown")
            nodes.append({**kubelet.get(obj["metadata"]["name"], {"name": obj["metadata"]["name"]}),
                          "ready": ready, "provider_id": obj["spec"].get("providerID"),
                          "allocatable_gpu": (status.get("allocatable") or {}).get("nvidia.com/gpu"),
                          "node_boot_id": (status.get("nodeInfo") or {}).get("bootID"),
                          "taints": [f"{t['key']}:{t['effect']}" for t in obj["spec"].get("taints") or []]})
        phases: dict[str, int] = {}
        for pod in self.store.peek("pods"):
            phase = (pod.get("status") or {}).get("phase", "Pending")
            phases[phase] = phases.get(phase, 0) + 1
        return {"region": self.fleet.region, "instances": self.cloud.state(), "nodes": nodes, "pods": phases,
                "faults": self.faults.to_dict(), "watches": self.store.open_watches()}

    async def start(self, k8s_port: int = 0, ecs_port: int = 0, k8s_https_port: int = 0) -> None:
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
        _write(wd / "ecs.json", json.dumps({
            "endpoint": self.ecs_endpoint, "region": fleet.region,
            "access_key_id": fleet.access_key_id, "access_key_secret": fleet.access_key_secret}, indent=2),
            private=True)
        _write(wd / "connections.json", json.dumps({
            "kubernetes_default": kubernetes_connection(kubeconfig),
            "alibaba_ecs_default": {"conn_type": "alibaba_cloud", "login": fleet.access_key_id,
                                    "password": fleet.access_key_secret,
                                    "extra": {"region_id": fleet.region,
                                              # the scheme in the URL, not a 4-character "protocol": "http"
                                              # (Airflow would warn it is too short to mask; gpuboot.hooks.ecs)
                                              "endpoint": f"http://{self.host}:{self.ecs_port}"}},
        }, indent=2), private=True)
        _write(wd / "simcloud.json", json.dumps({
            "pid": os.getpid(), "k8s_port": self.k8s_port, "ecs_port": self.ecs_port, "k8s_url": self.k8s_url,
            "k8s_https_port": self.k8s_https_port, "k8s_https_url": self.k8s_https_url,
            "ecs_endpoint": self.ecs_endpoint, "admin_url": self.k8s_url + ADMIN_PREFIX, "region": fleet.region,
            "kubeconfig": str(kubeconfig.resolve())}, indent=2))


async def serve(fleet: Fleet, workdir: Path, k8s_port: int = 0, ecs_port: int = 0, seed: int | None = None,
                host: str = "127.0.0.1") -> None:
    """Run until SIGTERM/SIGINT."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cloud = Cloud(fleet, workdir, seed, host)
    try:
        await cloud.start(k8s_port, ecs_port)
        cloud.write_files()
        # The fleet's objects live as long as the server: frozen, the full collections that
        # request garbage triggers skip them (10,000 nodes and 80,000 pods: pauses of 0.1-0.7 s).
        gc.collect()
        gc.freeze()
        running = sum(1 for n in fleet.nodes if n.status == "Running")
        print(f"simcloud ready: kubernetes {cloud.k8s_url} ecs {cloud.ecs_endpoint} region {fleet.region} "
              f"nodes {len(fleet.nodes)} ({running} running) workdir {workdir}", flush=True)
        await stop.wait()
        log.info("simcloud stopping")
    finally:
        await cloud.stop()
    print("simcloud stopped", flush=True)


def main_serve(fleet: Fleet, workdir: Path, k8s_port: int, ecs_port: int, seed: int | None,
               host: str = "127.0.0.1") -> int:
    logging.basicConfig(level=os.environ.get("SIMCLOUD_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(fleet, workdir, k8s_port, ecs_port, seed, host))
    return 0

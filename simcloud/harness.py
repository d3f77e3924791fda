"""Test helpers: run `python -m simcloud serve` as a subprocess and talk to it with real clients.

    from simcloud.harness import SimCloud, small_fleet, wait_until

    with SimCloud.start(small_fleet(), tmp_path) as cloud:
        v1 = cloud.core_v1()                       # kubernetes.client.CoreV1Api on cloud.kubeconfig
        ecs = cloud.ecs_client()                   # alibabacloud_ecs20140526 Client on cloud.ecs
        cloud.set_faults(never_ready=["gpu-1"])    # PATCH /_simcloud/faults
        sa = cloud.serviceaccount_kubeconfig("gpuboot", "gpuboot")   # act as a ServiceAccount (RBAC applies)
        product = cloud.gpuboot_connections()      # deploy/kubernetes/ applied; Airflow connections as its SA
        v1_sa = cloud.core_v1(sa)
        wait_until(lambda: cloud.node_ready("cpu-1"), timeout=5)

The product never imports this module (nor anything else in simcloud).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import yaml

from simcloud import admin

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[1]

# Fast emulated timings for tests (seconds): a boot with GPUs takes about one second, a stopped node
# is Unknown and tainted two seconds after its last Lease renewal, its pods evicted 3 s after that.
FAST_TIMINGS = {"start_seconds": 0.2, "stop_seconds": 0.2, "boot_seconds": 0.3, "stale_seconds": 0.3,
                "device_plugin_seconds": 0.3, "heartbeat_seconds": 0.5, "pod_start_seconds": 0.1,
                "lease_renew_seconds": 0.25, "node_monitor_period_seconds": 0.1,
                "node_monitor_grace_seconds": 2.0, "default_toleration_seconds": 3}

# Real Alibaba Cloud instance types (vCPU, GiB, GPUs). Prices (what DescribePrice answers, USD per hour,
# pay-as-you-go) are indicative, not Alibaba Cloud's list: looked up on 2026-12-01, no authoritative list
# price was found; the one figure seen, ecs.gn6i-c4g1.xlarge at 1.152/h (NexusGPU/tensor-fusion's
# internal/cloudprovider/alibaba, itself labelled mock data), is close to the 1.2 used here.
INSTANCE_TYPES = {
    "ecs.g7.xlarge": {"cpu": 4, "memory_gib": 16, "price_per_hour": 0.2},
    "ecs.g7.2xlarge": {"cpu": 8, "memory_gib": 32, "price_per_hour": 0.4},
    "ecs.gn6i-c4g1.xlarge": {"cpu": 4, "memory_gib": 15, "gpu": 1, "gpu_spec": "NVIDIA T4", "price_per_hour": 1.2},
    "ecs.gn6i-c8g1.2xlarge": {"cpu": 8, "memory_gib": 31, "gpu": 1, "gpu_spec": "NVIDIA T4", "price_per_hour": 1.4},
    "ecs.gn6i-c24g1.12xlarge": {"cpu": 48, "memory_gib": 186, "gpu": 2, "gpu_spec": "NVIDIA T4",
                                "price_per_hour": 4.2},
    "ecs.gn7i-c8g1.2xlarge": {"cpu": 8, "memory_gib": 30, "gpu": 1, "gpu_spec": "NVIDIA A10", "price_per_hour": 2.1},
    "ecs.gn7i-c32g1.16xlarge": {"cpu": 64, "memory_gib": 376, "gpu": 2, "gpu_spec": "NVIDIA A10",
                                "price_per_hour": 6.5},
    "ecs.gn6v-c8g1.2xlarge": {"cpu": 8, "memory_gib": 32, "gpu": 1, "gpu_spec": "NVIDIA V100", "price_per_hour": 2.6},
    "ecs.gn6v-c8g1.8xlarge": {"cpu": 32, "memory_gib": 128, "gpu": 4, "gpu_spec": "NVIDIA V100",
                              "price_per_hour": 10.4},
}
DEFAULT_NODES = [
    {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"},
    {"name": "gpu-t4-1", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Stopped"},
]
MANAGED = {"labels": {"gpuboot.io/managed": "true"}, "tags": {"gpuboot:managed": "true"}}
# What the product ships for its own identity in a cluster (the job namespaces, its ServiceAccount
# and least-privilege RBAC), and the ServiceAccount that RBAC binds.
GPUBOOT_MANIFESTS = (REPO_ROOT / "deploy/kubernetes/namespace.yaml", REPO_ROOT / "deploy/kubernetes/rbac.yaml")
GPUBOOT_SERVICEACCOUNT = ("gpuboot", "gpuboot")
PLACER_SERVICEACCOUNT = ("gpuboot", "gpuboot-placer")
# API Priority and Fairness for those two: only a real kube-apiserver has it (simcloud's runs every request
# as it comes, one write at a time under its lock: no queue protects anyone there, which is the harsher side)
FLOW_CONTROL = REPO_ROOT / "deploy/kubernetes/flowcontrol.yaml"


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05,
               message: str | Callable[[], str] | None = None) -> T:
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes (TimeoutError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise TimeoutError(text or f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)


def pod_log(v1, name: str, namespace: str = "default", **params) -> str:
    """A pod's log as text through a `kubernetes` CoreV1Api. kubernetes 36.0.x turns a preloaded text
    body into "b'...'" (kubernetes-client/python#2596), so read the raw body, as KubernetesPodOperator does."""
    return v1.read_namespaced_pod_log(name, namespace, _preload_content=False, **params).data.decode()


@contextlib.contextmanager
def interrupts_held() -> Iterator[Callable[[], None]]:
    """Ctrl-C and SIGTERM held back until `release()`, which raises one that came meanwhile: around
    starting a child, so that an interrupt inside Popen (after the fork, before the caller's `try`)
    cannot leave the child running with nobody to stop it. The handler that holds them is Python's,
    so the child still gets the default disposition at exec. Signals reach only the main thread, so
    elsewhere this holds nothing."""
    held: list[int] = []
    previous: dict = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda sig, _frame: held.append(sig))
                    for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        while previous:
            sig, handler = previous.popitem()
            signal.signal(sig, handler)

    def release() -> None:
        restore()
        if held:
            signal.raise_signal(held[0])

    try:
        yield release
    finally:
        restore()     # not released (a failure before): the handlers back, nothing raised


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone). A process reaped between
    the open and the read makes the read fail with ESRCH (ProcessLookupError): gone too."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def small_fleet(nodes: list[dict] | None = None, *, timings: dict | None = None, faults: dict | None = None,
                region: str = "cn-hangzhou", zone: str = "cn-hangzhou-h", managed: bool = True,
                pods_per_node: int = 0) -> dict:
    """A fleet dict with fast timings. `nodes` entries need only name/instance_type/status (types from
    INSTANCE_TYPES); GPU nodes are opted in to management (label + tag) unless `managed=False`."""
    nodes = [dict(n) for n in (nodes or DEFAULT_NODES)]
    for node in nodes:
        node.setdefault("zone", zone)
        node.setdefault("status", "Stopped")
        if managed and INSTANCE_TYPES.get(node["instance_type"], {}).get("gpu"):
            node["labels"] = {**MANAGED["labels"], **node.get("labels", {})}
            node["tags"] = {**MANAGED["tags"], **node.get("tags", {})}
    used = {n["instance_type"] for n in nodes}
    return {
        "region": region,
        "credentials": {"access_key_id": "LTAI-simcloud-test", "access_key_secret": "test-secret-not-for-logs"},
        "timings": {**FAST_TIMINGS, **(timings or {})},
        "faults": dict(faults or {}),
        "pods_per_node": pods_per_node,
        "instance_types": {t: INSTANCE_TYPES[t] for t in sorted(used) if t in INSTANCE_TYPES},
        "nodes": nodes,
    }


KUBE_ENV = "GPUBOOT_KUBE"


def default_kube() -> str:
    """The Kubernetes backend a SimCloud starts unless told: $GPUBOOT_KUBE ("simcloud" or "real")."""
    kube = os.environ.get(KUBE_ENV) or "simcloud"
    if kube not in ("simcloud", "real"):
        raise ValueError(f"${KUBE_ENV}={kube!r}: expected 'simcloud' or 'real'")
    return kube


class SimCloud:
    """A running `python -m simcloud serve` subprocess and the files it wrote."""

    def __init__(self, workdir: Path, process: subprocess.Popen, log_path: Path) -> None:
        self.workdir, self.process, self.log_path = Path(workdir), process, log_path
        self.info = json.loads((self.workdir / "simcloud.json").read_text())
        self.kube: str = self.info.get("kube", "simcloud")
        self.ecs = json.loads((self.workdir / "ecs.json").read_text())
        self.kubeconfig = self.workdir / "kubeconfig"
        self.connections_file = self.workdir / "connections.json"
        self.k8s_url: str = self.info["k8s_url"]
        self.ecs_endpoint: str = self.ecs["endpoint"]
        self.region: str = self.ecs["region"]
        self._api_client = None

    @classmethod
    @contextlib.contextmanager
    def start(cls, fleet: dict | str | Path, workdir: Path, *, ready_timeout: float = 30.0,
              stop_timeout: float = 10.0, seed: int | None = None, extra_args: list[str] | None = None,
              kube: str | None = None) -> Iterator[SimCloud]:
        """Start the server, wait for `simcloud ready` (or fail with its log), stop it on exit.

        kube: "simcloud" (its own API server) or "real" (the real control plane, `make controlplane`);
        default $GPUBOOT_KUBE, else "simcloud". The real one takes longer to start and to stop."""
        kube = kube or default_kube()
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        fleet_path = cls._fleet_file(fleet, workdir)
        log_path = workdir / "simcloud.log"
        args = [sys.executable, "-m", "simcloud", "serve", "--fleet", str(fleet_path), "--workdir", str(workdir)]
        if kube != "simcloud":
            args += ["--kube", kube]
            ready_timeout, stop_timeout = max(ready_timeout, 150.0), max(stop_timeout, 60.0)
        if seed is not None:
            args += ["--seed", str(seed)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                         os.environ.get("PYTHONPATH")]))}
        with interrupts_held() as release:
            with open(log_path, "wb") as log:
                process = subprocess.Popen(args + (extra_args or []), stdout=log, stderr=subprocess.STDOUT,
                                           cwd=REPO_ROOT, env=env)
            try:
                release()      # an interrupt while the server started is raised here, where it is stopped
                wait_until(lambda: process.poll() is not None or b"simcloud ready" in log_path.read_bytes(),
                           timeout=ready_timeout, interval=0.05,
                           message=lambda: f"simcloud not ready in {ready_timeout}s:\n{_tail(log_path)}")
                if process.poll() is not None:
                    raise RuntimeError(f"simcloud exited with {process.returncode}:\n{_tail(log_path)}")
                cloud = cls(workdir, process, log_path)
            except BaseException:
                _terminate(process, stop_timeout)
                raise
        try:
            yield cloud
        finally:
            cloud.stop(stop_timeout)

    @staticmethod
    def _fleet_file(fleet: dict | str | Path, workdir: Path) -> Path:
        if isinstance(fleet, dict):
            path = workdir / "fleet.yaml"
            path.write_text(yaml.safe_dump(fleet, sort_keys=False))
            return path
        return Path(fleet).resolve()

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        return _terminate(self.process, timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    # -- admin --------------------------------------------------------------
    def set_faults(self, **changes) -> dict:
        return admin.set_faults(self.workdir, **changes)

    def faults(self) -> dict:
        return admin.get_faults(self.workdir)

    def state(self) -> dict:
        return admin.get_state(self.workdir)

    def compact(self) -> int:
        """Drop the watch history and end open watches (resuming watchers get 410 Gone)."""
        return admin.compact(self.workdir)

    def serviceaccount_token(self, namespace: str, name: str) -> str:
        """A bearer token of an existing ServiceAccount (POST /_simcloud/serviceaccount-token)."""
        return admin.serviceaccount_token(self.workdir, namespace, name)

    def serviceaccount_kubeconfig(self, namespace: str, name: str, *, connections: bool = False,
                                  context_namespace: str = "default") -> Path:
        """A kubeconfig acting as ServiceAccount `namespace/name` (and, with `connections`, a
        `connections-<ns>-<name>.json` beside it whose kubernetes_default uses it)."""
        kubeconfig = self.workdir / f"kubeconfig-{namespace}-{name}"
        admin.write_serviceaccount_files(self.workdir, namespace, name, kubeconfig,
                                         self.serviceaccount_connections_file(namespace, name) if connections else None,
                                         context_namespace)
        return kubeconfig

    def serviceaccount_connections_file(self, namespace: str, name: str) -> Path:
        return self.workdir / f"connections-{namespace}-{name}.json"

    def apply(self, *manifests: Path | str) -> None:
        """Create every object of these YAML files as the admin (see simcloud.admin.apply_manifests)."""
        admin.apply_manifests(self.workdir, *manifests, api_client=self.api_client())

    def gpuboot_connections(self, manifests: tuple[Path | str, ...] = GPUBOOT_MANIFESTS,
                            account: tuple[str, str] = GPUBOOT_SERVICEACCOUNT) -> Path:
        """Airflow connections for the product, acting as a ServiceAccount deploy/kubernetes/rbac.yaml
        binds (the steps' unless told; PLACER_SERVICEACCOUNT for the placer): the shipped manifests created
        as the admin (on the first call), then a connections file whose kubernetes_default carries that
        ServiceAccount's token (ECS as in connections.json). The harness keeps the admin identity
        (`kubeconfig`, `core_v1()`), so a verb missing from the shipped RBAC fails the product, not the
        test's own reads."""
        path = self.serviceaccount_connections_file(*account)
        if not path.exists():
            self.apply(*manifests)
            self.serviceaccount_kubeconfig(*account, connections=True)
        return path

    def placer_connections(self) -> Path:
        """`gpuboot_connections` for the placer's ServiceAccount (rbac.yaml's gpuboot-placer)."""
        return self.gpuboot_connections(account=PLACER_SERVICEACCOUNT)

    def apply_flow_control(self) -> bool:
        """deploy/kubernetes/flowcontrol.yaml, where the API server has priority and fairness (the real one):
        whether it was applied."""
        if self.kube != "real":
            return False
        self.apply(FLOW_CONTROL)
        return True

    def instance_id(self, node_name: str) -> str:
        return next(n["instance_id"] for n in self.state()["nodes"] if n["name"] == node_name)

    # -- clients ------------------------------------------------------------
    def api_client(self):
        """A `kubernetes` ApiClient on the kubeconfig (one per SimCloud, reused)."""
        if self._api_client is None:
            from kubernetes import config
            self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    def core_v1(self, kubeconfig: Path | None = None):
        """CoreV1Api as the admin (the workdir's kubeconfig) or as the identity of `kubeconfig`."""
        from kubernetes import client, config
        if kubeconfig is None:
            return client.CoreV1Api(self.api_client())
        return client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))

    def ecs_client(self):
        from alibabacloud_ecs20140526.client import Client
        from alibabacloud_tea_openapi import models as open_api_models
        return Client(open_api_models.Config(
            access_key_id=self.ecs["access_key_id"], access_key_secret=self.ecs["access_key_secret"],
            endpoint=self.ecs_endpoint.removeprefix("http://"), protocol="http", region_id=self.region))

    def node_ready(self, name: str) -> bool:
        node = self.core_v1().read_node(name)
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def _terminate(process: subprocess.Popen, timeout: float) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"

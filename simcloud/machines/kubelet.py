"""The emulated kubelets: what each Node's machine does when ECS powers it on or off.

One `Kubelets` object stands for every node's kubelet (one heartbeat loop and one pod
watch for the whole fleet, so 2,000 nodes stay cheap). Per node it follows the ECS
instance through `EcsCloud.add_listener`:

* Stopped or stopping: the kubelet is simply gone. It writes nothing more, renews no Lease,
  and its containers die with the machine; the pods keep their last status (Running) in
  the API. What the cluster makes of that is the node-lifecycle controller's business
  (simcloud.kube.node_lifecycle: Ready=True until the grace period, then Unknown and tainted,
  pods evicted after their tolerations and left Terminating). With `shutdown_grace_seconds`
  > 0 (the kubelet's graceful node shutdown) it first kills the pods and fails them
  (reason Terminated, "Pod was terminated in response to imminent node shutdown.").
* Started, in the default "stale-first" order (what the seed saw in the field): after
  `boot_seconds` Ready=True with a new bootID, the extended resources' counts still stale;
  after `stale_seconds` every one of them is zeroed (one write, as the kubelet's
  reconcileExtendedResource does); then each device plugin registers its real count, one
  write each: nvidia.com/gpu `device_plugin_seconds` later, every further plugin (GPU
  sharing's `aliyun.com/gpu-mem`, a declared RDMA device...) `device_plugin_seconds` after
  the one before it (harsher than plugins that happen to start together: a rule that checks
  only nvidia.com/gpu is caught). A watcher sees stale -> 0 -> real for each resource. In
  the "kubelet" order (fault `boot_order`, per node or "*"), as a restarted kubelet
  writes it: the registration patch zeroing extended resources (old bootID), the new bootID
  with Ready=False, Ready=True `stale_seconds` later, the plugins' counts from
  `device_plugin_seconds` after Ready (a plugin's pod needs a Ready node). Faults
  `gpu_reset_delay_seconds` and `gpu_register_delay_seconds` (per node) push the zero and
  every registration later; `resource_register_delay_seconds` (per resource name) delays one
  plugin. Either way the not-ready / unreachable taints are removed by the controller, after
  Ready=True. The resources each node's plugins serve are the fleet's (`NodeSpec.device_resources`).
  Back up, the kubelet finishes the deletions that waited for it and fails the pods it ran
  before the power went (their containers did not survive it).

Node status: every status write of the kubelet carries a fresh lastHeartbeatTime, and
when nothing changed it rewrites the status every `heartbeat_seconds` (its
nodeStatusReportFrequency, 5 min by default). Node Lease: like a real kubelet, each node
holds the coordination.k8s.io/v1 Lease of its name in namespace `kube-node-lease` (created
at registration, owned by the Node) and renews it (`spec.renewTime`) every
`lease_renew_seconds` (10 s) while it is up; a stopped node's Lease keeps its last renewTime.

Faults `never_ready` / `device_plugin_never` (instance id or node name) are read when
the step is due and re-checked at every Lease renewal, so clearing one lets the boot go on.

Pods bound to a node run only while its kubelet is up. Admission follows the kubelet's
device manager: a pod asking for more of a device plugin's resource (nvidia.com/gpu,
aliyun.com/gpu-mem, any declared one) than that plugin has registered and left free fails
with UnexpectedAdmissionError, whatever the Node object says; an extended resource no plugin
of the node serves is checked against the Node's allocatable, as the kubelet's predicate
admission does (reason OutOf<resource>). Admitted pods' containers run through `simcloud.machines.containers`; restartPolicy
Always/OnFailure restart containers with a short doubling back-off (pod_start_seconds,
capped at 10 s). Deleting a pod kills its processes (SIGTERM, SIGKILL after the grace
period) and then removes it; a pod that never ran is removed at once, and one whose node
is down stays Terminating until the kubelet is back (or it is force-deleted).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import math
import random
import time
from dataclasses import dataclass, field

from simcloud.config import Faults, Timings
from simcloud.ecs.model import EcsCloud, Instance
from simcloud.fleet import PLACEHOLDER_ANNOTATION, NodeSpec, new_boot_id
from simcloud.kube.admission import extended_requests
from simcloud.kube.admission import parse_quantity as parse_count
from simcloud.kube.errors import ApiError
from simcloud.kube.node_lifecycle import LEASE_NAMESPACE, UNREACHABLE, set_lifecycle_taint, set_unknown
from simcloud.machines.api import KubeletApi
from simcloud.machines.containers import (
    EXIT_START_ERROR,
    CannotRun,
    Container,
    ContainerRunner,
    rfc3339,
    secret_refs,
)

log = logging.getLogger(__name__)

GPU = "nvidia.com/gpu"
GPU_MEM = "aliyun.com/gpu-mem"
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
LEASE_SECONDS = 40          # the kubelet's nodeLeaseDurationSeconds; it renews every quarter of it
_HEALTHY = (
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
)
_TERMINAL = ("Succeeded", "Failed")


def admission_message(requested: int, available: int, resource: str = GPU) -> str:
    """The kubelet device manager's words when a device plugin has too few devices."""
    return ("Pod Update plugin resources failed due to requested number of devices unavailable for "
            f"{resource}. Requested: {requested}, Available: {available}, which is unexpected.")


def gpu_request(pod: dict) -> int:
    """nvidia.com/gpu the pod needs: max(sum of containers, largest init container); limits imply requests."""
    return extended_requests(pod).get(GPU, 0)


@dataclass
class _Pod:
    uid: str
    namespace: str
    name: str
    admitted: bool = False
    gpus: list[int] = field(default_factory=list)          # device indices held
    held: dict[str, int] = field(default_factory=dict)     # other device plugin resources held
    pod_ip: str = ""
    start_time: str = ""
    statuses: dict[str, dict] = field(default_factory=dict)       # container name -> containerStatus
    init_statuses: dict[str, dict] = field(default_factory=dict)
    running: dict[str, Container] = field(default_factory=dict)
    task: asyncio.Task | None = None
    closing: bool = False                                  # being deleted or shut down
    lost: bool = False                                     # its containers died with the machine


@dataclass
class _Node:
    spec: NodeSpec
    index: int
    up: bool = False               # kubelet running and Ready posted
    boot_id: str = ""
    generation: int = 0            # bumped on every power change: pending boot steps of older ones lapse
    blocked: str | None = None     # "ready" / "plugin": a fault holds the boot at that step
    registered: dict[str, int] = field(default_factory=dict)   # what the device plugins registered (its own view)
    pods: dict[str, _Pod] = field(default_factory=dict)   # uid -> pod known to this kubelet
    finished: set[str] = field(default_factory=set)       # uids this kubelet has completed or rejected
    next_ip: int = 2
    uid: str = ""
    reported: float = 0.0          # monotonic time of the kubelet's last Node status write
    steps: asyncio.Lock = field(default_factory=asyncio.Lock)   # its boot steps run one at a time
    renewing: bool = False         # a Lease renewal is on its way (a slow API server gets no second one)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def gpus(self) -> int:
        return self.spec.instance_type.gpu

    @property
    def plugins(self) -> dict[str, int]:
        """resource -> count, in the order the device plugins register after a boot."""
        return self.spec.device_resources()

    def free_devices(self) -> list[int]:
        held = {i for p in self.pods.values() for i in p.gpus}
        return [i for i in range(self.registered.get(GPU, 0)) if i not in held]

    def free(self, resource: str) -> int:
        if resource == GPU:
            return len(self.free_devices())
        return self.registered.get(resource, 0) - sum(p.held.get(resource, 0) for p in self.pods.values())

    def new_pod_ip(self) -> str:
        """A loopback address of its own per pod (127.16.0.0/12 and up; on Linux every 127.0.0.0/8
        address is bindable on `lo`): processes of different pods can each listen on the same port
        at their own pod IP and reach each other there, as pods on a real pod network do."""
        ip = f"127.{16 + self.index // 256}.{self.index % 256}.{self.next_ip}"
        self.next_ip = self.next_ip + 1 if self.next_ip < 254 else 2
        return ip


class Kubelets:
    """Every Node's kubelet, driven by ECS power changes and the pods bound to the node."""

    def __init__(self, api: KubeletApi, cloud: EcsCloud, runner: ContainerRunner, timings: Timings,
                 faults: Faults, rng: random.Random | None = None) -> None:
        self.api, self.cloud, self.runner = api, cloud, runner
        self.timings, self.faults = timings, faults
        self.rng = rng or random.Random()
        self._nodes: dict[str, _Node] = {}
        self._by_instance: dict[str, _Node] = {}
        self._tasks: set[asyncio.Task] = set()
        self._queue = None
        cloud.add_listener(self._on_instance)

    # ------------------------------------------------------------------ nodes
    def add(self, spec: NodeSpec) -> None:
        """Serve node `spec` (before `register`): its power changes are followed from now on."""
        node = _Node(spec=spec, index=len(self._nodes))
        self._nodes[spec.name] = self._by_instance[spec.instance_id] = node

    def _api(self, node: _Node) -> KubeletApi:
        return self.api.for_node(node.name)

    async def register(self, spec: NodeSpec, node_obj: dict, running: bool) -> None:
        """Create the Node as its kubelet registers it, Ready=False (so the not-ready taint that
        admission adds stays until a Ready=True is posted), then, for a running machine, post
        Ready=True; a stopped one is left as the node-lifecycle controller leaves it: Unknown,
        tainted unreachable."""
        if spec.name not in self._nodes:
            self.add(spec)
        node = self._nodes[spec.name]
        now = rfc3339()
        node.boot_id = node_obj["status"]["nodeInfo"]["bootID"]
        if running:
            _set_not_ready(node_obj, now, node.boot_id)
        else:       # stopped long ago: as the node-lifecycle controller left it
            set_unknown(node_obj, now)
            for effect in ("NoSchedule", "NoExecute"):
                set_lifecycle_taint(node_obj, UNREACHABLE, effect, now)
        node.reported = time.monotonic()
        node.uid = (await self._api(node).create("nodes", node_obj))["metadata"]["uid"]
        await self._renew_lease(node, micro_time())
        if running:
            node.up, node.registered = True, dict(node.plugins)
            await self._post_status(node, lambda obj: _set_ready(obj, rfc3339(), node.boot_id))

    async def _renew_lease(self, node: _Node, now: str) -> None:
        """Set the node Lease's renewTime to `now`, creating the Lease when it is missing (as kubelets do)."""
        try:
            await self._api(node).mutate("leases", LEASE_NAMESPACE, node.name, lambda lease: lease["spec"].update(renewTime=now))
            return
        except ApiError as exc:
            if exc.code != 404:
                log.warning("kubelet %s: cannot renew lease: %s", node.name, exc)
                return
        # a period of 4 renewals keeps a slowly renewing fleet's leases valid between renewals
        duration = max(LEASE_SECONDS, math.ceil(4 * self.timings.lease_renew_seconds))
        with contextlib.suppress(ApiError):   # created meanwhile, or the Node is gone
            await self._api(node).create("leases", {
            "metadata": {"name": node.name, "namespace": LEASE_NAMESPACE, "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid}]},
                "spec": {"holderIdentity": node.name, "leaseDurationSeconds": duration, "renewTime": now}})

    async def _renew_in_turn(self, node: _Node, now: str) -> None:
        try:
            await self._renew_lease(node, now)
        finally:
            node.renewing = False

    async def _write_node(self, node: _Node, fn) -> None:
        try:
            await self._api(node).mutate("nodes", None, node.name, fn)
        except ApiError as exc:   # someone deleted the Node: the kubelet has nothing to report to
            log.warning("kubelet %s: cannot update node: %s", node.name, exc)

    async def _post_status(self, node: _Node, fn) -> None:
        """A node status update: `fn`'s change plus a fresh lastHeartbeatTime on every condition."""
        now = rfc3339()

        def update(obj: dict) -> None:
            fn(obj)
            _beat(obj, now)
        node.reported = time.monotonic()
        await self._write_node(node, update)

    def _later(self, node: _Node, delay: float, step) -> None:
        generation = node.generation
        asyncio.get_running_loop().call_later(
            max(delay, 0.0), lambda: generation == node.generation and self._spawn(self._step(node, generation, step)))

    async def _step(self, node: _Node, generation: int, step) -> None:
        """One boot step at a time per node, in the order they fell due; one of an older power cycle lapses."""
        async with node.steps:
            if generation == node.generation:
                await step(node)

    def _faulty(self, key: str, node: _Node) -> bool:
        return self.faults.matches(key, node.spec.instance_id, node.name)

    def _on_instance(self, instance: Instance, old: str, new: str) -> None:
        node = self._by_instance.get(instance.instance_id)
        if node is None:
            return
        if new == "Running":
            node.generation += 1
            self._later(node, self.timings.boot_seconds, self._boot)
        elif new in ("Stopping", "Stopped") and (node.up or node.blocked or old in ("Running", "Starting")):
            self._power_off(node)

    async def _boot(self, node: _Node) -> None:
        if self._faulty("never_ready", node):
            node.blocked = "ready"
            return
        node.blocked, node.registered = None, {}
        node.boot_id = new_boot_id(self.rng)
        if self._boot_order(node) == "kubelet":
            self._later(node, self._delay("gpu_reset_delay_seconds", node), self._register_node)
            return
        await self._post_ready(node)
        if node.plugins:
            self._later(node, self.timings.stale_seconds + self._delay("gpu_reset_delay_seconds", node),
                        self._zero_resources)

    def _boot_order(self, node: _Node) -> str:
        return self.faults.for_node("boot_order", "stale-first", node.name, node.spec.instance_id)

    def _delay(self, key: str, node: _Node) -> float:
        return float(self.faults.for_node(key, 0.0, node.name, node.spec.instance_id))

    async def _register_node(self, node: _Node) -> None:
        """The "kubelet" order: the restarted kubelet's registration patch zeroes the extended
        resources (bootID and conditions still the old ones), then it posts the new bootID with
        Ready=False (runtime not checked yet) and, `stale_seconds` later, Ready=True."""
        if node.plugins:
            await self._write_node(node, lambda obj: _set_counts(obj, dict.fromkeys(node.plugins, 0)))
        self._later(node, min(0.2, self.timings.stale_seconds / 2), self._post_not_ready)

    async def _post_not_ready(self, node: _Node) -> None:
        now = rfc3339()
        await self._post_status(node, lambda obj: _set_not_ready(obj, now, node.boot_id))
        await self._event_node(node, "Starting", "Starting kubelet.")
        self._later(node, self.timings.stale_seconds, self._post_ready)

    async def _post_ready(self, node: _Node) -> None:
        node.up = True
        now = rfc3339()
        await self._post_status(node, lambda obj: _set_ready(obj, now, node.boot_id))
        await self._renew_lease(node, micro_time())
        await self._finish_lost_pods(node)
        if self._boot_order(node) != "kubelet":
            await self._event_node(node, "Starting", "Starting kubelet.")
        await self._event_node(node, "Rebooted", f"Node {node.name} has been rebooted, boot id: {node.boot_id}",
                               "Warning")
        await self._event_node(node, "NodeReady", f"Node {node.name} status is now: NodeReady")
        await self._admit_waiting(node)
        if node.plugins and self._boot_order(node) == "kubelet":    # the plugins' pods start once the node is Ready
            self._later_register(node)

    async def _zero_resources(self, node: _Node) -> None:
        await self._post_status(node, lambda obj: _set_counts(obj, dict.fromkeys(node.plugins, 0)))
        self._later_register(node)

    def _later_register(self, node: _Node) -> None:
        """Each device plugin registers `device_plugin_seconds` after the one before it (the first
        that long after now), plus the node's and the resource's delay faults."""
        base = self._delay("gpu_register_delay_seconds", node)
        for i, resource in enumerate(node.plugins):
            extra = float(self.faults.for_node("resource_register_delay_seconds", 0.0, resource))
            self._later(node, self.timings.device_plugin_seconds * (i + 1) + base + extra,
                        functools.partial(self._register, resource=resource))

    async def _register(self, node: _Node, resource: str) -> None:
        if self._faulty("device_plugin_never", node):
            node.blocked = "plugin"
            return
        count = node.plugins[resource]
        node.registered[resource] = count
        if set(node.registered) >= set(node.plugins):
            node.blocked = None
        await self._post_status(node, lambda obj: _set_counts(obj, {resource: count}))

    def _power_off(self, node: _Node) -> None:
        """The machine goes down: the kubelet stops writing; its containers die, unreported
        (unless graceful node shutdown is configured, which fails the pods first)."""
        node.generation += 1
        node.up, node.blocked, node.registered = False, None, {}
        graceful = self.timings.shutdown_grace_seconds > 0
        for pod in list(node.pods.values()):
            if pod.admitted and not pod.closing:
                self._spawn(self._shutdown_pod(node, pod) if graceful else self._lose_pod(pod))

    async def _lose_pod(self, p: _Pod) -> None:
        p.closing = p.lost = True
        if p.task is not None:
            p.task.cancel()
        await self._stop_containers(p, 0)

    async def _finish_lost_pods(self, node: _Node) -> None:
        """Back up after a power loss: deletions that waited for the kubelet complete; pods that were
        running are Failed, their containers killed (exit 137) with the machine."""
        for pod in list(self._api(node).peek("pods")):
            meta = pod["metadata"]
            if (pod.get("spec") or {}).get("nodeName") == node.name and meta.get("deletionTimestamp"):
                node.pods.pop(meta.get("uid", ""), None)
                await self._remove(node, meta)
        for p in [p for p in node.pods.values() if p.lost]:
            for status in list(p.statuses.values()) + list(p.init_statuses.values()):
                if "terminated" not in status["state"]:
                    status["state"] = {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": rfc3339()}}
                status.update(ready=False, started=False)
            await self._finish(node, p, "Failed")

    async def _heartbeats(self) -> None:
        """One loop for all nodes: Lease renewals and status reports of up ones, and boot steps
        a cleared fault unblocks."""
        while True:
            await asyncio.sleep(max(min(self.timings.lease_renew_seconds, self.timings.heartbeat_seconds), 0.05))
            renewed, clock = micro_time(), time.monotonic()
            for i, node in enumerate(list(self._nodes.values())):
                if node.up:
                    if clock - node.reported >= self.timings.heartbeat_seconds:
                        self._spawn(self._post_status(node, lambda obj: None))
                    if not node.renewing:
                        node.renewing = True
                        self._spawn(self._renew_in_turn(node, renewed))
                if node.blocked == "ready" and not self._faulty("never_ready", node):
                    node.blocked = None
                    self._spawn(self._step(node, node.generation, self._boot))
                elif node.blocked == "plugin" and not self._faulty("device_plugin_never", node):
                    node.blocked = None
                    for resource in [r for r in node.plugins if r not in node.registered]:
                        self._spawn(self._step(node, node.generation, functools.partial(self._register,
                                                                                        resource=resource)))
                if i % 200 == 199:
                    await asyncio.sleep(0)   # let API requests in between batches

    # ------------------------------------------------------------------ pods
    async def _watch_pods(self) -> None:
        while True:
            kind, pod = await self._queue.get()
            try:
                await self._on_pod(kind, pod)
            except Exception:   # one odd pod must not stop every kubelet
                log.exception("kubelet: handling %s pod %s failed", kind, pod.get("metadata", {}).get("name"))

    async def _on_pod(self, kind: str, pod: dict) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        node = self._nodes.get(spec.get("nodeName") or "")
        if (meta.get("annotations") or {}).get(PLACEHOLDER_ANNOTATION) == "true":
            return
        uid = meta.get("uid", "")
        if node is None:
            if spec.get("nodeName") and meta.get("deletionTimestamp"):
                await self._remove(None, meta)     # bound to a node no kubelet serves: nothing to stop
            return
        if kind == "DELETED":   # force-deleted (grace 0) or removed: kill whatever still runs
            known = node.pods.pop(uid, None)
            node.finished.discard(uid)
            if known is not None:
                known.closing = True
                if known.task is not None:
                    known.task.cancel()
                self._spawn(self._stop_containers(known, 0))
            self.runner.forget(uid)
            return
        known = node.pods.get(uid)
        if meta.get("deletionTimestamp"):
            if not node.up:
                return      # no kubelet to finish it: Terminating until the node is back
            if known is None or not known.admitted or known.lost:
                node.pods.pop(uid, None)
                await self._remove(node, meta)
            elif not known.closing:
                known.closing = True
                self._spawn(self._delete_pod(node, known, pod))
            return
        if known is not None or uid in node.finished or (pod.get("status") or {}).get("phase") in _TERMINAL:
            return
        node.pods[uid] = _Pod(uid=uid, namespace=meta["namespace"], name=meta["name"])
        if node.up:
            await self._admit(node, node.pods[uid], pod)

    async def _admit_waiting(self, node: _Node) -> None:
        for pod in list(node.pods.values()):
            if pod.admitted or pod.closing:
                continue
            try:
                fresh = await self._api(node).get("pods", pod.namespace, pod.name)
            except ApiError:
                node.pods.pop(pod.uid, None)
                continue
            if fresh["metadata"].get("uid") != pod.uid:    # a newer pod of that name: the watch brings it
                node.pods.pop(pod.uid, None)
                continue
            await self._admit(node, pod, fresh)

    async def _refusal(self, node: _Node, wanted: dict[str, int]) -> tuple[str, str] | None:
        """(reason, message) when the kubelet refuses the pod: the device manager first, for each
        plugin resource in turn, then the predicate check of the other extended resources."""
        for resource in sorted(wanted, key=lambda r: (r != GPU, r)):
            if resource in node.plugins and wanted[resource] > node.free(resource):
                return "UnexpectedAdmissionError", admission_message(wanted[resource], node.free(resource), resource)
        others = [r for r in sorted(wanted) if r not in node.plugins]
        if others:
            try:
                allocatable = (await self._api(node).get("nodes", None, node.name))["status"].get("allocatable") or {}
            except ApiError:
                allocatable = {}
            for resource in others:
                capacity = int(parse_count(allocatable.get(resource, 0)))
                used = sum(p.held.get(resource, 0) for p in node.pods.values())
                if wanted[resource] > capacity - used:
                    return (f"OutOf{resource}", (f"Pod was rejected: Node didn't have enough resource: {resource}, "
                                                f"requested: {wanted[resource]}, used: {used}, capacity: {capacity}"))
        return None

    async def _admit(self, node: _Node, p: _Pod, pod: dict) -> None:
        wanted = extended_requests(pod)
        refused = await self._refusal(node, wanted)
        if refused:
            reason, message = refused
            node.pods.pop(p.uid, None)
            node.finished.add(p.uid)
            await self._write_pod(node, p, lambda obj: obj["status"].update(
                phase="Failed", reason=reason, message=message, startTime=rfc3339()))
            await self._event_pod(node, pod, reason, message, "Warning")
            return
        p.admitted, p.gpus = True, node.free_devices()[:wanted.get(GPU, 0)]
        p.held = {r: n for r, n in wanted.items() if r != GPU}
        p.pod_ip, p.start_time = node.new_pod_ip(), rfc3339()
        p.task = self._spawn(self._run_pod(node, p, pod))

    async def _run_pod(self, node: _Node, p: _Pod, pod: dict) -> None:
        spec = pod["spec"]
        for c in spec.get("initContainers") or []:
            p.init_statuses[c["name"]] = _waiting(c, "PodInitializing")
        for c in spec.get("containers") or []:
            p.statuses[c["name"]] = _waiting(c, "ContainerCreating")
        await self._write_status(node, p, "Pending")
        pod = {**pod, "status": {**(pod.get("status") or {}), "podIP": p.pod_ip,
                                 "hostIP": node.spec.private_ip}}
        await asyncio.sleep(self.timings.pod_start_seconds)
        policy = spec.get("restartPolicy", "Always")
        for c in spec.get("initContainers") or []:
            code = await self._container_loop(node, p, pod, c, "OnFailure" if policy == "Always" else policy,
                                              p.init_statuses)
            if p.closing:
                return
            if code != 0:
                return await self._finish(node, p, "Failed")
        codes = await asyncio.gather(*(self._container_loop(node, p, pod, c, policy, p.statuses)
                                       for c in spec.get("containers") or []))
        if not p.closing:   # a deletion or shutdown writes its own final status
            await self._finish(node, p, "Succeeded" if all(code == 0 for code in codes) else "Failed")

    async def _container_loop(self, node: _Node, p: _Pod, pod: dict, c: dict, policy: str,
                              statuses: dict[str, dict]) -> int:
        """Run one container until restartPolicy lets it rest; returns its last exit code."""
        name, backoff = c["name"], self.timings.pod_start_seconds or 0.1
        while True:
            ctr, code = await self._start_container(node, p, pod, c, statuses)
            if ctr is not None:
                p.running[name] = ctr
                statuses[name].update(state={"running": {"startedAt": ctr.started_at}}, ready=True, started=True,
                                      containerID=ctr.container_id, imageID=ctr.image_id)
                await self._write_status(node, p, "Running")
                code = await ctr.wait()
                p.running.pop(name, None)
                statuses[name]["state"] = {"terminated": {
                    "exitCode": code, "reason": "Completed" if code == 0 else "Error",
                    "startedAt": ctr.started_at, "finishedAt": rfc3339(), "containerID": ctr.container_id}}
            statuses[name].update(ready=False, started=False)
            if p.closing or not (policy == "Always" or (policy == "OnFailure" and code != 0)):
                return code
            statuses[name]["lastState"] = statuses[name]["state"]
            statuses[name]["restartCount"] += 1
            statuses[name]["state"] = {"waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {backoff:g}s restarting failed container={name} pod={p.name}_{p.namespace}"}}
            await self._write_status(node, p, "Running")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _start_container(self, node, p, pod, c, statuses) -> tuple[Container | None, int]:
        image = c.get("image", "")
        await self._event_pod(node, pod, "Pulled", f'Container image "{image}" already present on machine')
        extra = {"NVIDIA_VISIBLE_DEVICES": ",".join(map(str, p.gpus))} if p.gpus else {}
        if p.held.get(GPU_MEM):      # what ACK's GPU sharing tells a container about its share
            extra["ALIYUN_COM_GPU_MEM_CONTAINER"] = str(p.held[GPU_MEM])
        secrets = await self._secrets_for(node, p, pod, c, statuses)
        if secrets is None:         # deleted while it waited for a Secret
            return None, EXIT_START_ERROR
        try:
            ctr = await self.runner.start(pod, c, extra, secrets)
        except CannotRun as exc:
            now = rfc3339()
            statuses[c["name"]]["state"] = {"terminated": {
                "exitCode": EXIT_START_ERROR, "reason": "StartError", "message": str(exc), "startedAt": now,
                "finishedAt": now}}
            await self._event_pod(node, pod, "Failed", f"Error: {exc}", "Warning")
            return None, EXIT_START_ERROR
        await self._event_pod(node, pod, "Created", f"Created container {c['name']}")
        await self._event_pod(node, pod, "Started", f"Started container {c['name']}")
        return ctr, 0

    async def _secrets_for(self, node, p, pod, c, statuses) -> dict[str, dict[str, str]] | None:
        """The Secrets the container's env reads (decoded), as the kubelet fetches them before creating
        it. One missing (or a key of it) keeps the container waiting, CreateContainerConfigError with
        the kubelet's message, tried again with a doubling back-off until it appears (None: the pod
        was deleted meanwhile). An `optional` reference is skipped when missing."""
        backoff = self.timings.pod_start_seconds or 0.1
        namespace = pod["metadata"]["namespace"]
        while not p.closing:
            out: dict[str, dict[str, str]] = {}
            problem = None
            for name, key, optional in secret_refs(c):
                if name not in out:
                    try:
                        secret = await self._api(node).get("secrets", namespace, name)
                    except ApiError as exc:
                        if exc.code != 404:
                            raise
                        if not optional:
                            problem = problem or f'secret "{name}" not found'
                        continue
                    out[name] = {k: base64.b64decode(v).decode(errors="replace")
                                 for k, v in (secret.get("data") or {}).items()}
                    out[name].update(secret.get("stringData") or {})
                if key is not None and key not in out.get(name, {key: ""}) and not optional:
                    problem = problem or f"couldn't find key {key} in Secret {namespace}/{name}"
            if problem is None:
                return out
            statuses[c["name"]]["state"] = {"waiting": {"reason": "CreateContainerConfigError", "message": problem}}
            await self._event_pod(node, pod, "Failed", f"Error: {problem}", "Warning")
            await self._write_status(node, p, "Pending")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
        return None

    async def _finish(self, node: _Node, p: _Pod, phase: str, **extra) -> None:
        if node.pods.get(p.uid) is p:
            del node.pods[p.uid]
        node.finished.add(p.uid)
        await self._write_status(node, p, phase, **extra)

    async def _stop_containers(self, p: _Pod, grace: float) -> None:
        await asyncio.gather(*(c.stop(grace) for c in list(p.running.values())), return_exceptions=True)

    async def _delete_pod(self, node: _Node, p: _Pod, pod: dict) -> None:
        grace = pod["metadata"].get("deletionGracePeriodSeconds",
                                    pod["spec"].get("terminationGracePeriodSeconds", 30))
        for name in p.running:
            await self._event_pod(node, pod, "Killing", f"Stopping container {name}")
        await self._stop_containers(p, float(grace or 0))
        if p.task is not None:
            p.task.cancel()
        node.pods.pop(p.uid, None)
        await self._remove(node, pod["metadata"])

    async def _shutdown_pod(self, node: _Node, p: _Pod) -> None:
        p.closing = True
        await self._stop_containers(p, 1.0)
        if p.task is not None:
            p.task.cancel()
        for status in p.statuses.values():
            if "terminated" not in status["state"]:
                status["state"] = {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": rfc3339()}}
        await self._finish(node, p, "Failed", reason="Terminated", message=SHUTDOWN_MESSAGE)

    async def _remove(self, node: _Node | None, meta: dict) -> None:
        """The kubelet's final delete of a pod it is done with: on that pod's uid (a new pod of the
        same name is not touched), by the node it is bound to (any node's view for an orphan)."""
        api = self._api(node) if node is not None else self.api
        with contextlib.suppress(ApiError):
            await api.remove("pods", meta["namespace"], meta["name"], uid=meta.get("uid"))
        self.runner.forget(meta.get("uid", ""))

    # ------------------------------------------------------------------ status writing
    async def _write_status(self, node: _Node, p: _Pod, phase: str, **extra) -> None:
        now = rfc3339()
        mains = list(p.statuses.values())
        ready = phase == "Running" and all(s.get("ready") for s in mains)
        initialized = all("terminated" in s["state"] and s["state"]["terminated"]["exitCode"] == 0
                          for s in p.init_statuses.values())
        done_reason = "PodCompleted" if phase in _TERMINAL else "ContainersNotReady"

        def update(obj: dict) -> None:
            status = obj.setdefault("status", {})
            old = {c["type"]: c for c in status.get("conditions") or []}

            def cond(kind: str, ok: bool, reason: str | None = None) -> dict:
                value = "True" if ok else "False"
                prev = old.get(kind)
                c = {"type": kind, "status": value, "lastProbeTime": None,
                     "lastTransitionTime": prev["lastTransitionTime"] if prev and prev["status"] == value else now}
                if not ok and reason:
                    c["reason"] = reason
                return c

            conditions = [cond("PodReadyToStartContainers", True),
                          cond("Initialized", initialized, "ContainersNotInitialized"),
                          cond("Ready", ready, done_reason), cond("ContainersReady", ready, done_reason),
                          old.get("PodScheduled") or cond("PodScheduled", True)]
            if extra.get("reason") == "Terminated":
                conditions.append({"type": "DisruptionTarget", "status": "True", "lastProbeTime": None,
                                   "lastTransitionTime": now, "reason": "TerminationByKubelet",
                                   "message": SHUTDOWN_MESSAGE})
            status.update(phase=phase, hostIP=node.spec.private_ip, hostIPs=[{"ip": node.spec.private_ip}],
                          podIP=p.pod_ip, podIPs=[{"ip": p.pod_ip}], startTime=p.start_time,
                          conditions=conditions, containerStatuses=[dict(s) for s in mains],
                          qosClass=status.get("qosClass") or _qos(obj), **extra)
            if p.init_statuses:
                status["initContainerStatuses"] = [dict(s) for s in p.init_statuses.values()]
        await self._write_pod(node, p, update)

    async def _write_pod(self, node: _Node, p: _Pod, fn) -> None:
        """A status write of pod `p` (that very pod: a newer one of the same name is left alone)."""
        def guarded(obj: dict) -> None:
            if obj["metadata"].get("uid") != p.uid:
                raise ApiError(404, "NotFound", f'pods "{p.name}" not found')
            fn(obj)
        with contextlib.suppress(ApiError):     # the pod is gone; nothing to report
            await self._api(node).mutate("pods", p.namespace, p.name, guarded)

    async def _event_pod(self, node: _Node, pod: dict, reason: str, message: str, kind: str = "Normal") -> None:
        await self._event(node, pod, reason, message, kind, "kubelet")

    async def _event_node(self, node: _Node, reason: str, message: str, kind: str = "Normal",
                          component: str = "kubelet") -> None:
        await self._event(node, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name, "uid": node.uid}},
                          reason, message, kind, component)

    async def _event(self, node: _Node, involved: dict, reason: str, message: str, kind: str, component: str) -> None:
        try:
            await self._api(node).record_event(involved, reason, message, type=kind, component=component)
        except ApiError as exc:
            log.debug("event %s not recorded: %s", reason, exc)

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("kubelet task failed", exc_info=task.exception())

    def start(self) -> None:
        self._queue = self.api.subscribe("pods")
        self._spawn(self._watch_pods())
        self._spawn(self._heartbeats())

    async def stop(self) -> None:
        """Stop kubelet work; container processes are the runner's to kill (ContainerRunner.shutdown)."""
        if self._queue is not None:
            self.api.unsubscribe("pods", self._queue)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def state(self) -> list[dict]:
        """Per node: what its kubelet believes (for /_simcloud/state)."""
        return [{"name": n.name, "instance_id": n.spec.instance_id, "kubelet_up": n.up, "blocked": n.blocked,
                 "boot_id": n.boot_id, "gpus": n.gpus, "registered_gpus": n.registered.get(GPU, 0),
                 "registered": dict(n.registered),
                 "pods": sum(1 for p in n.pods.values() if p.admitted)} for n in self._nodes.values()]


# ---------------------------------------------------------------------- node status edits
def micro_time() -> str:
    """metav1.MicroTime, the format of a Lease's renewTime ("2006-01-02T15:04:05.000000Z")."""
    ns = time.time_ns()
    return f"{rfc3339(ns)[:-1]}.{ns // 1000 % 1_000_000:06d}Z"


def _set_ready(obj: dict, now: str, boot_id: str) -> None:
    _set_conditions(obj, now, boot_id, _HEALTHY)


def _set_not_ready(obj: dict, now: str, boot_id: str) -> None:
    """A restarted kubelet's first status: its new bootID, Ready=False until the runtime checks pass."""
    _set_conditions(obj, now, boot_id, [
        (t, "False", "KubeletNotReady", "container runtime status check may not have completed yet")
        if t == "Ready" else (t, s, r, m) for t, s, r, m in _HEALTHY])


def _set_conditions(obj: dict, now: str, boot_id: str, conditions) -> None:
    """The kubelet's conditions; lastTransitionTime moves only for a condition whose status changed."""
    status = obj["status"]
    status["nodeInfo"]["bootID"] = boot_id
    old = {c["type"]: c for c in status.get("conditions") or []}
    status["conditions"] = [{"type": t, "status": s, "lastHeartbeatTime": now,
                             "lastTransitionTime": old[t]["lastTransitionTime"]
                             if t in old and old[t].get("status") == s else now,
                             "reason": r, "message": m} for t, s, r, m in conditions]


def _set_counts(obj: dict, counts: dict[str, int]) -> None:
    for resource, count in counts.items():
        obj["status"]["capacity"][resource] = obj["status"]["allocatable"][resource] = str(count)


def _beat(obj: dict, now: str) -> None:
    for c in obj["status"].get("conditions") or []:
        c["lastHeartbeatTime"] = now


def _waiting(c: dict, reason: str) -> dict:
    return {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False, "started": False,
            "restartCount": 0, "state": {"waiting": {"reason": reason}}, "lastState": {}}


def _qos(pod: dict) -> str:
    containers = (pod.get("spec") or {}).get("containers") or []
    res = [c.get("resources") or {} for c in containers]
    if not any(r.get("requests") or r.get("limits") for r in res):
        return "BestEffort"
    guaranteed = all((r.get("limits") or {}).get(k) and (r.get("requests") or r.get("limits")).get(k)
                     == r["limits"][k] for r in res for k in ("cpu", "memory"))
    return "Guaranteed" if guaranteed else "Burstable"

"""Fleet files: the machines of the local cloud, as ECS instances and their Kubernetes Nodes.

A fleet is YAML (or the same structure as a dict)::

    region: cn-hangzhou
    credentials: {access_key_id: LTAI-simcloud-demo, access_key_secret: s3cret}  # secret random if omitted
    timings: {start_seconds: 2, boot_seconds: 3, stale_seconds: 1, device_plugin_seconds: 2,   # simcloud.config.Timings
              node_monitor_grace_seconds: 50, default_toleration_seconds: 300, watch_history_seconds: 300}
    faults: {no_stock: [ecs.gn7i-c8g1.2xlarge]}                                         # simcloud.config.Faults
    pods_per_node: 0        # benchmark only: placeholder pods per Running node (see below)
    instance_types:
      ecs.gn6i-c4g1.xlarge: {cpu: 4, memory_gib: 15, gpu: 1, gpu_spec: NVIDIA T4, price_per_hour: 1.2}
      # optional per type: family (default "ecs.gn6i"), gpu_memory_mib (default from the GPU model),
      # price_per_hour: what DescribePrice answers (USD, pay-as-you-go, every zone); none = PriceNotFound.
      # The demo's and the tests' prices are indicative (simcloud/harness.py INSTANCE_TYPES says where
      # they come from, looked up 2026-12-01), not Alibaba Cloud's list.
    nodes:
      - name: gpu-t4-1                 # Node name == kubernetes.io/hostname == ECS HostName
        instance_type: ecs.gn6i-c4g1.xlarge
        zone: cn-hangzhou-h
        status: Stopped                # Stopped or Running
        stopped_mode: StopCharging     # for Stopped nodes (default StopCharging)
        instance_id: i-...             # optional; derived deterministically from region and name
        labels: {gpuboot.io/managed: "true"}     # extra Node labels
        taints: []                               # extra Node taints
        tags: {"gpuboot:managed": "true"}        # ECS tags
        extended_resources: {rdma/hca: 1}        # more device plugins on this node (count per node)
        count: 1                       # optional: expands to name-0 .. name-(count-1)

Every Node gets the labels ACK puts on its nodes (hostname, os, arch, instance type,
zone, region, the beta/failure-domain twins, and for GPU nodes
`aliyun.accelerator/nvidia_name|nvidia_count|nvidia_mem`), `spec.providerID =
"<region>.<instance-id>"`, capacity/allocatable (allocatable below capacity by a
kube-reserved share), nodeInfo and addresses. Conditions and taints are the
kubelet's business (simcloud.machines.kubelet), not the fleet's.

Device plugins (`NodeSpec.device_resources`, registered in this order after every boot):
the NVIDIA plugin's `nvidia.com/gpu` on GPU types; on a node labelled for ACK's GPU sharing
(`ack.node.gpu.schedule: share | cgpu | core_mem | mps`) the gpushare plugin's
`aliyun.com/gpu-mem`, in GiB (whole GiB per GPU, as its default `--memory-unit=GiB`
counts them) summed over the GPUs; then the node's `extended_resources`.

`pods_per_node: N` creates, on every node that is Running at start, N placeholder
pods (namespace `bench`, annotation `simcloud.io/placeholder: "true"`) that are
already Running and have no process: they exist only so that listing a large
cluster can be measured. The kubelet ignores them.
"""
from __future__ import annotations

import hashlib
import random
import secrets
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from simcloud.config import Faults, Timings
from simcloud.ecs.model import Instance, InstanceType
from simcloud.kube.admission import is_extended_resource

KUBELET_VERSION = "v1.30.1-aliyun.1"
OS_IMAGE = "Alibaba Cloud Linux 3.2104 U10 (OpenAnolis Edition)"
KERNEL_VERSION = "5.10.134-16.3.al8.x86_64"
CONTAINER_RUNTIME = "containerd://1.6.28"
PLACEHOLDER_ANNOTATION = "simcloud.io/placeholder"
BENCH_NAMESPACE = "bench"

# GPUSpec (as DescribeInstanceTypes reports it) -> (aliyun.accelerator/nvidia_name, MiB per GPU)
_GPU_MODELS = {
    "NVIDIA T4": ("Tesla-T4", 15109),
    "NVIDIA A10": ("NVIDIA-A10", 23028),
    "NVIDIA V100": ("Tesla-V100-SXM2-16GB", 16160),
    "NVIDIA P100": ("Tesla-P100-PCIE-16GB", 16280),
    "NVIDIA P4": ("Tesla-P4", 7611),
    "NVIDIA A100": ("NVIDIA-A100-SXM4-80GB", 81251),
}
_TYPE_KEYS = {"cpu", "memory_gib", "gpu", "gpu_spec", "family", "price_per_hour", "gpu_memory_mib"}
_NODE_KEYS = {"name", "instance_type", "zone", "status", "stopped_mode", "instance_id",
              "labels", "taints", "tags", "count", "extended_resources"}
GPU_SHARE_LABEL = "ack.node.gpu.schedule"
GPU_SHARE_MODES = ("share", "cgpu", "core_mem", "mps")      # ACK's GPU-sharing values of that label
GPU_MEM = "aliyun.com/gpu-mem"
_TOP_KEYS = {"region", "credentials", "timings", "faults", "instance_types", "nodes", "pods_per_node"}


class FleetError(ValueError):
    """A fleet file is malformed; the message names the field and how to fix it."""


@dataclass
class TypeSpec(InstanceType):
    """An ECS instance type as the fleet file gives it: what ECS reports, plus the GPU memory ACK labels."""

    gpu_memory_mib: int | None = None

    @property
    def gpu_name(self) -> str:
        return _GPU_MODELS.get(self.gpu_spec, (self.gpu_spec.replace(" ", "-"), 0))[0]

    @property
    def gpu_mem_mib(self) -> int:
        return self.gpu_memory_mib or _GPU_MODELS.get(self.gpu_spec, ("", 16384))[1]


@dataclass
class NodeSpec:
    name: str
    instance_id: str
    instance_type: TypeSpec
    zone: str
    status: str
    stopped_mode: str
    private_ip: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    extended_resources: dict[str, int] = field(default_factory=dict)

    def device_resources(self) -> dict[str, int]:
        """resource -> count this node's device plugins register, in their registration order."""
        t = self.instance_type
        out = {"nvidia.com/gpu": t.gpu} if t.gpu else {}
        if t.gpu and self.labels.get(GPU_SHARE_LABEL) in GPU_SHARE_MODES:
            out[GPU_MEM] = t.gpu * (t.gpu_mem_mib // 1024)
        out.update(self.extended_resources)
        return out


@dataclass
class Fleet:
    region: str
    access_key_id: str
    access_key_secret: str
    timings: Timings
    faults: Faults
    instance_types: dict[str, TypeSpec]
    nodes: list[NodeSpec]
    pods_per_node: int = 0

    def __repr__(self) -> str:  # keep the secret out of tracebacks and logs
        return f"Fleet(region={self.region!r}, nodes={len(self.nodes)}, types={len(self.instance_types)})"


def load_fleet(source: dict | str | Path) -> Fleet:
    """Parse and validate a fleet from a dict, a YAML path, or YAML text."""
    if isinstance(source, dict):
        data = source
    else:
        text = Path(source).read_text() if _looks_like_path(source) else str(source)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise FleetError(f"fleet: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise FleetError("fleet: expected a mapping with keys region, instance_types, nodes")
    _no_unknown(data, _TOP_KEYS, "fleet")
    region = _str(data.get("region", "cn-hangzhou"), "region")
    creds = data.get("credentials") or {}
    _no_unknown(creds, {"access_key_id", "access_key_secret"}, "credentials")
    types = {tid: _parse_type(tid, spec) for tid, spec in (data.get("instance_types") or {}).items()}
    nodes = _parse_nodes(data.get("nodes"), types, region)
    return Fleet(
        region=region,
        access_key_id=_str(creds.get("access_key_id", "LTAI-simcloud"), "credentials.access_key_id"),
        access_key_secret=_str(creds.get("access_key_secret") or secrets.token_urlsafe(24),
                               "credentials.access_key_secret"),
        timings=_parse_timings(data.get("timings") or {}),
        faults=_parse_faults(data.get("faults") or {}),
        instance_types=types,
        nodes=nodes,
        pods_per_node=_nonneg_int(data.get("pods_per_node", 0), "pods_per_node"),
    )


def _looks_like_path(source: str | Path) -> bool:
    return isinstance(source, Path) or ("\n" not in source and source.endswith((".yaml", ".yml", ".json")))


def _no_unknown(obj: dict, known: set[str], where: str) -> None:
    if not isinstance(obj, dict):
        raise FleetError(f"fleet {where}: expected a mapping, got {type(obj).__name__}")
    unknown = sorted(set(obj) - known)
    if unknown:
        raise FleetError(f"fleet {where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _str(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise FleetError(f"fleet {where}: expected a non-empty string, got {value!r}")
    return value


def _nonneg_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FleetError(f"fleet {where}: expected an integer >= 0, got {value!r}")
    return value


def _parse_timings(spec: dict) -> Timings:
    known = {f.name for f in fields(Timings)}
    _no_unknown(spec, known, "timings")
    for key, value in spec.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise FleetError(f"fleet timings.{key}: expected seconds >= 0, got {value!r}")
    timings = Timings(**{k: float(v) for k, v in spec.items()})
    if timings.node_monitor_grace_seconds <= timings.lease_renew_seconds:
        raise FleetError(f"fleet timings.node_monitor_grace_seconds: {timings.node_monitor_grace_seconds:g} must "
                         f"exceed lease_renew_seconds ({timings.lease_renew_seconds:g}), or every running node "
                         "goes Unknown between two renewals (Kubernetes: several renewals per grace period)")
    return timings


def _parse_faults(spec: dict) -> Faults:
    faults = Faults()
    try:
        faults.update(spec)
    except (KeyError, ValueError, TypeError) as exc:
        raise FleetError(f"fleet faults: {exc.args[0] if exc.args else exc}") from None
    return faults


def _parse_type(tid: str, spec: dict) -> TypeSpec:
    where = f"instance_types.{tid}"
    _no_unknown(spec, _TYPE_KEYS, where)
    for key in ("cpu", "memory_gib"):
        if key not in spec:
            raise FleetError(f"fleet {where}.{key}: required (e.g. cpu: 4, memory_gib: 15)")
    cpu, mem, gpu = spec["cpu"], spec["memory_gib"], spec.get("gpu", 0)
    if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu <= 0:
        raise FleetError(f"fleet {where}.cpu: expected a positive integer of vCPUs, got {cpu!r}")
    if isinstance(mem, bool) or not isinstance(mem, (int, float)) or mem <= 0:
        raise FleetError(f"fleet {where}.memory_gib: expected a positive number of GiB, got {mem!r}")
    gpu = _nonneg_int(gpu, f"{where}.gpu")
    if gpu and not spec.get("gpu_spec"):
        raise FleetError(f"fleet {where}.gpu_spec: required for GPU types (e.g. 'NVIDIA T4')")
    return TypeSpec(
        instance_type_id=tid, cpu=cpu, memory_gib=float(mem), gpu=gpu,
        gpu_spec=str(spec.get("gpu_spec", "")),
        family=str(spec.get("family") or ""),   # "" = derived from the type id, as ECS names families
        price_per_hour=spec.get("price_per_hour"), gpu_memory_mib=spec.get("gpu_memory_mib"),
    )


def _parse_nodes(specs, types: dict[str, TypeSpec], region: str) -> list[NodeSpec]:
    if not isinstance(specs, list) or not specs:
        raise FleetError("fleet nodes: expected a non-empty list of nodes")
    nodes: list[NodeSpec] = []
    for i, spec in enumerate(specs):
        where = f"nodes[{i}]"
        _no_unknown(spec, _NODE_KEYS, where)
        name = _str(spec.get("name"), f"{where}.name")
        tid = spec.get("instance_type")
        if tid not in types:
            raise FleetError(f"fleet {where}.instance_type: unknown type {tid!r}; define it under instance_types "
                             f"(known: {', '.join(sorted(types)) or 'none'})")
        status = spec.get("status", "Running")
        if status not in ("Running", "Stopped"):
            raise FleetError(f"fleet {where}.status: expected Running or Stopped, got {status!r}")
        mode = spec.get("stopped_mode", "StopCharging")
        if mode not in ("StopCharging", "KeepCharging"):
            raise FleetError(f"fleet {where}.stopped_mode: expected StopCharging or KeepCharging, got {mode!r}")
        count = spec.get("count")
        names = [name] if count is None else [f"{name}-{k}" for k in range(_nonneg_int(count, f"{where}.count"))]
        if spec.get("instance_id") and len(names) > 1:
            raise FleetError(f"fleet {where}.instance_id: cannot be given together with count")
        taints = spec.get("taints") or []
        if not isinstance(taints, list) or any(not isinstance(t, dict) or "key" not in t or "effect" not in t
                                               for t in taints):
            raise FleetError(f"fleet {where}.taints: expected a list of {{key, value, effect}}")
        for node_name in names:
            nodes.append(NodeSpec(
                name=node_name,
                instance_id=spec.get("instance_id") or instance_id_for(region, node_name),
                instance_type=types[tid],
                zone=_str(spec.get("zone", f"{region}-h"), f"{where}.zone"),
                status=status,
                stopped_mode=mode if status == "Stopped" else "Not-applicable",
                private_ip=_private_ip(len(nodes)),
                labels={str(k): str(v) for k, v in (spec.get("labels") or {}).items()},
                taints=[dict(t) for t in taints],
                tags={str(k): str(v) for k, v in (spec.get("tags") or {}).items()},
                extended_resources=_extended_resources(spec.get("extended_resources") or {},
                                                       f"{where}.extended_resources"),
            ))
    seen: set[str] = set()
    for node in nodes:
        for key in (node.name, node.instance_id):
            if key in seen:
                raise FleetError(f"fleet nodes: duplicate node name or instance id {key!r}")
            seen.add(key)
    return nodes


def _extended_resources(spec, where: str) -> dict[str, int]:
    """A node's declared device-plugin resources: domain-prefixed names (not kubernetes.io), whole counts."""
    if not isinstance(spec, dict):
        raise FleetError(f"fleet {where}: expected a mapping of resource name: count, e.g. {{rdma/hca: 1}}")
    out = {}
    for name, count in spec.items():
        if not is_extended_resource(str(name)) or str(name) in ("nvidia.com/gpu", GPU_MEM):
            raise FleetError(f"fleet {where}: {name!r} is not an extended resource a device plugin could "
                             "register (use a domain-prefixed name outside kubernetes.io, e.g. rdma/hca; GPUs and "
                             "gpu-mem come from the instance type and the GPU-sharing label)")
        out[str(name)] = _nonneg_int(count, f"{where}.{name}")
    return out


def instance_id_for(region: str, name: str) -> str:
    """A stable ECS-looking id (i- + 20 base36 chars) so reruns see the same instances."""
    n = int.from_bytes(hashlib.sha256(f"{region}/{name}".encode()).digest()[:16], "big")
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = []
    for _ in range(20):
        n, r = divmod(n, 36)
        out.append(digits[r])
    return "i-" + "".join(out)


def _private_ip(index: int) -> str:
    return f"172.{16 + index // 62500}.{(index // 250) % 250}.{index % 250 + 2}"


def provider_id(region: str, instance_id: str) -> str:
    return f"{region}.{instance_id}"


def new_boot_id(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def capacity(t: TypeSpec) -> tuple[dict[str, str], dict[str, str]]:
    """(capacity, allocatable) as an ACK kubelet reports them; GPUs at their real count."""
    mem_kib = int(t.memory_gib * 1024 * 1024) - 300 * 1024          # kernel/firmware share
    reserved_cpu_m = 100 + 20 * t.cpu                              # kube-reserved + system-reserved
    reserved_mem_kib = (400 + int(t.memory_gib * 1024 * 0.02)) * 1024
    cap = {"cpu": str(t.cpu), "memory": f"{mem_kib}Ki", "pods": "110",
           "ephemeral-storage": "123722704Ki", "hugepages-1Gi": "0", "hugepages-2Mi": "0"}
    alloc = {"cpu": f"{t.cpu * 1000 - reserved_cpu_m}m", "memory": f"{mem_kib - reserved_mem_kib}Ki",
             "pods": "110", "ephemeral-storage": "114022843818", "hugepages-1Gi": "0", "hugepages-2Mi": "0"}
    if t.gpu:
        cap["nvidia.com/gpu"] = alloc["nvidia.com/gpu"] = str(t.gpu)
    return cap, alloc


def node_labels(node: NodeSpec, region: str) -> dict[str, str]:
    t = node.instance_type
    labels = {
        "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/instance-type": t.instance_type_id,
        "failure-domain.beta.kubernetes.io/region": region,
        "failure-domain.beta.kubernetes.io/zone": node.zone,
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": node.name,
        "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": t.instance_type_id,
        "topology.kubernetes.io/region": region,
        "topology.kubernetes.io/zone": node.zone,
        "alibabacloud.com/nodepool-id": "np-" + hashlib.sha1(t.instance_type_id.encode()).hexdigest()[:24],
    }
    if t.gpu:
        labels.update({
            "aliyun.accelerator/nvidia_name": t.gpu_name,
            "aliyun.accelerator/nvidia_count": str(t.gpu),
            "aliyun.accelerator/nvidia_mem": f"{t.gpu_mem_mib}MiB",
        })
    labels.update(node.labels)
    return labels


def node_object(node: NodeSpec, region: str, boot_id: str) -> dict:
    """The Node as registered by its kubelet; conditions and taints are added by simcloud.machines.kubelet."""
    cap, alloc = capacity(node.instance_type)
    for resource, count in node.device_resources().items():     # as last registered before the stop
        cap[resource] = alloc[resource] = str(count)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": node_labels(node, region),
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": {
            "providerID": provider_id(region, node.instance_id),
            **({"taints": [dict(t) for t in node.taints]} if node.taints else {}),
        },
        "status": {
            "capacity": cap,
            "allocatable": alloc,
            "addresses": [
                {"type": "InternalIP", "address": node.private_ip},
                {"type": "Hostname", "address": node.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": boot_id,
                "containerRuntimeVersion": CONTAINER_RUNTIME,
                "kernelVersion": KERNEL_VERSION,
                "kubeProxyVersion": KUBELET_VERSION,
                "kubeletVersion": KUBELET_VERSION,
                "machineID": hashlib.md5(node.instance_id.encode()).hexdigest(),
                "operatingSystem": "linux",
                "osImage": OS_IMAGE,
                "systemUUID": str(uuid.UUID(hashlib.md5(node.name.encode()).hexdigest())),
            },
            "conditions": [],
            "images": [],
        },
    }


def ecs_instance(node: NodeSpec, region: str) -> Instance:
    """The ECS instance behind a fleet node (HostName and InstanceName = the node name)."""
    return Instance(
        instance_id=node.instance_id, instance_name=node.name, hostname=node.name, instance_type=node.instance_type,
        zone_id=node.zone, region_id=region, status=node.status, stopped_mode=node.stopped_mode,
        tags=dict(node.tags), private_ip=node.private_ip,
    )


def placeholder_pod(node_name: str, index: int, host_ip: str, started_at: str) -> dict:
    """A bench-only pod, bound and Running, with no process behind it."""
    name = f"{node_name}-filler-{index}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": BENCH_NAMESPACE, "labels": {"app": "filler"},
                     "annotations": {PLACEHOLDER_ANNOTATION: "true"}},
        "spec": {
            "nodeName": node_name,
            "restartPolicy": "Always",
            "containers": [{"name": "filler", "image": "registry.local/pause:3.9",
                            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}],
        },
        "status": {
            "phase": "Running", "hostIP": host_ip, "podIP": f"10.0.{index // 250}.{index % 250 + 2}",
            "startTime": started_at,
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": started_at}
                           for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")],
            "containerStatuses": [{"name": "filler", "ready": True, "started": True, "restartCount": 0,
                                   "image": "registry.local/pause:3.9", "imageID": "",
                                   "state": {"running": {"startedAt": started_at}}}],
        },
    }

"""The joined view placement works on: Kubernetes Nodes + ECS instances + pods + reservations.

Pure: the adapters fetch the JSON (Nodes and pods in API form, instances in
DescribeInstances form, instance types in DescribeInstanceTypes form keyed by
InstanceTypeId, reservations from the ledger); this module only decides, per
node, its state (with a reason a human can act on) and its capacity, so that
the same decision is unit-tested and reused by the trace replay.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime

from gpuboot.core.model import (
    LABEL_GPU_COUNT,
    LABEL_GPU_MODEL,
    LABEL_HOSTNAME,
    LABEL_INSTANCE_TYPE,
    LABEL_JOB,
    LABEL_MANAGED,
    LABEL_PRICE,
    LABEL_TASK,
    LABEL_ZONE,
    NOT_READY_TAINTS,
    TAG_MANAGED,
    TERMINATED_PHASES,
    FrozenDict,
    NodeState,
    NodeView,
    Reservation,
)
from gpuboot.core.resources import CPU, GPU, MEMORY, QuantityError, Resources
from gpuboot.core.timefmt import duration

_PROVIDER_ID = re.compile(r"(?:alicloud://)?(?P<region>[a-z0-9-]+)\.(?P<instance>i-[A-Za-z0-9]+)")


# --- small shared helpers ---------------------------------------------------

def parse_time(value) -> float | None:
    """Kubernetes / ECS timestamp (ISO 8601, 'Z' or offset, ECS's minute form) -> epoch seconds."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, datetime):
        moment = value
    else:
        try:
            moment = datetime.fromisoformat(str(value).strip())
        except ValueError:
            return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


# The openb trace's spelling of a model with its memory: V100M16 = a V100 with 16 GB per GPU.
_MODEL_WITH_MEMORY = re.compile(r"(?P<model>[A-Z]+\d+[A-Z]*?)M(?P<gib>\d+)")


def gpu_model_tokens(name: str | None) -> tuple[str, ...]:
    """'NVIDIA-Tesla-V100-SXM2' -> ('V100', 'SXM2'): upper-case, no vendor prefixes or separators;
    the trace's 'V100M16' -> ('V100', '16GB'), the memory as ACK's labels write it."""
    tokens = [t for t in re.split(r"[\s\-_/]+", (name or "").upper()) if t]
    while tokens and tokens[0] in ("NVIDIA", "TESLA"):
        tokens.pop(0)
    if tokens and (memory := _MODEL_WITH_MEMORY.fullmatch(tokens[0])):
        tokens[:1] = [memory["model"], f"{memory['gib']}GB"]
    return tuple(tokens)


def normalize_gpu_model(name: str | None) -> str:
    """'Tesla-T4', 'NVIDIA T4' and 't4' all normalize to 'T4'; 'V100M16' to 'V100-16GB'."""
    return "-".join(gpu_model_tokens(name))


def gpu_model_alternatives(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """The models a job accepts, each once, in the order given: 'V100M16|V100M32' (the trace's
    spelling), ['T4', 'A10'] or 'T4'; None, '' or [] accept any model (the empty tuple)."""
    if value is None:
        return ()
    parts = value.split("|") if isinstance(value, str) else [p for v in value for p in str(v).split("|")]
    return tuple(dict.fromkeys(p.strip() for p in parts if p.strip()))


def gpu_model_matches(wanted: str | Iterable[str] | None, actual: str | None) -> bool:
    """True when `actual` is one of the `wanted` models or a variant of one (no model wanted: any).

    A variant has the same model and at least the words asked for: 'A100' matches
    'NVIDIA-A100-SXM4-80GB' (not 'A10'); 'V100M16' and 'V100-16GB' match 'Tesla-V100-SXM2-16GB',
    not its 32GB sibling, nor a bare 'NVIDIA V100' whose memory is unknown."""
    alternatives = gpu_model_alternatives(wanted)
    if not alternatives:
        return True
    have = gpu_model_tokens(actual)
    for model in alternatives:
        want = gpu_model_tokens(model)
        if want and have[:1] == want[:1] and set(want[1:]) <= set(have[1:]):
            return True
    return False


def parse_provider_id(provider_id: str | None) -> tuple[str, str] | None:
    """'cn-hangzhou.i-abc' or 'alicloud://cn-hangzhou.i-abc' -> ('cn-hangzhou', 'i-abc'); else None."""
    match = _PROVIDER_ID.fullmatch((provider_id or "").strip())
    return (match["region"], match["instance"]) if match else None


def node_condition(node: Mapping, kind: str = "Ready") -> dict:
    for condition in (node.get("status") or {}).get("conditions") or ():
        if condition.get("type") == kind:
            return condition
    return {}


# --- pod requests -------------------------------------------------------------

def _requests(raw: Mapping | None, pod: Mapping, what: str) -> Resources:
    """Parse one requests mapping; the error (rare) names the pod and the part of it."""
    try:
        return Resources.parse(raw)
    except QuantityError:
        meta = pod.get("metadata") or {}
        return Resources.parse(raw, field=f"pod {meta.get('namespace', '')}/{meta.get('name', '')} {what}")


def _container_requests(container: Mapping, pod: Mapping) -> Resources:
    resources = container.get("resources") or {}
    requests, limits = resources.get("requests"), resources.get("limits")
    # the API server defaults requests to limits where only limits are set
    merged = {**limits, **(requests or {})} if limits else requests
    return _requests(merged, pod, f"container {container.get('name')} resources.requests")


def _add(total: dict[str, int], more: Mapping[str, int]) -> None:
    for name, amount in more.items():
        total[name] = total.get(name, 0) + amount


def _raise_to(peak: dict[str, int], value: Mapping[str, int]) -> None:
    for name, amount in value.items():
        if amount > peak.get(name, 0):
            peak[name] = amount


def pod_requests(pod: Mapping) -> Resources:
    """What the scheduler reserves for `pod` (k8s resourcehelper.PodRequests).

    max(sum of app containers + sidecars, each init container + the sidecars started
    before it) + spec.overhead; pod-level spec.resources.requests win where set.
    """
    spec = pod.get("spec") or {}
    total: dict[str, int] = {}
    for container in spec.get("containers") or ():
        _add(total, _container_requests(container, pod))
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for container in spec.get("initContainers") or ():
        own = _container_requests(container, pod)
        if container.get("restartPolicy") == "Always":
            _add(total, own)
            _add(sidecars, own)
            _raise_to(init_peak, sidecars)
        else:
            running = dict(sidecars)
            _add(running, own)
            _raise_to(init_peak, running)
    _raise_to(total, init_peak)
    pod_level = (spec.get("resources") or {}).get("requests")
    if pod_level:
        total.update(_requests(pod_level, pod, "spec.resources.requests"))
    if spec.get("overhead"):
        _add(total, _requests(spec["overhead"], pod, "spec.overhead"))
    return Resources(total)


def pod_is_active(pod: Mapping) -> bool:
    """Bound and not terminated: the scheduler still counts its requests on the node."""
    return bool((pod.get("spec") or {}).get("nodeName")) and \
        (pod.get("status") or {}).get("phase") not in TERMINATED_PHASES


MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


def is_workload_pod(pod: Mapping) -> bool:
    """Work that keeps a node up: not terminated, not a DaemonSet pod, not a static (mirror) pod
    (those run on every node from its boot). Scale-down's "busy" and the node's busy_since."""
    meta = pod.get("metadata") or {}
    if (pod.get("status") or {}).get("phase") in TERMINATED_PHASES:
        return False
    if MIRROR_ANNOTATION in (meta.get("annotations") or {}):
        return False
    return not any(ref.get("kind") == "DaemonSet" for ref in meta.get("ownerReferences") or ())


def _pod_started(pod: Mapping, now: float) -> float:
    """When the pod started (status.startTime), else when it was created; `now` if neither is known."""
    started = parse_time((pod.get("status") or {}).get("startTime")) or \
        parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
    return now if started is None else min(started, now)


# --- the inventory ------------------------------------------------------------

def _tags(instance: Mapping) -> dict[str, str]:
    tags = (instance.get("Tags") or {}).get("Tag") or ()
    return {t["TagKey"]: t.get("TagValue") or "" for t in tags if isinstance(t, Mapping) and t.get("TagKey")}


def _price(labels: Mapping, annotations: Mapping, itype: Mapping, zone: str | None = None) -> float | None:
    """The node's override (annotation, then label), else ECS's price for its type in its zone."""
    by_zone = itype.get("PricesPerHour") or {}
    for raw in (annotations.get(LABEL_PRICE), labels.get(LABEL_PRICE), by_zone.get(zone), itype.get("PricePerHour")):
        try:
            if raw is not None:
                return float(raw)
        except (TypeError, ValueError):
            continue
    return None


def _expected_gpus(labels: Mapping, instance: Mapping, itype: Mapping) -> int:
    """How many GPUs the machine has, from the instance type, the instance, or ACK's count label."""
    for raw in (itype.get("GPUAmount"), instance.get("GPUAmount"), labels.get(LABEL_GPU_COUNT)):
        try:
            if raw not in (None, ""):
                return int(raw)
        except (TypeError, ValueError):
            continue
    return 0


def _type_capacity(instance: Mapping, itype: Mapping, gpus: int) -> Resources:
    """Capacity from the instance type (CpuCoreCount, MemorySize GiB), else the instance (Cpu, Memory MiB)."""
    if itype.get("CpuCoreCount"):
        cpu, memory = int(itype["CpuCoreCount"]) * 1000, int(float(itype.get("MemorySize") or 0) * 2**30)
    else:
        cpu, memory = int(instance.get("Cpu") or 0) * 1000, int(instance.get("Memory") or 0) * 2**20
    return Resources({CPU: cpu, MEMORY: memory, GPU: gpus})


def _node_resources(node: Mapping, key: str) -> Resources:
    raw = (node.get("status") or {}).get(key) or {}
    try:
        return Resources.parse(raw, field=f"node {node['metadata']['name']} status.{key}")
    except QuantityError:
        return Resources()


def _ready(node: Mapping) -> tuple[bool, str]:
    condition = node_condition(node)
    status = condition.get("status", "Unknown")
    if status == "True":
        return True, "NodeReady True"
    detail = condition.get("reason") or condition.get("message") or ""
    return False, f"NodeReady {status}" + (f" ({detail})" if detail else "")


def _running_state(node: Mapping, allocatable: Resources, expected_gpus: int, started: float | None,
                   now: float, grace: float) -> tuple[NodeState, str]:
    """State of a node whose instance is Running: READY, BOOTING within the grace, else UNAVAILABLE."""
    ready, why = _ready(node)
    heartbeat = parse_time(node_condition(node).get("lastHeartbeatTime"))
    if ready and started is not None and heartbeat is not None and heartbeat < started:
        ready, why = False, "node status predates the instance start (no heartbeat since)"
    if ready and expected_gpus and allocatable.gpus < expected_gpus:
        ready, why = False, f"GPUs not registered ({allocatable.gpus}/{expected_gpus} {GPU})"
    down = sorted(t.get("key") for t in (node.get("spec") or {}).get("taints") or () if t.get("key") in NOT_READY_TAINTS)
    if ready and down:      # Ready read, but the node controller has not lifted its taint yet: still coming up
        ready, why = False, f"taint {down[0]} still on it"
    if ready:
        return NodeState.READY, "running, Ready" + (f", {expected_gpus} GPUs registered" if expected_gpus else "")
    if started is None:
        return NodeState.UNAVAILABLE, f"instance Running but {why}; start time unknown"
    age = now - started
    if age <= grace:
        return NodeState.BOOTING, f"booting for {duration(age)}: {why}"
    return NodeState.UNAVAILABLE, f"instance Running for {duration(age)} (> {duration(grace)} boot grace) but {why}"


def _reservation_usage(reservations: Iterable[Reservation], backed: set[tuple[str, str, str]],
                       now: float) -> dict[str, Resources]:
    """Live reservations not yet backed by a bound pod, summed per node."""
    usage: dict[str, Resources] = defaultdict(Resources)
    for r in reservations:
        if r.expires_at > now and (r.node, r.job_id, r.task) not in backed:
            usage[r.node] += r.resources
    return usage


def backed_tasks(pods: Iterable[Mapping]) -> set[tuple[str, str, str]]:
    """(node, job, task) of every active gpuboot pod: their reservations are counted as the pod."""
    backed = set()
    for pod in pods:
        if pod_is_active(pod):
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if LABEL_JOB in labels and LABEL_TASK in labels:
                backed.add((pod["spec"]["nodeName"], labels[LABEL_JOB], labels[LABEL_TASK]))
    return backed


def with_reservations(views: Iterable[NodeView], backed: set[tuple[str, str, str]],
                      reservations: Iterable[Reservation], now: float) -> list[NodeView]:
    """`views` built without reservations (build_inventory(..., reservations=[])) with these counted:
    the same views build_inventory gives with them, at the cost of the reservations only (a placer
    re-placing against a survey it already read, gpuboot.lifecycle.booking)."""
    reservations = [r for r in reservations if r.expires_at > now and (r.node, r.job_id, r.task) not in backed]
    reserved = _reservation_usage(reservations, backed, now)
    holders: dict[str, dict[str, None]] = defaultdict(dict)
    for r in reservations:
        if r.resources:
            holders[r.node][f"job {r.job_id} ({r.task}, reserved)"] = None
    out = []
    shared: dict[Resources, Resources] = {}     # reserved twins share their vectors and tokens too (build_inventory)
    twins: dict[tuple, object] = {}
    for v in views:
        view = v
        if v.name in reserved or v.name in holders:
            more = [h for h in holders.get(v.name, ()) if h not in v.holders]
            allocated = v.allocated + reserved.get(v.name, Resources())
            view = replace(v, allocated=shared.setdefault(allocated, allocated), holders=(*v.holders, *more))
            _share_twin(view, twins)
        out.append(view)
    return out


def _shared_taints(taints: list[dict] | None, known: dict[tuple, tuple]) -> tuple[dict, ...]:
    """The node's taints as what scheduling reads of them (key, value, effect; not timeAdded), one
    object per distinct set across the fleet, so that twins share it (_share_twin)."""
    if not taints:
        return ()
    wanted = tuple(FrozenDict({k: t[k] for k in ("key", "value", "effect") if k in t}) for t in taints)
    return known.setdefault(tuple(tuple(t.items()) for t in wanted), wanted)


KEEP_CHARGING = "KeepCharging"


def stopped_reason(instance: Mapping) -> str:
    """How a Stopped instance is described (the fleet page, the candidate table, scale-down's log): one
    stopped in KeepCharging mode (ECS's default, so stopped outside gpuboot, which stops in StopCharging)
    is still billed for its compute, and says so."""
    mode = instance.get("StoppedMode")
    if mode == KEEP_CHARGING:
        return ("instance Stopped in KeepCharging mode: still billed for its compute while stopped (stopped outside "
                "gpuboot; once a job has used it, scale-down stops it in StopCharging)")
    return "instance Stopped" + (f" ({mode})" if mode else "")


def build_inventory(nodes: list[dict], pods: list[dict], instances: list[dict],
                    instance_types: dict[str, dict], reservations: list[Reservation],
                    now: float, boot_grace_seconds: float = 900) -> list[NodeView]:
    """Join Nodes to instances by providerID and give each node a state, capacity and usage."""
    by_instance = {i.get("InstanceId"): i for i in instances}
    used: dict[str, dict[str, int]] = defaultdict(dict)
    backed: set[tuple[str, str, str]] = set()
    holders: dict[str, dict[str, None]] = defaultdict(dict)     # node -> holders, in order, once each
    busy_since: dict[str, float] = {}     # node -> when its oldest workload pod started
    for pod in pods:
        if not pod_is_active(pod):
            continue
        node_name = pod["spec"]["nodeName"]
        _add(used[node_name], pod_requests(pod))
        if is_workload_pod(pod):
            started = _pod_started(pod, now)
            if started < busy_since.get(node_name, float("inf")):
                busy_since[node_name] = started
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if LABEL_JOB in labels and LABEL_TASK in labels:
            backed.add((node_name, labels[LABEL_JOB], labels[LABEL_TASK]))
            holders[node_name][f"job {labels[LABEL_JOB]} ({labels[LABEL_TASK]})"] = None
        else:
            holders[node_name][f"pod {meta.get('namespace', 'default')}/{meta.get('name')}"] = None
    reserved = _reservation_usage(reservations, backed, now)
    for r in reservations:
        if r.expires_at > now and (r.node, r.job_id, r.task) not in backed and r.resources:
            holders[r.node][f"job {r.job_id} ({r.task}, reserved)"] = None

    views = []
    shared: dict[Resources, Resources] = {}     # one object per distinct vector, so that twins share it
    taint_sets: dict[tuple, tuple] = {}    # and per distinct set of taints
    twins: dict[tuple, object] = {}        # twin key -> token (_share_twin)
    for node in nodes:
        meta, spec = node.get("metadata") or {}, node.get("spec") or {}
        name = meta["name"]
        labels = dict(meta.get("labels") or {})
        annotations = meta.get("annotations") or {}
        allocatable = _node_resources(node, "allocatable")
        parsed = parse_provider_id(spec.get("providerID"))
        instance = by_instance.get(parsed[1]) if parsed else None
        instance = instance or {}
        itype = instance_types.get(instance.get("InstanceType") or labels.get(LABEL_INSTANCE_TYPE) or "") or {}
        expected_gpus = _expected_gpus(labels, instance, itype)

        if parsed is None:
            ready, why = _ready(node)
            state, reason = (NodeState.READY, "not an ECS node; Ready") if ready else \
                (NodeState.UNAVAILABLE, f"not an ECS node; {why}")
        elif not instance:
            state, reason = NodeState.UNAVAILABLE, f"providerID {spec.get('providerID')} has no ECS instance"
        else:
            status = instance.get("Status")
            if status == "Running":
                start_time = parse_time(instance.get("StartTime"))
                state, reason = _running_state(node, allocatable, expected_gpus, start_time, now, boot_grace_seconds)
            elif status in ("Pending", "Starting"):
                state, reason = NodeState.BOOTING, f"instance {status}"
            elif status == "Stopped":
                state, reason = NodeState.STOPPED, stopped_reason(instance)
            elif status == "Stopping":
                state, reason = NodeState.STOPPING, "instance Stopping"
            else:
                state, reason = NodeState.UNAVAILABLE, f"instance status {status!r}"
            if state in (NodeState.BOOTING, NodeState.STOPPED, NodeState.STOPPING):
                # capacity once booted: the Node's last allocatable, else the instance type;
                # the GPU count the machine has even when the kubelet zeroed it
                if not allocatable.get(CPU):
                    allocatable = _type_capacity(instance, itype, expected_gpus)
                elif allocatable.gpus < expected_gpus:
                    allocatable = allocatable + {GPU: expected_gpus - allocatable.gpus}
        if spec.get("unschedulable"):
            state, reason = NodeState.UNAVAILABLE, f"cordoned (spec.unschedulable); was {reason}"

        managed = parsed is not None and (labels.get(LABEL_MANAGED) == "true"
                                          or _tags(instance).get(TAG_MANAGED) == "true")
        allocated = Resources(used.get(name, {})) + reserved.get(name, Resources())
        views.append(NodeView(
            name=name,
            hostname=labels.get(LABEL_HOSTNAME) or name,
            state=state,
            reason=reason,
            allocatable=shared.setdefault(allocatable, allocatable),
            allocated=shared.setdefault(allocated, allocated),
            labels=FrozenDict(labels),
            taints=_shared_taints(spec.get("taints"), taint_sets),
            instance_id=parsed[1] if parsed else None,
            instance_type=instance.get("InstanceType") or labels.get(LABEL_INSTANCE_TYPE),
            zone=instance.get("ZoneId") or labels.get(LABEL_ZONE),
            gpu_model=labels.get(LABEL_GPU_MODEL) or itype.get("GPUSpec") or instance.get("GPUSpec") or None,
            price_per_hour=_price(labels, annotations, itype, instance.get("ZoneId")),
            managed=managed,
            holders=tuple(holders.get(name, ())),
            busy_since=busy_since.get(name) if state is NodeState.READY else None,     # work runs on running nodes
        ))
        _share_twin(views[-1], twins)
    return views


def _share_twin(view: NodeView, twins: dict[tuple, object]) -> None:
    """Give `view` the twin token (NodeView.twin) of the first view alike in all placement judges but
    what is the node's own (name, labels, reason, offering, holders). Its vectors and taints are the
    objects shared across this inventory, so their ids tell them apart, and the key hashes in C."""
    key = (view.state, id(view.allocatable), id(view.allocated), view.price_per_hour, view.gpu_model,
           id(view.taints))
    object.__setattr__(view, "twin", twins.setdefault(key, view.twin))   # a frozen view, still being built

"""In-memory fakes of the Kubernetes and ECS adapters, behind the Protocols of gpuboot.core.ports.

For unit tests of the lifecycle (gpuboot.lifecycle.booking, gpuboot.lifecycle.boot) that run in milliseconds: no
process, no socket, no sleep. The real `ReservationLedger` runs on `FakeCluster`'s ConfigMap,
so the compare-and-swap under test is the real one. tests/unit/gpuboot/core/test_ports.py checks
that these fakes and the real adapters have every method of the Protocols with compatible
signatures; what the fakes answer follows the adapters (gpuboot.hooks.kube, gpuboot.hooks.ecs):

- `FakeCluster`: Nodes, pods and ConfigMaps, one resourceVersion counter for all of them as
  the API server keeps; a ConfigMap write at a stale resourceVersion (or a create of one that
  exists) raises `gpuboot.hooks.kube.Conflict`, like the adapter on a 409. `conflict_next_writes(n)`
  lets another writer win the next n writes; `before_next_write(action)` runs `action` (say,
  another booker's whole transaction) just before the next write is applied.
- `FakeEcs`: instances in DescribeInstances form whose Status goes Stopped -> Starting ->
  Running -> Stopping -> Stopped. Start and stop answer per instance like `EcsHook._power`:
  "already", "stopping" (start while Stopping), "done", or "failed" with an `EcsError`
  classified by the adapter's own `classify_code` (OperationDenied.NoStock is "capacity";
  IncorrectInstanceStatus, ECS's answer to a stop of a Starting instance, is "permanent").
  `wait_for_status` does not wait: time passes at once (`settle`).
"""
from __future__ import annotations

import copy
import datetime as dt
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuboot.core.model import LABEL_MANAGED, TERMINATED_PHASES
from gpuboot.core.ports import RUNNING_OR_COMING, STOPPED_OR_GOING, EcsError, InstanceOutcome, classify_code
from gpuboot.exceptions import Overloaded
from gpuboot.hooks.kube import Conflict
from gpuboot.lifecycle.ledger import ReservationLedger
from tests.builders import REGION, TYPES, instance, node

T4 = "ecs.gn6i-c8g1.2xlarge"          # 1 GPU (builders.TYPES)
T4X2 = "ecs.gn6i-c24g1.12xlarge"      # 2 GPUs
ZONE = f"{REGION}-h"

MESSAGES = {   # what ECS says with each code the fakes answer
    "OperationDenied.NoStock": "The requested resource is sold out in the specified zone; "
                               "try other types of resources or other regions and zones.",
    "IncorrectInstanceStatus": "The current status of the resource does not support this operation.",
    "InvalidInstanceId.NotFound": "The specified InstanceId does not exist.",
    "InvalidInstanceType.ValueNotSupported": "The specified InstanceType does not exist or beyond the permitted range.",
    "ServiceUnavailable": "The request has failed due to a temporary failure of the server.",
}


class Clock:
    """A clock that only moves when told: `clock()` is now, `clock.advance(s)` moves it."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeCluster:
    """Kubernetes as gpuboot sees it: gpuboot.core.ports.ClusterReads, PodControl and ConfigMapStore."""

    def __init__(self, nodes: Iterable[dict] = (), pods: Iterable[dict] = ()) -> None:
        self._version = 0
        self.nodes: dict[str, dict] = {}
        self.pods: list[dict] = []
        self.configmaps: dict[tuple[str, str], dict] = {}
        self.writes = 0          # ConfigMap writes applied
        self.refused = 0         # ConfigMap writes refused with a Conflict
        self._conflicts = 0
        self.cache_behind = False   # the first cached read after a write shows the ConfigMap as it was before
        self._previous: dict[tuple[str, str], dict | None] = {}     # ... which is this (None: it was created)
        self._before_write: list[tuple[Callable[[], bool], Callable[[], object]]] = []
        self.turned_away = 0        # cached reads still to refuse with Overloaded (`turn_away_cached_reads`)
        self._lock = threading.RLock()      # each ConfigMap read or write is atomic, as on the API server
        for n in nodes:
            self.put_node(n)
        for p in pods:
            self.add_pod(p)

    # -- test controls -------------------------------------------------------------------
    def put_node(self, obj: dict) -> None:
        """Add or overwrite a Node (a new resourceVersion, as any write gets)."""
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = self._next_version()
        self.nodes[obj["metadata"]["name"]] = obj

    def add_pod(self, obj: dict) -> None:
        self.pods.append(copy.deepcopy(obj))

    def conflict_next_writes(self, count: int) -> None:
        """The next `count` ConfigMap writes lose to another writer: 409, and the stored version moves on."""
        self._conflicts += count

    def turn_away_cached_reads(self, count: int) -> None:
        """The next `count` cached reads raise Overloaded: the API server's 429 past the client's own tries."""
        self.turned_away += count

    def before_next_write(self, action: Callable[[], object]) -> None:
        """Run `action` once, just before the next ConfigMap write is checked (an interleaved writer)."""
        self.before_write_when(lambda: True, action)

    def before_write_when(self, when: Callable[[], bool], action: Callable[[], object]) -> None:
        """Run `action` once, just before the first ConfigMap write at which `when()` holds (both outside
        the lock: they may read the ledger, whose shards are read from threads of its own)."""
        self._before_write.append((when, action))

    # -- ClusterReads ----------------------------------------------------------------------
    def list_nodes(self) -> list[dict]:
        return [copy.deepcopy(n) for n in self.nodes.values()]

    def list_active_pods(self) -> list[dict]:
        return [copy.deepcopy(p) for p in self.pods if (p.get("status") or {}).get("phase") not in TERMINATED_PHASES]

    def get_node(self, name: str) -> dict:
        if name not in self.nodes:
            raise LookupError(f"404 node {name} not found")
        return copy.deepcopy(self.nodes[name])

    def node_to_watch(self, name: str) -> tuple[dict, str]:
        node = self.get_node(name)
        self._list_versions = getattr(self, "_list_versions", 0) + 1    # a collection version, newer each read
        return node, f"list-{self._list_versions}"

    def merge_patch_node(self, name: str, body: dict) -> dict:
        """Annotations only (what the ledger's node mark writes), guarded by metadata.resourceVersion."""
        with self._lock:
            node = self.get_node(name)
            meta = body.get("metadata") or {}
            if meta.get("resourceVersion") not in (None, node["metadata"]["resourceVersion"]):
                raise Conflict(f"409 node {name} changed")
            annotations = node["metadata"].setdefault("annotations", {})
            for key, value in (meta.get("annotations") or {}).items():
                if value is None:
                    annotations.pop(key, None)
                else:
                    annotations[key] = value
            self.put_node(node)
            return self.get_node(name)

    # -- PodControl --------------------------------------------------------------------------
    def list_pods(self, label_selector: str) -> list[dict]:
        """`key=value` selectors (comma-separated), every namespace, terminated pods included."""
        wanted = dict(part.split("=", 1) for part in label_selector.split(",") if part)
        with self._lock:
            return [copy.deepcopy(p) for p in self.pods
                    if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]

    def read_pod(self, namespace: str, name: str) -> dict | None:
        with self._lock:
            return next((copy.deepcopy(p) for p in self.pods if (p["metadata"].get("namespace"),
                                                                 p["metadata"]["name"]) == (namespace, name)), None)

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        """Gone at once (no kubelet to wait for); idempotent."""
        with self._lock:
            self.pods = [p for p in self.pods if (p["metadata"].get("namespace"), p["metadata"]["name"])
                         != (namespace, name)]

    # -- ConfigMapStore --------------------------------------------------------------------
    def read_configmap(self, namespace: str, name: str, cached: bool = False) -> dict | None:
        """`cached` with `cache_behind` set: the first such read after a write shows the ConfigMap as it was
        before that write (a watch cache behind, as a GET with resourceVersion=0 may be served), the next
        ones as it is (the cache caught up)."""
        with self._lock:
            if cached and self.turned_away:
                self.turned_away -= 1
                raise Overloaded("429 Too Many Requests")
            key = (namespace, name)
            found = self._previous.pop(key) if cached and self.cache_behind and key in self._previous \
                else self.configmaps.get(key)
            return copy.deepcopy(found) if found is not None else None

    def create_configmap(self, namespace: str, body: dict) -> dict:
        key = (namespace, body["metadata"]["name"])
        self._interleave()
        with self._lock:
            self._check_write(key)
            if key in self.configmaps:
                self._refuse(f"409 configmap {key} already exists")
            return self._store(key, body)

    def replace_configmap(self, namespace: str, body: dict) -> dict:
        key = (namespace, body["metadata"]["name"])
        self._interleave()
        with self._lock:
            self._check_write(key)
            if key not in self.configmaps:
                raise LookupError(f"404 configmap {key} not found")
            expected = body["metadata"].get("resourceVersion")
            stored = self.configmaps[key]["metadata"]["resourceVersion"]
            if expected is not None and expected != stored:
                self._refuse(f"409 configmap {key} is at resourceVersion {stored}, not {expected}")
            return self._store(key, body)

    def merge_patch_configmap(self, namespace: str, name: str, body: dict) -> dict | None:
        """Applied to the stored object as it is (no resourceVersion); None removes a key; a 409 only when
        injected (`conflict_next_writes`: the API server giving up its own retries)."""
        key = (namespace, name)
        self._interleave()
        with self._lock:
            if key not in self.configmaps:
                return None
            if self._conflicts:         # the API server gave up on its own retries (heavy contention)
                self._conflicts -= 1
                self._refuse(f"409 configmap {key}: injected conflict on a patch")
            merged = copy.deepcopy(self.configmaps[key])
            for k, v in (body.get("metadata") or {}).get("labels", {}).items():
                merged["metadata"].setdefault("labels", {})[k] = v
            data = merged.setdefault("data", {})
            for k, v in (body.get("data") or {}).items():
                if v is None:
                    data.pop(k, None)
                else:
                    data[k] = v
            return self._store(key, merged)

    # -- internals -------------------------------------------------------------------------
    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _interleave(self) -> None:
        """The writers registered with before_next_write, outside the lock (they may read and write
        from threads of their own, as the ledger does when it writes several shards at once)."""
        while True:
            with self._lock:
                pending = list(self._before_write)
            due = next((entry for entry in pending if entry[0]()), None)
            if due is None:
                return
            with self._lock:
                if due not in self._before_write:
                    continue            # another writer's check ran it
                self._before_write.remove(due)
            due[1]()

    def _check_write(self, key: tuple[str, str]) -> None:
        if self._conflicts:
            self._conflicts -= 1
            if key in self.configmaps:       # another writer got there first
                self.configmaps[key]["metadata"]["resourceVersion"] = self._next_version()
            self._refuse(f"409 configmap {key}: injected conflict")

    def _refuse(self, why: str) -> None:
        self.refused += 1
        raise Conflict(why)

    def _store(self, key: tuple[str, str], body: dict) -> dict:
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = self._next_version()
        self._previous[key] = self.configmaps.get(key)
        self.configmaps[key] = stored
        self.writes += 1
        return copy.deepcopy(stored)


class FakeEcs:
    """ECS as gpuboot sees it: gpuboot.core.ports.Ecs. `calls` lists every start, stop and wait as
    (action, instance ids), and `on_call` observes them; `no_stock` holds instance types out of
    stock (every start of one answers OperationDenied.NoStock); `start_errors` maps an instance
    id to the code its next start answers, once."""

    def __init__(self, instances: Iterable[dict], types: Mapping[str, dict],
                 clock: Callable[[], float]) -> None:
        self.instances = {i["InstanceId"]: copy.deepcopy(i) for i in instances}
        self.types = copy.deepcopy(dict(types))
        self.clock = clock
        self.no_stock: set[str] = set()
        self.start_errors: dict[str, str] = {}
        self.prices: dict[str, float] = {}          # instance type -> hourly price DescribePrice answers
        self.price_errors: dict[str, str] = {}      # instance type -> the code its next DescribePrice answers, once
        self.price_calls: list[tuple[str, str]] = []   # every DescribePrice as (instance type, zone or "")
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self._observers: list[Callable[[str, tuple[str, ...]], object]] = []

    def on_call(self, observer: Callable[[str, tuple[str, ...]], object]) -> None:
        """Call `observer(action, instance ids)` at each start, stop and wait, before it acts."""
        self._observers.append(observer)

    def status(self, instance_id: str) -> str:
        return self.instances[instance_id]["Status"]

    def calls_to(self, action: str) -> list[tuple[str, ...]]:
        return [ids for what, ids in self.calls if what == action]

    def settle(self, instance_ids: Iterable[str] | None = None) -> None:
        """Time passes: what was starting is Running, what was stopping is Stopped."""
        for iid in self.instances if instance_ids is None else instance_ids:
            inst = self.instances.get(iid)
            if inst is not None:
                inst["Status"] = {"Pending": "Running", "Starting": "Running",
                                  "Stopping": "Stopped"}.get(inst["Status"], inst["Status"])

    # -- Ecs -----------------------------------------------------------------------------
    def describe_instances(self, instance_ids: Sequence[str]) -> list[dict]:
        return [copy.deepcopy(self.instances[i]) for i in dict.fromkeys(instance_ids) if i in self.instances]

    def describe_instance_types(self, type_ids: Iterable[str]) -> dict[str, dict]:
        return {t: copy.deepcopy(self.types[t]) for t in sorted(set(type_ids)) if t in self.types}

    def describe_price(self, instance_type: str, zone: str | None) -> float:
        self.price_calls.append((instance_type, zone or ""))
        code = self.price_errors.pop(instance_type, None)
        if code is None and instance_type not in self.prices:
            code = "InvalidInstanceType.ValueNotSupported"
        if code is not None:
            raise EcsError(classify_code(code), code, MESSAGES.get(code, code))
        return self.prices[instance_type]

    def statuses(self, instance_ids: Sequence[str]) -> dict[str, str]:
        return {i: self.instances[i]["Status"] for i in instance_ids if i in self.instances}

    def wait_for_status(self, instance_ids: Sequence[str], wanted: set[str] | frozenset[str],
                        timeout: float) -> dict[str, str]:
        self._called("wait", instance_ids)
        self.settle(instance_ids)
        return self.statuses(instance_ids)

    def start_instances(self, instance_ids: Sequence[str]) -> dict[str, InstanceOutcome]:
        self._called("start", instance_ids)
        return self._power(instance_ids, skip=RUNNING_OR_COMING, defer={"Stopping"}, to="Starting",
                           refusal=self._start_refusal)

    def stop_instances(self, instance_ids: Sequence[str],
                       stopped_mode: str = "StopCharging") -> dict[str, InstanceOutcome]:
        if stopped_mode not in ("StopCharging", "KeepCharging"):
            raise ValueError(f"stopped_mode must be StopCharging or KeepCharging, got {stopped_mode!r}")
        self._called("stop", instance_ids)
        outcomes = self._power(instance_ids, skip=STOPPED_OR_GOING, defer=set(), to="Stopping",
                               refusal=lambda inst: None if inst["Status"] == "Running" else "IncorrectInstanceStatus")
        for iid, outcome in outcomes.items():
            if outcome.outcome == "done":
                self.instances[iid]["StoppedMode"] = stopped_mode
        return outcomes

    # -- internals -------------------------------------------------------------------------
    def _called(self, action: str, instance_ids: Sequence[str]) -> None:
        self.calls.append((action, tuple(instance_ids)))
        for observer in self._observers:
            observer(action, tuple(instance_ids))

    def _start_refusal(self, inst: dict) -> str | None:
        if inst["Status"] != "Stopped":
            return "IncorrectInstanceStatus"
        code = self.start_errors.pop(inst["InstanceId"], None)
        if code is None and inst.get("InstanceType") in self.no_stock:
            code = "OperationDenied.NoStock"
        return code

    def _power(self, instance_ids: Sequence[str], *, skip: Iterable[str], defer: Iterable[str], to: str,
               refusal: Callable[[dict], str | None]) -> dict[str, InstanceOutcome]:
        outcomes: dict[str, InstanceOutcome] = {}
        for iid in dict.fromkeys(instance_ids):
            inst = self.instances.get(iid)
            if inst is None:
                outcomes[iid] = InstanceOutcome(iid, "failed", None, _error("InvalidInstanceId.NotFound"))
                continue
            status = inst["Status"]
            code = None if status in skip or status in defer else refusal(inst)
            if status in skip:
                outcomes[iid] = InstanceOutcome(iid, "already", status)
            elif status in defer:
                outcomes[iid] = InstanceOutcome(iid, "stopping", status)
            elif code is not None:
                outcomes[iid] = InstanceOutcome(iid, "failed", status, _error(code))
            else:
                inst["Status"] = to
                if to == "Starting":      # ECS's minute form, as DescribeInstances gives it
                    inst["StartTime"] = dt.datetime.fromtimestamp(self.clock(), dt.UTC).strftime(
                        "%Y-%m-%dT%H:%MZ")
                outcomes[iid] = InstanceOutcome(iid, "done", status)
        return outcomes


def _error(code: str) -> EcsError:
    return EcsError(classify_code(code), code, MESSAGES.get(code, code))


@dataclass
class Cloud:
    """A fleet on the fakes, with its clock and a ledger on the fake ConfigMap."""

    clock: Clock
    cluster: FakeCluster
    ecs: FakeEcs

    def ledger(self) -> ReservationLedger:
        return ReservationLedger(self.cluster, clock=self.clock)


# One running 1-GPU node, a stopped 1-GPU node and a stopped 2-GPU node (the integration fleet).
FLEET = {"gpu-run": ("Running", T4), "gpu-stop": ("Stopped", T4), "gpu2-stop": ("Stopped", T4X2)}


def cloud(nodes: Mapping[str, tuple[str, str]] = FLEET, clock: Clock | None = None) -> Cloud:
    """`nodes`: name -> (instance status, instance type). A Running node is Ready with its GPUs
    (started an hour ago); any other is NotReady with its last allocatable. All are managed."""
    clock = clock or Clock()
    objs, instances = [], []
    for name, (status, itype) in nodes.items():
        gpus = int(TYPES[itype]["GPUAmount"])
        running = status == "Running"
        objs.append(node(name, gpus=gpus, ready="True" if running else "Unknown", labels={LABEL_MANAGED: "true"}))
        instances.append(instance(name, status, itype=itype, gpus=gpus, start=clock() - 3600 if running else None))
    return Cloud(clock, FakeCluster(objs), FakeEcs(instances, TYPES, clock))

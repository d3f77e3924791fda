"""The ports of the lifecycle layer: what booking and the boot fall-back ask of Kubernetes and ECS.

`gpuboot.lifecycle.booking` and `gpuboot.lifecycle.boot` are written against these Protocols, not against the
adapters (`gpuboot.hooks.kube.KubeClient`, `gpuboot.hooks.ecs.EcsHook`), so that they can be run against
small in-memory fakes (tests/fakes.py) as well as the real clients. Each Protocol lists
exactly the methods the lifecycle calls, with the parameters it passes; a unit test
(tests/unit/gpuboot/core/test_ports.py) checks that the real adapters and the fakes both have them
with compatible signatures, so neither side can drift.

The values that cross the ECS port live here too (core: no I/O library, no Airflow), and the
adapter re-exports them: the outcome of a start or stop per instance (`InstanceOutcome`), a
classified failure (`EcsError`) and which error codes mean which kind (`classify_code`).

Kubernetes objects cross as plain dicts in API form (camelCase), ECS instances in
DescribeInstances form (PascalCase), as the pure core expects.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpuboot.exceptions import EcsError

RUNNING_OR_COMING = frozenset({"Pending", "Starting", "Running"})   # a start of these is "already"
STOPPED_OR_GOING = frozenset({"Stopping", "Stopped"})               # a stop of these is "already"

_TRANSIENT_CODES = frozenset({"ServiceUnavailable", "InternalError", "UnknownError", "RequestTimeout"})
_CAPACITY_MARKERS = ("NoStock", "InsufficientCapacity", "ResourceNotAvailable", "Zone.NotOnSale",
                     "InvalidInstanceType.ZoneNotSupported", "OutOfStock")


def classify_code(code: str | None, status: int | None = None) -> str:
    """Map an ECS error code (and HTTP status) to capacity / transient / permanent."""
    code = code or ""
    if any(marker in code for marker in _CAPACITY_MARKERS):
        return "capacity"
    if code.startswith("Throttling") or code in _TRANSIENT_CODES or (status is not None and status >= 500):
        return "transient"
    return "permanent"


@dataclass(frozen=True)
class InstanceOutcome:
    """What a start/stop did to one instance. outcome: "done" (request accepted),
    "already" (already in or heading to the wanted state), "stopping" (start asked while
    the instance is still Stopping: wait for Stopped, then start), "failed" (see error)."""

    instance_id: str
    outcome: str
    previous_status: str | None = None
    error: EcsError | None = None

    @property
    def ok(self) -> bool:
        return self.outcome in ("done", "already")


class ClusterReads(Protocol):
    """What the lifecycle reads from Kubernetes (`gpuboot.hooks.kube.KubeClient`)."""

    def list_nodes(self) -> list[dict]:
        """Every Node."""
        ...

    def list_active_pods(self) -> list[dict]:
        """Non-terminated pods in every namespace (what still holds node resources)."""
        ...

    def node_to_watch(self, name: str) -> tuple[dict, str]:
        """One Node and the resourceVersion a readiness watch resumes from: the collection's at the
        read, never the Node's own (that of its last write, long compacted on a stopped node)."""
        ...


class PodControl(Protocol):
    """What preemption and launch do to a job's pods (`gpuboot.hooks.kube.KubeClient`)."""

    def list_pods(self, label_selector: str) -> list[dict]:
        """Pods in every namespace, terminated ones included."""
        ...

    def read_pod(self, namespace: str, name: str) -> dict | None:
        ...

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        """Delete (idempotent: a pod already gone is fine)."""
        ...


class ConfigMapStore(Protocol):
    """Where `gpuboot.lifecycle.ledger.ReservationLedger` keeps the ledger (`gpuboot.hooks.kube.KubeClient`):
    ConfigMaps (a root and its shards), each written with compare-and-swap. A write that meets another raises
    `gpuboot.hooks.kube.Conflict` (HTTP 409): create when it exists already, replace when
    body.metadata.resourceVersion is not the stored one."""

    def read_configmap(self, namespace: str, name: str, cached: bool = False) -> dict | None:
        """The ConfigMap with its metadata.resourceVersion; None when there is none. `cached`: any version
        the store has served lately will do (it may be behind the last write)."""
        ...

    def create_configmap(self, namespace: str, body: dict) -> dict:
        ...

    def replace_configmap(self, namespace: str, body: dict) -> dict:
        """Replace guarded by body.metadata.resourceVersion."""
        ...

    def merge_patch_configmap(self, namespace: str, name: str, body: dict) -> dict | None:
        """JSON merge patch (None removes a key), applied to the object as it is: a 409 only when the API
        server gives up its own retries; None when there is no such ConfigMap."""
        ...

    # The ledger's mark on the Nodes it books (ReservationLedger.claim_nodes)
    def get_node(self, name: str) -> dict:
        ...

    def merge_patch_node(self, name: str, body: dict) -> dict:
        """JSON merge patch, guarded (Conflict) when body.metadata.resourceVersion is set."""
        ...


class Ecs(Protocol):
    """What the lifecycle asks of ECS (`gpuboot.hooks.ecs.EcsHook`). Start and stop answer per
    instance (`InstanceOutcome`) and never raise for one instance's failure; a start of an
    instance in RUNNING_OR_COMING and a stop of one in STOPPED_OR_GOING are "already"."""

    def describe_instances(self, instance_ids: Sequence[str]) -> list[dict]:
        """The instances in DescribeInstances form (unknown ids are left out)."""
        ...

    def describe_instance_types(self, type_ids: Iterable[str]) -> dict[str, dict]:
        """Instance types in DescribeInstanceTypes form, keyed by InstanceTypeId."""
        ...

    def describe_price(self, instance_type: str, zone: str | None) -> float:
        """DescribePrice: the pay-as-you-go hourly TradePrice of one instance type (in `zone` when
        given); raises EcsError when ECS has no price for it (gpuboot.lifecycle.pricing caches the answer)."""
        ...

    def statuses(self, instance_ids: Sequence[str]) -> dict[str, str]:
        ...

    def wait_for_status(self, instance_ids: Sequence[str], wanted: set[str] | frozenset[str],
                        timeout: float) -> dict[str, str]:
        """Until every instance is in `wanted` or `timeout` seconds pass: the last statuses seen."""
        ...

    def start_instances(self, instance_ids: Sequence[str]) -> dict[str, InstanceOutcome]:
        """StartInstances; an instance still Stopping answers "stopping" (start it once Stopped)."""
        ...

    def stop_instances(self, instance_ids: Sequence[str],
                       stopped_mode: str = "StopCharging") -> dict[str, InstanceOutcome]:
        ...

"""ECS instances and their power lifecycle, as the ECS API and the kubelets see them.

An instance moves Stopped -> Starting -> Running on StartInstances and
Running -> Stopping -> Stopped on StopInstances; each transition takes the
time `Timings` says, scheduled with `loop.call_later` in the one simcloud event
loop. A new instance added as Pending becomes Stopped the same way (as a
CreateInstance does). Every status change is reported to listeners, which is
how a kubelet learns its machine was powered on or off.

Errors carry the code, message and HTTP status of the real service so the API
layer only serialises them.
"""
from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from simcloud.config import Faults, Timings

log = logging.getLogger(__name__)

STATUSES = ("Pending", "Starting", "Running", "Stopping", "Stopped")
STOPPED_MODES = ("StopCharging", "KeepCharging")

Listener = Callable[["Instance", str, str], None]


def ecs_time(moment: datetime | None = None) -> str:
    """ECS' time format: UTC to the minute, e.g. `2026-11-30T01:02Z`."""
    return (moment or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%MZ")


class EcsError(Exception):
    """An ECS API error: `code`, `message` and the HTTP `status` the real service answers with."""

    def __init__(self, code: str, message: str, status: int):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.status = code, message, status


def not_found(instance_id: str) -> EcsError:
    return EcsError("InvalidInstanceId.NotFound", f"The specified InstanceId does not exist: {instance_id}.", 404)


def incorrect_status(instance: Instance, action: str) -> EcsError:
    return EcsError("IncorrectInstanceStatus",
                    f"The current status of the resource does not support this operation "
                    f"({action} needs {_NEEDS[action]}; {instance.instance_id} is {instance.status}).", 403)


def no_stock() -> EcsError:
    return EcsError("OperationDenied.NoStock",
                    "The requested resource is sold out in the specified zone; "
                    "try other types of resources or other regions and zones.", 403)


_NEEDS = {"start": "Stopped", "stop": "Running"}


@dataclass
class InstanceType:
    instance_type_id: str
    cpu: int
    memory_gib: float
    gpu: int = 0
    gpu_spec: str = ""
    family: str = ""
    price_per_hour: float | None = None

    def __post_init__(self):
        if not self.family:   # ecs.gn6i-c4g1.xlarge -> ecs.gn6i, as ECS names families
            parts = self.instance_type_id.split(".")
            self.family = ".".join(parts[:2]).split("-")[0] if len(parts) > 1 else self.instance_type_id


@dataclass
class Instance:
    instance_id: str
    instance_name: str
    hostname: str
    instance_type: InstanceType
    zone_id: str
    region_id: str
    status: str
    stopped_mode: str = "Not-applicable"   # "StopCharging" | "KeepCharging" | "Not-applicable"
    tags: dict[str, str] = field(default_factory=dict)
    private_ip: str = ""
    creation_time: str = field(default_factory=ecs_time)
    start_time: str | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"instance {self.instance_id}: status {self.status!r} is not one of {', '.join(STATUSES)}")
        if self.status == "Running" and self.start_time is None:
            self.start_time = self.creation_time

    @property
    def provider_id(self) -> str:
        """The Kubernetes Node `spec.providerID` of this instance, as ACK writes it."""
        return f"{self.region_id}.{self.instance_id}"


@dataclass
class Outcome:
    """What one StartInstances/StopInstances item did (the SuccessFirst `InstanceResponse`)."""

    instance_id: str
    previous_status: str
    current_status: str
    error: EcsError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class EcsCloud:
    """The instances of one region and their timed power transitions."""

    def __init__(self, region_id: str, timings: Timings, faults: Faults):
        self.region_id = region_id
        self.timings = timings
        self.faults = faults
        self.instance_types: dict[str, InstanceType] = {}
        self.instances: dict[str, Instance] = {}
        self._listeners: list[Listener] = []
        self._timers: dict[str, asyncio.TimerHandle] = {}

    # ------------------------------------------------------------ fleet

    def add_instance_type(self, t: InstanceType) -> None:
        self.instance_types[t.instance_type_id] = t

    def add_instance(self, instance: Instance) -> None:
        """Register an instance (its type too). A Pending one becomes Stopped after `start_seconds`,
        which needs the running event loop."""
        if instance.instance_id in self.instances:
            raise ValueError(f"duplicate instance id {instance.instance_id}")
        if instance.region_id != self.region_id:
            raise ValueError(f"instance {instance.instance_id} is in region {instance.region_id}, "
                             f"this cloud serves {self.region_id}")
        self.instance_types.setdefault(instance.instance_type.instance_type_id, instance.instance_type)
        self.instances[instance.instance_id] = instance
        if instance.status == "Pending":
            self._after(instance, self.timings.start_seconds, "Stopped")

    def add_listener(self, fn: Listener) -> None:
        """fn(instance, old_status, new_status) on every status change, inside the event loop."""
        self._listeners.append(fn)

    def get(self, instance_id: str) -> Instance:
        try:
            return self.instances[instance_id]
        except KeyError:
            raise not_found(instance_id) from None

    def find(self, *, instance_ids: Iterable[str] | None = None, status: str | None = None,
             instance_type: str | None = None, family: str | None = None, zone_id: str | None = None,
             name: str | None = None, tags: dict[str, str | None] | None = None) -> list[Instance]:
        """Instances matching every given filter, in creation order. A tag value None matches any value;
        `name` may use `*` wildcards."""
        wanted = set(instance_ids) if instance_ids is not None else None
        return [
            i for i in self.instances.values()
            if (wanted is None or i.instance_id in wanted)
            and (status is None or i.status == status)
            and (instance_type is None or i.instance_type.instance_type_id == instance_type)
            and (family is None or i.instance_type.family == family)
            and (zone_id is None or i.zone_id == zone_id)
            and (name is None or fnmatch.fnmatchcase(i.instance_name, name))
            and all(k in i.tags and (v is None or i.tags[k] == v) for k, v in (tags or {}).items())
        ]

    def state(self) -> list[dict]:
        """A compact view for the admin endpoint and logs."""
        return [
            {"instance_id": i.instance_id, "name": i.instance_name, "type": i.instance_type.instance_type_id,
             "zone": i.zone_id, "status": i.status, "stopped_mode": i.stopped_mode}
            for i in self.instances.values()
        ]

    # ------------------------------------------------------------ power actions

    def start_instances(self, instance_ids: list[str], *, all_together: bool = True,
                        dry_run: bool = False) -> list[Outcome]:
        """StartInstances. AllTogether: every instance must be startable or nothing happens (raises the
        first error). SuccessFirst: each instance on its own; failures are reported in its Outcome."""
        return self._power(instance_ids, self._check_start, self._begin_start, all_together, dry_run)

    def stop_instances(self, instance_ids: list[str], *, stopped_mode: str | None = None, force: bool = False,
                       all_together: bool = True, dry_run: bool = False) -> list[Outcome]:
        """StopInstances. `stopped_mode` StopCharging (economical) or KeepCharging (the default);
        ForceStop is accepted and only changes what a real guest OS would see."""
        if stopped_mode is not None and stopped_mode not in STOPPED_MODES:
            raise EcsError("InvalidParameter",
                           f"The specified parameter StoppedMode {stopped_mode!r} is not valid; "
                           f"use {' or '.join(STOPPED_MODES)}.", 400)
        mode = stopped_mode or "KeepCharging"
        return self._power(instance_ids, self._check_stop, lambda i: self._begin_stop(i, mode), all_together, dry_run)

    def close(self) -> None:
        """Cancel pending transitions (server shutdown)."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()

    # ------------------------------------------------------------ internals

    def _power(self, instance_ids, check, begin, all_together: bool, dry_run: bool) -> list[Outcome]:
        if all_together:
            instances = [self.get(i) for i in instance_ids]          # any unknown id fails the whole call
            for instance in instances:
                error = check(instance)
                if error:
                    raise error
            if dry_run:
                return []
            return [self._apply(instance, begin) for instance in instances]
        outcomes = []
        for instance_id in instance_ids:
            instance = self.instances.get(instance_id)
            if instance is None:
                outcomes.append(Outcome(instance_id, "", "", not_found(instance_id)))
                continue
            error = check(instance)
            if error or dry_run:
                outcomes.append(Outcome(instance_id, instance.status, instance.status, error))
            else:
                outcomes.append(self._apply(instance, begin))
        return outcomes

    def _apply(self, instance: Instance, begin) -> Outcome:
        previous = instance.status
        begin(instance)
        return Outcome(instance.instance_id, previous, instance.status)

    def _check_start(self, instance: Instance) -> EcsError | None:
        if instance.status != "Stopped":
            return incorrect_status(instance, "start")
        if self.faults.no_stock_for(instance.instance_type.instance_type_id, instance.zone_id):
            return no_stock()
        return None

    def _check_stop(self, instance: Instance) -> EcsError | None:
        return incorrect_status(instance, "stop") if instance.status != "Running" else None

    def _begin_start(self, instance: Instance) -> None:
        self._set_status(instance, "Starting")
        self._after(instance, self.timings.start_seconds, "Running")

    def _begin_stop(self, instance: Instance, mode: str) -> None:
        self._set_status(instance, "Stopping")
        self._after(instance, self.timings.stop_seconds, "Stopped", mode)

    def _after(self, instance: Instance, delay: float, status: str, stopped_mode: str | None = None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("EcsCloud transitions need the running simcloud event loop") from None

        def finish():
            self._timers.pop(instance.instance_id, None)
            if status == "Running":
                instance.start_time = ecs_time()
            if stopped_mode is not None:
                instance.stopped_mode = stopped_mode
            self._set_status(instance, status)

        self._timers[instance.instance_id] = loop.call_later(max(delay, 0.0), finish)

    def _set_status(self, instance: Instance, new: str) -> None:
        old = instance.status
        if old == new:
            return
        instance.status = new
        if new in ("Starting", "Running"):
            instance.stopped_mode = "Not-applicable"
        log.info("ecs %s: %s -> %s", instance.instance_id, old, new)
        for fn in list(self._listeners):
            try:
                fn(instance, old, new)
            except Exception:   # a broken listener must not break the cloud's own state machine
                log.exception("ecs listener %r failed on %s %s -> %s", fn, instance.instance_id, old, new)

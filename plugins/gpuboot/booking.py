"""Place and reserve: the one transaction behind the place step and every re-placement.

Read the ledger, then the cluster (Nodes, active pods, their ECS instances), place the
job with the pure core (other jobs' live reservations counted, unavailable offerings and
nodes left out), and commit the job's reservations with compare-and-swap on the version
read; a conflict means someone else wrote in between, so read and place again.

The ledger is read first so that a reservation released after this read belongs to a pod
that the (later) pod listing already shows. Marks (`Unavailable`) written by a
re-placement go into the same commit as the job's new reservations: any placement that
commits afterwards has read them, which is what makes stopping an abandoned node safe.
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuboot.ecs import EcsHook
from gpuboot.inventory import NodeView, Reservation, build_inventory, parse_provider_id
from gpuboot.jobspec import JobSpec
from gpuboot.kube import KubeClient
from gpuboot.ledger import LedgerConflict, LedgerState, ReservationLedger
from gpuboot.placement import Outcome, Plan, Unavailable, place

LAUNCH_MARGIN_SECONDS = 900     # reservation lifetime beyond the boot timeout (launch + scheduling)


class LedgerContended(Exception):
    """Every commit attempt met a conflicting write; retry later."""


def instance_id_of(node: dict) -> str | None:
    parsed = parse_provider_id((node.get("spec") or {}).get("providerID"))
    return parsed[1] if parsed else None


@dataclass(frozen=True)
class Survey:
    """What one placement saw: raw Nodes and active pods (API form) and the joined views."""

    nodes: list[dict]
    pods: list[dict]
    views: list[NodeView]


def survey(kube: KubeClient, ecs: EcsHook, reservations: list[Reservation], now: float,
           boot_grace_seconds: float = 900) -> Survey:
    """Nodes and active pods from Kubernetes joined to their ECS instances and types."""
    nodes = kube.list_nodes()
    pods = kube.list_active_pods()
    ids = sorted({i for i in map(instance_id_of, nodes) if i})
    instances = ecs.describe_instances(ids) if ids else []
    types = ecs.describe_instance_types({i["InstanceType"] for i in instances if i.get("InstanceType")})
    return Survey(nodes, pods, build_inventory(nodes, pods, instances, types, reservations, now,
                                               boot_grace_seconds=boot_grace_seconds))


def reservation_ttl(spec: JobSpec) -> float:
    """How long a reservation lives: the spec's own TTL, else its boot timeout plus launch time."""
    return spec.reservation_ttl_seconds or spec.boot_timeout_seconds + LAUNCH_MARGIN_SECONDS


@dataclass(frozen=True)
class Booking:
    """A committed placement (or, with `release_unplaced`, a committed release) and what it was based on."""

    plan: Plan
    committed: bool
    state: LedgerState          # the ledger the commit was compare-and-swapped against
    survey: Survey              # read after that ledger state


class Booker:
    """Place-and-reserve for one job, against the ledger in `ledger.namespace`."""

    def __init__(self, kube: KubeClient, ecs: EcsHook, ledger: ReservationLedger, log: logging.Logger, *,
                 max_commit_attempts: int = 20, boot_grace_seconds: float = 900,
                 clock: Callable[[], float] = time.time) -> None:
        self.kube, self.ecs, self.ledger, self.log = kube, ecs, ledger, log
        self.max_commit_attempts, self.boot_grace_seconds, self.clock = max_commit_attempts, boot_grace_seconds, clock

    def book(self, spec: JobSpec | None, job_id: str, *, marks: Sequence[Unavailable] = (),
             release_unplaced: bool = False, place_job: bool = True) -> Booking:
        """Place `spec` as `job_id` and commit its reservations (replacing any it held) plus `marks`.

        When the job does not fit, nothing is written unless `release_unplaced` (a re-placement:
        the job's old reservations go and the marks are kept either way). `place_job=False`
        only releases and marks (a job giving up), with the same survey for claim checks."""
        if place_job and spec is None:
            raise ValueError(f"job {job_id}: a job spec is needed to place it")
        request = spec.to_job_request(job_id) if place_job else None
        ttl = reservation_ttl(spec) if place_job else 0.0
        for attempt in range(1, self.max_commit_attempts + 1):
            state = self.ledger.snapshot()
            now = self.clock()
            unavailable = [*state.live_unavailable(now), *marks]
            seen = survey(self.kube, self.ecs, state.others(job_id, now), now, self.boot_grace_seconds)
            plan = (place(request, seen.views, unavailable) if place_job
                    else Plan(job_id, Outcome.BUSY, "not placed: the job is giving up"))
            fits = plan.outcome == Outcome.FITS
            if not fits and not release_unplaced:
                return Booking(plan, False, state, seen)
            reservations = [Reservation(job_id=job_id, task=a.task, node=a.node, resources=a.requests,
                                        expires_at=now + ttl) for a in plan.assignments] if fits else []
            try:
                self.ledger.commit(job_id, reservations, state.version, marks)
            except LedgerConflict as exc:
                self.log.info("ledger changed while placing (%s); re-placing (attempt %d)", exc, attempt)
                continue
            for mark in marks:
                self.log.info("marked %s unavailable until %s: %s", mark.what, _stamp(mark.expires_at), mark.reason)
            if fits:
                self.log.info("reserved until %s: %s", _stamp(now + ttl),
                              "; ".join(f"{r.task} -> {r.node} ({r.resources})" for r in reservations))
            else:
                self.log.info("released the reservations of job %s: it no longer fits (%s)", job_id, plan.outcome.value)
            return Booking(plan, True, state, seen)
        raise LedgerContended(f"ledger stayed contended for {self.max_commit_attempts} attempts; retry later")


def _stamp(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).isoformat(timespec="seconds")

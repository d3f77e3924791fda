"""Place and reserve: the one transaction behind the place step and every re-placement.

Read the ledger, then the cluster (Nodes, active pods, their ECS instances), place the
job with the pure core (other jobs' live reservations counted, unavailable offerings and
nodes left out), and commit the job's reservations with compare-and-swap on the version
read; a conflict means someone else wrote in between, so read and place again.

The ledger is read first so that a reservation released after this read belongs to a pod
that the (later) pod listing already shows.

Bursts: a conflict does not read the cluster again. N placers at once each commit once and
conflict with the others' commits; reading Nodes, Pods and ECS again on every conflict would make
a burst cost N^2 full reads. So on a conflict the placer re-reads only the ledger and re-places
against the survey it already holds (its views were built without reservations, so counting the
new ledger's costs the reservations only), with jittered backoff between attempts, until
`contended_seconds`; then `LedgerContended` (the place step defers, holding nothing, and tries
again). Why that is safe, for a survey S read after ledger seq s0 and a commit against the
ledger L read now: capacity promised or in use by gpuboot jobs is (a) a pod bound before S's pod
listing: S shows it; (b) a reservation live in L: counted (unless S shows its pod, which then
counts); (c) a reservation released after s0 (its pod may have been bound after S's listing):
every write after s0 that removed one left a tombstone with its seq > s0, and L still holds all of
them (`LedgerState.released_since` refuses when `tombstones_from` > s0, and the placer reads the
cluster again), so they are counted as if still reserved; (d) a reservation released at or before
s0: releases happen only once the pod is bound (or will never be), so its pod was bound before S
and S shows it (a). Nothing promised is missed, and the commit is still compare-and-swapped
against L, so promises stay serialised by the ledger alone. What a reused survey may miss is what
any survey misses between its read and the commit (pods not made by gpuboot, node and instance
state changes): the survey is read again once older than SURVEY_MAX_AGE_SECONDS, before a BUSY
verdict, and before any commit that would stop a node (that decision needs the cluster as it is
after the ledger state committed against: see "Abandoned nodes"). Marks (`Unavailable`) written by a
re-placement go into the same commit as the job's new reservations: any placement that
commits afterwards has read them, which is what makes stopping an abandoned node safe.

Abandoned nodes. The job's ledger record lists the instances it started (by any try or
step). Whenever a commit moves the job off such a node (a fail-over, a re-placement after a
retry, a re-run of `place`, the run giving up or ending without a pod there), the node is
stopped again unless another job claims it. Why that cannot stop a node under a new claim:
the claim check uses the ledger state the commit is compare-and-swapped against plus pods
listed after reading it, so every claim committed before ours is seen; and the same commit
writes a mark on each node to stop (its boot-failure mark, or a short "being stopped"
fence), so every placement that commits after ours has read the mark and leaves the node
alone. Once StopInstances is accepted the node reads Stopping (placement then plans a
start after the stop), and the fence is dropped; a crash before that leaves the fence to
expire after STOP_FENCE_SECONDS.

Marks rest on evidence. A node mark from a boot timeout carries the bootID the failed boot
left; it is dropped as soon as the node is Ready with its GPUs or reports another boot, so
one job's timeout does not keep a healthy node out for everyone until the mark expires.
The job's own verdicts (`JobRecord.failed`) keep that job off the node for its whole run.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from gpuboot.core.idle import find_work
from gpuboot.core.inventory import backed_tasks, build_inventory, parse_provider_id, with_reservations
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import NodeState, NodeView, Reservation, Unavailable
from gpuboot.core.placement import Outcome, Plan, place
from gpuboot.core.ports import ClusterReads, Ecs
from gpuboot.core.timefmt import utc
from gpuboot.exceptions import LedgerContended
from gpuboot.lifecycle.ledger import JobRecord, LedgerConflict, LedgerState, ReservationLedger, StartedNode, backoff
from gpuboot.lifecycle.pricing import PRICES, PriceCache

LAUNCH_MARGIN_SECONDS = 900     # reservation lifetime beyond the boot timeout (launch + scheduling)
STARTING_WAIT_SECONDS = 300     # ECS refuses to stop a Pending/Starting instance: wait this long for Running
STOP_FENCE_SECONDS = STARTING_WAIT_SECONDS + 300   # a "being stopped" fence, if the run dies before dropping it
FENCE_REASON = "being stopped"
SURVEY_MAX_AGE_SECONDS = 30     # a placer re-places against a cluster survey at most this old (see the module doc)
CONTENDED_SECONDS = 30          # book() retries through conflicts this long, then LedgerContended (the step defers)


def instance_id_of(node: dict) -> str | None:
    parsed = parse_provider_id((node.get("spec") or {}).get("providerID"))
    return parsed[1] if parsed else None


@dataclass(frozen=True)
class Survey:
    """What one placement saw: raw Nodes and active pods (API form) and the joined views.
    `bare`: the views without any reservation, and `backed` the (node, job, task) of gpuboot pods,
    so that other reservations can be counted again without reading the cluster (`recounted`)."""

    nodes: list[dict]
    pods: list[dict]
    views: list[NodeView]
    bare: tuple[NodeView, ...] = ()
    backed: frozenset = frozenset()

    def recounted(self, reservations: list[Reservation], now: float) -> Survey:
        return Survey(self.nodes, self.pods, with_reservations(self.bare, self.backed, reservations, now),
                      self.bare, self.backed)


def survey(kube: ClusterReads, ecs: Ecs, reservations: list[Reservation], now: float,
           boot_grace_seconds: float = 900, prices: PriceCache = PRICES) -> Survey:
    """Nodes and active pods from Kubernetes joined to their ECS instances, types and prices
    (DescribePrice through the shared, TTL'd `prices` cache): the full cluster read."""
    nodes = kube.list_nodes()
    pods = kube.list_active_pods()
    ids = sorted({i for i in map(instance_id_of, nodes) if i})
    instances = ecs.describe_instances(ids) if ids else []
    types = ecs.describe_instance_types({i["InstanceType"] for i in instances if i.get("InstanceType")})
    return joined(nodes, pods, instances, priced_types(ecs, instances, types, prices), reservations, now,
                  boot_grace_seconds)


def priced_types(ecs: Ecs, instances: Sequence[dict], types: Mapping[str, dict], prices: PriceCache = PRICES) -> dict:
    """`types` with each (type, zone) price of `instances` from the shared, TTL'd `prices` cache."""
    out = dict(types)
    priced = prices.prices(ecs, {(i["InstanceType"], i.get("ZoneId")) for i in instances if i.get("InstanceType")},
                           getattr(ecs, "region_id", "") or "")
    for (itype, zone), price in priced.items():
        if itype in out and price is not None:
            out[itype] = {**out[itype], "PricesPerHour": {**out[itype].get("PricesPerHour", {}), zone: price}}
    return out


def joined(nodes: list[dict], pods: list[dict], instances: list[dict], types: Mapping[str, dict],
           reservations: list[Reservation], now: float, boot_grace_seconds: float = 900) -> Survey:
    """The survey of these Nodes, pods and instances (however they were read: `survey`, or the
    watch-fed `gpuboot.lifecycle.view.ClusterView`)."""
    bare = tuple(build_inventory(nodes, pods, instances, dict(types), [], now, boot_grace_seconds=boot_grace_seconds))
    return Survey(nodes, pods, [], bare, frozenset(backed_tasks(pods))).recounted(reservations, now)


def rejoined(previous: Survey, touched: Collection[str], nodes: list[dict], pods: list[dict], instances: list[dict],
             types: Mapping[str, dict], now: float, boot_grace_seconds: float = 900) -> Survey:
    """`joined` with no reservations, for Nodes and pods of which only those on the `touched` nodes differ
    from the ones `previous` was joined from: those nodes' views built again, every other one kept (in the
    order of `nodes`, as `joined` gives them). Kept views keep their twin tokens and built ones get new
    ones, so twins across the two are judged twice: never judged as one unless alike."""
    kept = {v.name: v for v in previous.bare}
    touched = set(touched) | {n["metadata"]["name"] for n in nodes if n["metadata"]["name"] not in kept}
    fresh = {v.name: v for v in build_inventory([n for n in nodes if n["metadata"]["name"] in touched],
                                                [p for p in pods if (p.get("spec") or {}).get("nodeName") in touched],
                                                instances, dict(types), [], now, boot_grace_seconds=boot_grace_seconds)}
    bare = tuple(fresh.get(name) or kept[name] for name in (n["metadata"]["name"] for n in nodes))
    return Survey(nodes, pods, [], bare, frozenset(backed_tasks(pods))).recounted([], now)


@dataclass(frozen=True)
class Basis:
    """A survey and the ledger it was read after (`seq`), when (monotonic), and the marks then."""

    seq: int
    survey: Survey
    at: float
    marks: frozenset

    def reusable(self, state: LedgerState, job_id: str, now_monotonic: float) -> list[Reservation] | None:
        """The reservations to count on top of `state`'s live ones when re-placing against this survey
        (the tombstones of releases since it was read), or None: read the cluster again (module doc)."""
        if now_monotonic - self.at > SURVEY_MAX_AGE_SECONDS:
            return None
        return state.released_since(self.seq, job_id)


def plan_nodes(plans: Sequence[Plan], nodes: Sequence[dict]) -> list[dict]:
    """The Nodes (API form) the plans' assignments use."""
    used = {a.node for p in plans for a in p.assignments}
    return [n for n in nodes if n["metadata"]["name"] in used]


def reservation_ttl(spec: JobSpec) -> float:
    """How long a reservation lives when taken: never less than the boot timeout plus the launch
    (what the run still needs after placing), whatever `reservation_ttl_seconds` says.

    Why a user TTL may only lengthen it: the TTL exists for crashed runs; a shorter one let a
    live run's reservation expire while its node booted and another job was placed on the
    same GPUs. A live run also renews what it holds before each wait (`JobBoot.hold`)."""
    return max(float(spec.reservation_ttl_seconds or 0), spec.boot_timeout_seconds + LAUNCH_MARGIN_SECONDS)


def outdated_marks(marks: Sequence[Unavailable], nodes: Sequence[dict], views: Sequence[NodeView]) -> list[Unavailable]:
    """Boot-failure node marks whose evidence is gone: the node is Ready with its GPUs now, or it
    reports a bootID other than the one the failed boot left. Only marks that carry boot
    evidence (`boot_id` not None) qualify; offering marks and stop fences never do."""
    ready = {v.name for v in views if v.state == NodeState.READY}
    boot_ids = {(n.get("metadata") or {}).get("name"): ((n.get("status") or {}).get("nodeInfo") or {}).get("bootID")
                for n in nodes}
    return [m for m in marks if m.node is not None and m.boot_id is not None
            and (m.node in ready or (m.boot_id and boot_ids.get(m.node) and boot_ids[m.node] != m.boot_id))]


@dataclass(frozen=True)
class Change:
    """What one commit writes for the job: reservations, stop fences, and its record."""

    reservations: list[Reservation]
    fences: list[Unavailable]
    record: JobRecord | None


@dataclass(frozen=True)
class Booking:
    """A committed placement (or, with `release_unplaced`, a committed release) and what it was based on."""

    plan: Plan
    committed: bool
    state: LedgerState | None   # the ledger the commit was compare-and-swapped against (None: a batch's answer
                                # to a waiter that never read the ledger root)
    survey: Survey              # read after that ledger state
    record: JobRecord | None = None   # the job's record as committed


class Booker:
    """Place-and-reserve for one job, against the ledger in `ledger.namespace`."""

    def __init__(self, kube: ClusterReads, ecs: Ecs, ledger: ReservationLedger, log: logging.Logger, *,
                 max_commit_attempts: int | None = None, boot_grace_seconds: float = 900,
                 clock: Callable[[], float] = time.time, contended_seconds: float = CONTENDED_SECONDS,
                 sleep: Callable[[float], None] = time.sleep, monotonic: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.kube, self.ecs, self.ledger, self.log = kube, ecs, ledger, log
        self.max_commit_attempts, self.boot_grace_seconds, self.clock = max_commit_attempts, boot_grace_seconds, clock
        self.contended_seconds, self.sleep, self.monotonic, self.rng = contended_seconds, sleep, monotonic, rng
        self.full_reads = 0     # cluster surveys this booker made (the burst bench counts them)

    def book(self, spec: JobSpec | None, job_id: str, *, marks: Sequence[Unavailable] = (),
             release_unplaced: bool = False, place_job: bool = True, failed: Mapping[str, str] | None = None,
             keep_running: Collection[str] = (), why: str = "the job is giving up",
             held: Sequence[Unavailable] = ()) -> Booking:
        """Place `spec` as `job_id` and commit its reservations (replacing any it held) plus `marks`.

        When the job does not fit, nothing is written unless `release_unplaced` (a re-placement:
        the job's old reservations go and the marks are kept either way). `place_job=False`
        only releases and marks (a job giving up or ending). `held`: nodes the job queue holds for
        other jobs (gpuboot.core.queue), kept out of this plan but never written. `failed` (node -> why) adds this
        job's own verdicts to its record, in the same commit; the job is never placed on a node
        that failed for it. Nodes the job started and the commit moves it off are stopped again
        unless claimed (see the module doc), except those in `keep_running` (its pod ran there).

        Conflicts are retried with jittered backoff, re-placing against the survey already read
        (module doc, "Bursts"), for `contended_seconds` (and at most `max_commit_attempts`, when
        set); then LedgerContended, with nothing written."""
        if place_job and spec is None:
            raise ValueError(f"job {job_id}: a job spec is needed to place it")
        request = spec.to_job_request(job_id) if place_job else None
        ttl = reservation_ttl(spec) if place_job else 0.0
        give_up = self.monotonic() + self.contended_seconds
        basis: Basis | None = None
        attempt = 0
        while True:
            attempt += 1
            state, now = self.ledger.snapshot(), self.clock()
            record = self._job_record(state, job_id, now, failed)                  # 1. what the job holds
            basis, seen = self._survey(basis, state, job_id, now)                  # 2. the cluster
            fresh = basis.seq == state.seq      # read after this very ledger state: the unconditional case
            outdated, plan = self._place(request, job_id, why, state, basis, seen, [*marks, *held], record, now)
            fits = plan.outcome == Outcome.FITS
            if place_job and not fits and not fresh:
                basis = None        # a verdict of "busy" (or never) rests on the cluster as it is now
                continue
            if not fits and not release_unplaced:
                return Booking(plan, False, state, seen, record)
            to_stop, claimed = self._abandoned(record, plan if fits else None, seen, state, job_id, now, keep_running)
            if to_stop and not fresh:
                basis = None        # stopping a node needs pods listed after this ledger state (module doc)
                continue
            change = self._change(job_id, plan if fits else None, ttl, now, marks, to_stop, record)   # 4.
            if fits:
                self.ledger.claim_nodes(plan_nodes([plan], seen.nodes))   # SecondLedger: another ledger books them
            try:                                                                   # 5. compare-and-swap
                self.ledger.commit(job_id, change.reservations, state.version, [*marks, *change.fences],
                                   record=change.record, drop_unavailable=outdated, state=state)
            except LedgerConflict as exc:
                self._back_off(exc, attempt, give_up)
                continue
            self._report(job_id, plan, change, outdated, marks, claimed, now + ttl,   # 6. say what was done
                         None if place_job else why)
            self._stop(to_stop, change.fences)                                      # 7. stop what it left
            return Booking(plan, True, state, seen, change.record)

    def _job_record(self, state: LedgerState, job_id: str, now: float,
                    failed: Mapping[str, str] | None) -> JobRecord | None:
        """The job's record in the ledger, with this call's own failed nodes added."""
        record = state.record(job_id, now)
        if failed:
            record = (record or JobRecord(job_id, now)).with_failed(dict(failed))
        return record

    def _survey(self, basis: Basis | None, state: LedgerState, job_id: str, now: float) -> tuple[Basis, Survey]:
        """The cluster as placement sees it: the survey already read, recounted with the releases
        since (module doc, "Bursts"), or a full read when there is none or it is too old."""
        others = state.others(job_id, now)
        released = basis.reusable(state, job_id, self.monotonic()) if basis is not None else None
        if basis is None or released is None:
            self.full_reads += 1
            began = self.monotonic()    # its age counts from before the first list
            basis = Basis(state.seq, survey(self.kube, self.ecs, others, now, self.boot_grace_seconds),
                          began, frozenset(state.live_unavailable(now)))
            return basis, basis.survey
        return basis, basis.survey.recounted([*others, *released], now)

    @staticmethod
    def _place(request, job_id: str, why: str, state: LedgerState, basis: Basis, seen: Survey,
               marks: Sequence[Unavailable], record: JobRecord | None, now: float) -> tuple[list[Unavailable], Plan]:
        """The marks whose evidence is gone, and the plan: the pure core's placement against the live
        marks, this call's and the job's own failures (or, releasing only, an empty plan)."""
        outdated = outdated_marks([m for m in state.live_unavailable(now) if m in basis.marks], seen.nodes, seen.views)
        own = [Unavailable(reason=f"failed for this job: {w}", expires_at=float("inf"), node=n, failed_for_job=True)
               for n, w in sorted((record.failed_nodes if record else {}).items())]
        unavailable = [*(m for m in state.live_unavailable(now) if m not in outdated), *marks, *own]
        plan = place(request, seen.views, unavailable) if request is not None else \
            Plan(job_id, Outcome.BUSY, f"not placed: {why}")
        return outdated, plan

    @staticmethod
    def _change(job_id: str, plan: Plan | None, ttl: float, now: float, marks: Sequence[Unavailable],
                to_stop: Sequence[StartedNode], record: JobRecord | None) -> Change:
        """What the commit writes: the plan's reservations, a stop fence on each node to stop, and the
        job's record without the nodes it leaves."""
        reservations = [Reservation(job_id=job_id, task=a.task, node=a.node, resources=a.requests,
                                    expires_at=now + ttl) for a in plan.assignments] if plan else []
        marked = {m.node for m in marks if m.node}
        fences = [Unavailable(reason=f"{FENCE_REASON}: abandoned by job {job_id}", expires_at=now + STOP_FENCE_SECONDS,
                              node=s.node) for s in to_stop if s.node not in marked]
        if record is not None:
            gone = {s.node for s in to_stop}
            record = JobRecord(job_id, max(record.expires_at, now + ttl),
                               tuple(s for s in record.started if s.node not in gone), record.failed)
        return Change(reservations, fences, record)

    def _back_off(self, conflict: LedgerConflict, attempt: int, give_up: float) -> None:
        """Wait a jittered while before placing again, or give up (LedgerContended, nothing written)."""
        if self.monotonic() >= give_up or (self.max_commit_attempts is not None and attempt >= self.max_commit_attempts):
            raise LedgerContended(f"ledger stayed contended for {attempt} attempts "
                                  f"({self.contended_seconds:g} s at most); nothing held, retry later") from None
        pause = backoff(attempt, base=0.05, cap=2.0, rng=self.rng)
        self.log.info("ledger changed while placing (%s); re-placing in %.2fs (attempt %d)", conflict, pause, attempt)
        self.sleep(pause)

    def _report(self, job_id: str, plan: Plan, change: Change, outdated: Sequence[Unavailable],
                marks: Sequence[Unavailable], claimed: Mapping[str, str], expires_at: float,
                released_because: str | None) -> None:
        for mark in outdated:
            self.log.info("dropped the mark on %s (%s): the node is Ready or booted again since", mark.what,
                          mark.reason)
        for mark in marks:
            self.log.info("marked %s unavailable until %s: %s", mark.what, utc(mark.expires_at), mark.reason)
        if plan.outcome == Outcome.FITS:
            self.log.info("reserved until %s: %s", utc(expires_at),
                          "; ".join(f"{r.task} -> {r.node} ({r.resources})" for r in change.reservations))
        elif released_because is not None:
            self.log.info("released the reservations of job %s: %s", job_id, released_because)
        elif plan.outcome == Outcome.BUSY:
            self.log.info("released the reservations of job %s: it waits, holding nothing, until capacity frees up "
                          "(%s)", job_id, plan.message)
        else:
            self.log.info("released the reservations of job %s: it can no longer run in this fleet (%s)", job_id,
                          plan.message)
        for node, claim in claimed.items():
            self.log.info("node %s: started by this job, not stopping it, another job claims it: %s", node, claim)

    def _abandoned(self, record: JobRecord | None, plan: Plan | None, seen: Survey, state: LedgerState, job_id: str,
                   now: float, keep_running: Collection[str]):
        """Started nodes this commit moves the job off: those to stop, and the claimed ones (node -> claim)."""
        if record is None:
            return [], {}
        placed = {a.node for a in plan.assignments} if plan else set()
        work = find_work(seen.nodes, seen.pods, state.others(job_id, now), now)
        to_stop, claimed = [], {}
        for started in record.started:
            if started.node in placed or started.node in keep_running:
                continue
            if started.node in work:
                claimed[started.node] = work[started.node][1]
            else:
                to_stop.append(started)
        return to_stop, claimed

    def _stop(self, to_stop, fences: Sequence[Unavailable]) -> None:
        """StopInstances (StopCharging) on each abandoned node, then drop the fences (see the module doc).
        ECS refuses to stop an instance still Pending/Starting, so those are waited for first."""
        ids = [s.instance_id for s in to_stop]
        booting = [i for i, st in (self.ecs.statuses(ids) if ids else {}).items() if st in ("Pending", "Starting")]
        if booting:
            self.log.info("waiting for %s to finish starting before stopping them", booting)
            self.ecs.wait_for_status(booting, {"Running", "Stopping", "Stopped"}, STARTING_WAIT_SECONDS)
        for started in to_stop:
            outcome = self.ecs.stop_instances([started.instance_id], stopped_mode="StopCharging")[started.instance_id]
            if outcome.outcome == "already":
                self.log.info("node %s (%s): this job asked for its start, and it is %s now", started.node,
                              started.instance_id, outcome.previous_status)
            elif outcome.ok:
                self.log.info("node %s (%s): stopped again (StopCharging): this job started it and no other job "
                              "claims it", started.node, started.instance_id)
            else:
                self.log.warning("node %s (%s): stop failed (%s); idle scale-down will retry", started.node,
                                 started.instance_id, outcome.error)
        if fences:
            self.ledger.drop_unavailable(fences)

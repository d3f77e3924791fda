"""Bring a job's planned nodes up, and fall back to other capacity when they do not come up.

Shared by the start step (capacity errors) and the GPU-readiness sensor (boot timeouts), so
that both re-place through the same `Booker` transaction and log the same way:

- `bring_up`: StartInstances for the plan's stopped instances (one still Stopping is started
  once Stopped) and the per-node baselines the readiness rule needs. A capacity error
  (OperationDenied.NoStock and friends) marks that instance type in that zone unavailable
  for `unavailable_ttl_seconds` in the ledger, drops the job's reservations and re-places it
  in one commit, then starts the new plan's nodes; at most `max_attempts` plans are tried.
- `fail_over`: nodes that were not GPU-ready in time fail for this job (its ledger record)
  and, when a boot was being waited for, are marked unavailable for everyone (with the
  bootID the failed boot left, so the mark goes once the node is Ready or boots again); a
  node that was already up when the job chose it had no boot to fail, so it is never marked.
  The job is re-placed in the same commit, and each node this job started that the commit
  moves it off is stopped again unless another job claims it (gpuboot.lifecycle.booking explains why
  that cannot race a new claim).
- `finish`: the same release and stop, with no re-placement (the run is failing,
  or ending: nodes where the job's pod ran are left to idle scale-down).

Idempotence for retries: every instance the job starts is written to its ledger record
*before* StartInstances is called, with the time and the bootID before; StartInstances on an
instance already Pending, Starting or Running is a no-op ("already"). Where the job is
placed, what it started and which nodes failed for it is what the ledger holds, not an XCom
from an earlier try: `current_plan` re-places when the ledger no longer holds the plan's
tasks or a planned node already failed for the job, and every try and step (start, the
sensor) goes through `ensure_up`, so a retry neither waits again on a failed node nor
forgets a node an earlier try started.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuboot.core.inventory import parse_time
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import NodeState, Unavailable
from gpuboot.core.placement import Assignment, Outcome, Plan
from gpuboot.core.ports import ClusterReads, Ecs, EcsError, InstanceOutcome
from gpuboot.core.readiness import BootBaseline, extended_needs
from gpuboot.core.timefmt import utc
from gpuboot.exceptions import BootError, CapacityBusy, CapacityUnavailable, JobPreempted
from gpuboot.lifecycle.booking import LAUNCH_MARGIN_SECONDS, Booker, reservation_ttl
from gpuboot.lifecycle.jobqueue import JobQueue, Preempted
from gpuboot.lifecycle.ledger import JobRecord, ReservationLedger, StartedNode

DEFAULT_UNAVAILABLE_TTL_SECONDS = 600
ALREADY_UP_GRACE_SECONDS = 60   # how long a node that was up when chosen may take to pass the rule (plus settle)
START_TIME_PRECISION_SECONDS = 60   # ECS's StartTime ("2026-12-06T17:12Z") is to the minute, floored


def wait_deadline(baseline: Mapping, boot_timeout: float, settle: float, now: float) -> float:
    """Until when to wait for one node. A node being booted gets the boot timeout from its start
    request (the first one, by any try: a retry does not restart the clock), and always at
    least one settle window from now (a node that is ready must be seen holding it). A node
    that was already up when the job chose it has no boot to wait for: the boot timeout does
    not apply to it, only a settle window plus ALREADY_UP_GRACE_SECONDS."""
    since = baseline.get("start_requested_at")
    if since is None:
        return now + settle + ALREADY_UP_GRACE_SECONDS
    # a start known only to the minute (ECS's StartTime) gets its timeout from the latest it can have been
    return max(float(since) + float(baseline.get("start_window_seconds") or 0.0) + boot_timeout, now + settle + 1)


@dataclass
class BringUp:
    """The plan the job ends up on, its boot baselines (JSON) and the instances this call started."""

    plan: Plan
    baselines: list[dict]
    started: list[str]
    tried: list[str] = field(default_factory=list)


def slim(plan: Plan) -> Plan:
    """The plan without its candidate table (kept small for XCom and trigger state)."""
    return replace(plan, candidates=(), candidates_omitted=0)


class JobBoot:
    """Bring-up and fall-back for one job (`spec` as `job_id`)."""

    def __init__(self, kube: ClusterReads, ecs: Ecs, ledger: ReservationLedger, log: logging.Logger, *,
                 spec: JobSpec | None, job_id: str, max_attempts: int = 3,
                 unavailable_ttl_seconds: float = DEFAULT_UNAVAILABLE_TTL_SECONDS,
                 stopping_timeout_seconds: float = 600, boot_grace_seconds: float = 900,
                 clock: Callable[[], float] = time.time, handling: Preempted | None = None) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.kube, self.ecs, self.ledger, self.log = kube, ecs, ledger, log
        self.spec, self.job_id, self.max_attempts = spec, job_id, max_attempts
        self.handling = handling      # the preemption the requeue carries out (its own re-placements go on)
        self.unavailable_ttl_seconds, self.stopping_timeout_seconds = unavailable_ttl_seconds, stopping_timeout_seconds
        self.clock = clock
        self.booker = Booker(kube, ecs, ledger, log, boot_grace_seconds=boot_grace_seconds, clock=clock)

    # -- what the job holds ----------------------------------------------------------------
    def record(self) -> JobRecord | None:
        return self.ledger.snapshot().record(self.job_id, self.clock())

    def hold(self, seconds: float) -> None:
        """Renew the job's reservations and record to last at least `seconds` from now.

        Safety argument: an entry of a live run must not expire while the run still counts on
        it. Each step calls this before it starts waiting, with its own longest wait plus the
        launch (the start step: stopping wait + boot timeout + launch; the sensor: up to its
        deadline + launch, again on every resume), and the renewal is a compare-and-swap that
        only ever extends. So while a step runs, the job's entries outlive the step; only a run
        that stops renewing (crashed) lets them expire."""
        self.ledger.renew(self.job_id, self.clock() + seconds)

    def failures(self) -> list[str]:
        """The nodes that already failed for this job (any try), as `tried` entries: the bound
        on boot attempts counts them across retries."""
        record = self.record()
        return [f"node {n}: {why}" for n, why in (record.failed if record else ())]

    def ensure_up(self, plan: Plan, tried: Sequence[str] = (), baselines: list[dict] | None = None) -> BringUp:
        """Every try of start and of the sensor: where the ledger has the job, brought up
        (idempotent: nothing started twice, baselines from the record). With `baselines` (the
        sensor, given the start step's baselines), a plan the ledger still holds as it is needs
        no ECS call: those baselines were made from the same record."""
        current = self.current_plan(plan)
        if current is plan and baselines is not None:
            return BringUp(slim(plan), baselines, [], list(tried))
        return self.bring_up(current, tried)

    # -- where the job is ---------------------------------------------------------------
    def current_plan(self, plan: Plan) -> Plan:
        """`plan` while the ledger still holds exactly its tasks for this job and none of its
        nodes failed for the job; otherwise (an earlier try re-placed the job or gave a node up,
        a re-run `place` moved it, or its reservations expired) the job is placed again."""
        if self.spec is None:
            return plan          # hand-wired without the job: nothing to re-place with
        now = self.clock()
        state = self.ledger.snapshot()
        held = {(r.task, r.node) for r in state.held(self.job_id, now)}
        record = state.record(self.job_id, now)
        failed = sorted(set(record.failed_nodes if record else {}) & {a.node for a in plan.assignments})
        if held == {(a.task, a.node) for a in plan.assignments} and not failed:
            return plan
        self.log.info("the ledger holds %s for job %s, not the plan's %s%s: placing it again",
                      sorted(held) or "nothing", self.job_id, [(a.task, a.node) for a in plan.assignments],
                      f" (already failed for this job: {failed})" if failed else "")
        placed = self.rebook()
        if placed.outcome == Outcome.BUSY:
            raise CapacityBusy(f"job {self.job_id} lost its reservations and the fleet is busy now: "
                               f"{placed.message}", [])
        return placed

    # -- start --------------------------------------------------------------------------
    def bring_up(self, plan: Plan, tried: Sequence[str] = ()) -> BringUp:
        """Start the plan's stopped instances; on a capacity error re-place and start the new plan."""
        tried = list(tried)
        while True:
            # Read before the start request: the readiness watch resumes from these (collection) versions.
            reads = {n: self.kube.node_to_watch(n) for n in sorted({a.node for a in plan.assignments})}
            before = {n: node for n, (node, _) in reads.items()}
            versions = {n: version for n, (_, version) in reads.items()}
            requested_at = self.clock()
            to_start = {n: i for n, i in self._to_start(plan).items() if i}
            if to_start:     # write-ahead: a worker killed after StartInstances still left the record
                self.ledger.record_starts(self.job_id, [StartedNode(n, i, requested_at, _boot_id(before.get(n)),
                                                                    versions.get(n))
                                                        for n, i in sorted(to_start.items())],
                                          requested_at + self._ttl())
            outcomes = self.power_on(list(to_start.values()))
            failed = {iid: o for iid, o in outcomes.items() if not o.ok}
            hard = {iid: o.error for iid, o in failed.items() if o.error is None or o.error.kind != "capacity"}
            if hard:
                raise BootError("; ".join(f"instance {iid} failed to start: {err}" for iid, err in hard.items()))
            if not failed:
                boots = self.baselines(plan, outcomes, before, requested_at, versions)
                started = sorted(i for i, o in outcomes.items() if o.outcome == "done")
                return BringUp(slim(plan), boots, started, tried)
            marks = self._offering_marks(plan, {iid: o.error for iid, o in failed.items()})
            tried += [f"{m.what}: {m.reason}" for m in marks]
            plan = self._replace(marks, tried, why="out of capacity")

    def power_on(self, instance_ids: list[str]) -> dict[str, InstanceOutcome]:
        """StartInstances; an instance still Stopping is waited for, then started."""
        outcomes = self.ecs.start_instances(instance_ids) if instance_ids else {}
        stopping = [i for i, o in outcomes.items() if o.outcome == "stopping"]
        if stopping:
            self.log.info("waiting for %s to finish stopping before starting them", stopping)
            statuses = self.ecs.wait_for_status(stopping, {"Stopped"}, self.stopping_timeout_seconds)
            stuck = {i: s for i, s in statuses.items() if s != "Stopped"}
            if stuck:
                raise BootError(f"instances still not Stopped after {self.stopping_timeout_seconds}s: {stuck}")
            outcomes.update(self.ecs.start_instances(stopping))
        return outcomes

    def baselines(self, plan: Plan, outcomes: Mapping[str, InstanceOutcome], before: Mapping[str, dict],
                  requested_at: float, versions: Mapping[str, str] | None = None) -> list[dict]:
        """Per planned node: when its start was asked for (None: not started by this job), its
        bootID before, the GPUs placed there, and the Node's resourceVersion when it was read
        before this very start request (only then does a watch from it see the whole boot). A
        start made by an earlier try shows as "already": ECS's StartTime says when it happened."""
        by_node = _by_node(plan)
        to_start = self._to_start(plan)
        record = self.record()
        booting = {n for n, assigned in by_node.items() if n not in to_start and assigned[0].state == NodeState.BOOTING}
        need_time = [to_start[n] for n in to_start if outcomes[to_start[n]].outcome == "already"]
        need_time += [by_node[n][0].instance_id for n in booting if by_node[n][0].instance_id]
        start_times = ({i["InstanceId"]: parse_time(i.get("StartTime")) for i in self.ecs.describe_instances(need_time)}
                       if need_time else {})
        boots = []
        for node, assigned in sorted(by_node.items()):
            iid = assigned[0].instance_id
            window = 0.0
            if node in to_start and outcomes[iid].outcome == "done":
                since = requested_at
            elif node in to_start or node in booting:   # started before (no StartTime while Pending/Starting)
                since = start_times.get(iid) or requested_at
                window = max(0.0, min(START_TIME_PRECISION_SECONDS, requested_at - since))
            else:
                since = None
            read = before.get(node) or {}
            started_now = node in to_start and outcomes[iid].outcome == "done"
            boot_id_before = _boot_id(read)
            version = (versions or {}).get(node) if started_now else None
            mine = record.started_on(node) if record else None
            if mine:    # this job started it (this try or an earlier one): its first start is the baseline
                since, boot_id_before, version, window = mine.at, mine.boot_id_before, mine.resource_version_before, 0.0
            baseline = BootBaseline(node=node, start_requested_at=since, boot_id_before=boot_id_before,
                                    start_window_seconds=window,
                                    gpus_needed=sum(a.requests.gpus for a in assigned),
                                    extended_needed=extended_needs(sum((a.requests for a in assigned[1:]),
                                                                       assigned[0].requests)),
                                    resource_version_before=version)
            boots.append(baseline.to_json())
            self.log.info("node %s (%s, %s): start requested at %s%s, bootID before %s, needs %d GPU(s)",
                          node, iid, assigned[0].state.value, utc(since) if since is not None else "- (not started)",
                          " by this job" if mine else "", baseline.boot_id_before, baseline.gpus_needed)
        return boots

    def not_preempted(self) -> None:
        """Raise JobPreempted when a preemptor requeued the job: called before every re-placement
        (`rebook`, `_replace`), so a start or wait step whose job was preempted while its nodes came
        up never books again around the queue (the place the preemptor is owed).

        Why this is enough: the preemptor writes its record to the queue before it drops the job's
        reservations (gpuboot.lifecycle.preemption), so a step that found them gone and reads the
        record after sees it. A preemption that lands between this read and the booking's commit
        leaves the job holding new reservations it is not owed; its launch step reads the record
        before it creates pods and gives them back (the ledger never gives one GPU twice meanwhile)."""
        record = JobQueue(self.kube, self.ledger.namespace).snapshot().preempted_of(self.job_id)
        if record is not None and record != self.handling:
            raise JobPreempted(record)

    def rebook(self) -> Plan:
        """Place the job again, replacing whatever it held: FITS (reserved) or BUSY (holding nothing)."""
        self.not_preempted()
        plan = self.booker.book(self.spec, self.job_id, release_unplaced=True).plan
        if plan.outcome == Outcome.NEVER:
            raise CapacityUnavailable(f"job {self.job_id} can no longer run in this fleet: {plan.message}")
        return plan

    # -- boot timeout -------------------------------------------------------------------
    def fail_over(self, plan: Plan, bad: Mapping[str, str], tried: Sequence[str] = (),
                  evidence: Mapping[str, Mapping] | None = None, blame: bool = True) -> BringUp:
        """Nodes in `bad` (node -> why) did not become GPU-ready: they fail for this job, those
        whose boot was waited for are marked (see `_node_marks`), the job is re-placed in the same
        commit (nodes it started and leaves are stopped unless claimed), the new plan is brought up.
        `blame=False` (the instance was stopped outside gpuboot: not the node's fault): no mark and
        no failure recorded, only the re-placement, on another node when one fits now: whoever stopped
        it (a person, a spot reclaim) meant it, so it is started again only when nothing else fits."""
        tried = [*tried, *(f"node {n}: {why}" for n, why in sorted(bad.items()))]
        marks = self._node_marks(bad, evidence or {}) if blame else []
        avoid = [] if blame else [Unavailable(reason=f"stopped outside gpuboot while job {self.job_id} waited for it",
                                              expires_at=self.clock() + LAUNCH_MARGIN_SECONDS, node=n) for n in bad]
        new_plan = self._replace(marks, tried, why="not GPU-ready in time" if blame else "stopped outside gpuboot",
                                 failed=bad if blame else None, avoid=avoid)
        return self.bring_up(new_plan, tried)

    def finish(self, used: Collection[str] = ()) -> list:
        """The run ends (the release step): drop every entry of the job, and stop each node it
        started unless claimed or its pod ran there (`used`; idle scale-down stops those)."""
        state = self.ledger.snapshot()
        now = self.clock()
        held = state.held(self.job_id, now)
        record = state.record(self.job_id, now)
        if record is not None and record.started:
            self.booker.book(self.spec, self.job_id, release_unplaced=True, place_job=False,
                             keep_running=used, why="the run is over")
        released = self.ledger.release(self.job_id)
        return released or held

    # -- internals ------------------------------------------------------------------------
    def _ttl(self) -> float:
        return reservation_ttl(self.spec) if self.spec else LAUNCH_MARGIN_SECONDS

    def _replace(self, marks: list[Unavailable], tried: list[str], why: str,
                 failed: Mapping[str, str] | None = None, avoid: Sequence[Unavailable] = ()) -> Plan:
        """Commit the marks (and the job's failed nodes) with a new placement (or, once
        `max_attempts` failures are used up, only with the release), return the new plan.
        Nodes the job started and the commit moves it off are stopped by the booker. `avoid`: nodes
        kept out of this placement only (never written) while another fits now."""
        self.not_preempted()
        out_of_attempts = len(tried) >= self.max_attempts or self.spec is None
        booking = self.booker.book(self.spec, self.job_id, marks=marks, release_unplaced=True,
                                   place_job=not out_of_attempts, failed=failed, held=avoid)
        if avoid and not out_of_attempts and booking.plan.outcome != Outcome.FITS:
            # nothing else fits now: the avoided node is the job's place again, rather than a wait
            booking = self.booker.book(self.spec, self.job_id, marks=marks, release_unplaced=True, failed=failed)
        if out_of_attempts:
            limit = (f"max_attempts={self.max_attempts}" if self.spec is not None
                     else "no job spec given to re-place it with; pass job=...")
            raise CapacityUnavailable(f"job {self.job_id}: gave up after {len(tried)} failure(s) ({limit}); "
                                      f"tried: {'; '.join(tried)}")
        if booking.plan.outcome == Outcome.BUSY:
            raise CapacityBusy(f"job {self.job_id}: moved off {'; '.join(tried)}; the rest of the fleet is busy "
                               f"now: {booking.plan.message}", tried)
        if booking.plan.outcome != Outcome.FITS:
            raise CapacityUnavailable(f"job {self.job_id}: nothing left to try; tried: {'; '.join(tried)}; "
                                      f"now: {booking.plan.message}")
        self.log.info("re-placed job %s (%s; failure %d of at most %d): %s", self.job_id, why, len(tried),
                      self.max_attempts, booking.plan.message)
        self.log.info("placement:\n%s", booking.plan.table())
        return booking.plan

    def _offering_marks(self, plan: Plan, errors: Mapping[str, EcsError | None]) -> list[Unavailable]:
        """One mark per failed instance: its type in its zone (or, if ECS does not say, its node)."""
        until = self.clock() + self.unavailable_ttl_seconds
        described = {i["InstanceId"]: i for i in self.ecs.describe_instances(sorted(errors))}
        marks = []
        for iid, err in sorted(errors.items()):
            inst = described.get(iid, {})
            reason = f"{err.code} starting {iid}" if err else f"start of {iid} failed"
            if inst.get("InstanceType") and inst.get("ZoneId"):
                marks.append(Unavailable(reason=reason, expires_at=until, instance_type=inst["InstanceType"],
                                         zone=inst["ZoneId"]))
            else:   # type or zone unknown: keep at least this node out
                node = next((a.node for a in plan.assignments if a.instance_id == iid), iid)
                marks.append(Unavailable(reason=reason, expires_at=until, node=node))
        return marks

    def _node_marks(self, bad: Mapping[str, str], evidence: Mapping[str, Mapping]) -> list[Unavailable]:
        """Marks for everyone, only on nodes whose boot was being waited for (evidence
        `start_requested_at` set; no evidence: assume a boot), each with the bootID that boot left."""
        until = self.clock() + self.unavailable_ttl_seconds
        marks = []
        for node, why in sorted(bad.items()):
            seen = evidence.get(node) or {}
            if seen and seen.get("start_requested_at") is None:
                self.log.info("node %s was already up when the job chose it: not marked for other jobs "
                              "(only this job leaves it)", node)
                continue
            marks.append(Unavailable(reason=why, expires_at=until, node=node,
                                     boot_id=seen.get("boot_id") or seen.get("boot_id_before") or ""))
        return marks

    @staticmethod
    def _to_start(plan: Plan) -> dict[str, str | None]:
        by_node = _by_node(plan)
        return {n: by_node[n][0].instance_id for n in plan.nodes_to_start}


def _boot_id(node: Mapping | None) -> str | None:
    return (((node or {}).get("status") or {}).get("nodeInfo") or {}).get("bootID")


def _by_node(plan: Plan) -> dict[str, list[Assignment]]:
    by_node: dict[str, list[Assignment]] = {}
    for a in plan.assignments:
        by_node.setdefault(a.node, []).append(a)
    return by_node

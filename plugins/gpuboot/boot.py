"""Bring a job's planned nodes up, and fall back to other capacity when they do not come up.

Shared by the start step (capacity errors) and the GPU-readiness sensor (boot timeouts), so
that both re-place through the same `Booker` transaction and log the same way:

- `bring_up`: StartInstances for the plan's stopped instances (one still Stopping is started
  once Stopped) and the per-node baselines the readiness rule needs. A capacity error
  (OperationDenied.NoStock and friends) marks that instance type in that zone unavailable
  for `unavailable_ttl_seconds` in the ledger, drops the job's reservations and re-places it
  in one commit, then starts the new plan's nodes; at most `max_attempts` plans are tried.
- `fail_over`: nodes that were not GPU-ready in time are marked unavailable, the job is
  re-placed in the same commit, and each such node that this job had to start is stopped
  again unless another job claims it (a live reservation, or a workload pod on it). The
  claim check uses the ledger state the commit was guarded by and pods listed after it; the
  mark keeps every later placement off the node, so the stop cannot race a new claim.
- `give_up`: the same release and stop, with no re-placement (the run is failing).

Idempotence for retries: StartInstances on an instance that is already Pending, Starting
or Running is a no-op ("already"), and a start that an earlier try made is recognised by
ECS's StartTime. Where the job is placed is what the ledger holds, not an XCom from an
earlier try: `current_plan` re-places when the ledger no longer holds the plan's tasks.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from gpuboot.booking import Booker, Booking
from gpuboot.ecs import EcsError, EcsHook, InstanceOutcome
from gpuboot.inventory import NodeState, parse_time
from gpuboot.jobspec import JobSpec
from gpuboot.kube import KubeClient
from gpuboot.ledger import ReservationLedger
from gpuboot.placement import Assignment, Outcome, Plan, Unavailable
from gpuboot.readiness import BootBaseline, extended_needs
from gpuboot.scaledown import find_work

DEFAULT_UNAVAILABLE_TTL_SECONDS = 600


class CapacityUnavailable(AirflowFailException):
    """No capacity left for the job: every offering tried was out of stock (or failed to boot),
    and nothing else can ever hold it. The message names each one and why."""


class CapacityBusy(AirflowException):
    """The job was moved off capacity that failed, and what is left is busy right now: the
    caller waits and re-places (`JobBoot.rebook`) like the place step does, holding nothing."""

    def __init__(self, message: str, tried: Sequence[str]) -> None:
        super().__init__(message)
        self.tried = list(tried)


@dataclass
class BringUp:
    """The plan the job ends up on, its boot baselines (JSON) and the instances this call started."""

    plan: Plan
    boots: list[dict]
    started: list[str]
    tried: list[str] = field(default_factory=list)


def slim(plan: Plan) -> Plan:
    """The plan without its candidate table (kept small for XCom and trigger state)."""
    return replace(plan, candidates=(), candidates_omitted=0)


class JobBoot:
    """Bring-up and fall-back for one job (`spec` as `job_id`)."""

    def __init__(self, kube: KubeClient, ecs: EcsHook, ledger: ReservationLedger, log: logging.Logger, *,
                 spec: JobSpec | None, job_id: str, max_attempts: int = 3,
                 unavailable_ttl_seconds: float = DEFAULT_UNAVAILABLE_TTL_SECONDS,
                 stopping_timeout_seconds: float = 600, boot_grace_seconds: float = 900,
                 clock: Callable[[], float] = time.time) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.kube, self.ecs, self.ledger, self.log = kube, ecs, ledger, log
        self.spec, self.job_id, self.max_attempts = spec, job_id, max_attempts
        self.unavailable_ttl_seconds, self.stopping_timeout_seconds = unavailable_ttl_seconds, stopping_timeout_seconds
        self.clock = clock
        self.booker = Booker(kube, ecs, ledger, log, boot_grace_seconds=boot_grace_seconds, clock=clock)

    # -- where the job is ---------------------------------------------------------------
    def current_plan(self, plan: Plan) -> Plan:
        """`plan` while the ledger still holds exactly its tasks for this job; otherwise (an
        earlier try re-placed the job, or its reservations expired) the job is placed again."""
        if self.spec is None:
            return plan          # hand-wired without the job: nothing to re-place with
        now = self.clock()
        held = {(r.task, r.node) for r in self.ledger.snapshot().reservations
                if r.job_id == self.job_id and r.expires_at > now}
        if held == {(a.task, a.node) for a in plan.assignments}:
            return plan
        self.log.info("the ledger holds %s for job %s, not the plan's %s: placing it again",
                      sorted(held) or "nothing", self.job_id, [(a.task, a.node) for a in plan.assignments])
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
            # Read before the start request: the readiness watch resumes from these versions.
            before = {n: self.kube.get_node(n) for n in sorted({a.node for a in plan.assignments})}
            requested_at = self.clock()
            outcomes = self.power_on([i for i in self._to_start(plan).values() if i])
            failed = {iid: o for iid, o in outcomes.items() if not o.ok}
            hard = {iid: o.error for iid, o in failed.items() if o.error is None or o.error.kind != "capacity"}
            if hard:
                raise AirflowException("; ".join(f"instance {iid} failed to start: {err}" for iid, err in hard.items()))
            if not failed:
                boots = self.baselines(plan, outcomes, before, requested_at)
                started = sorted(i for i, o in outcomes.items() if o.outcome == "done")
                return BringUp(slim(plan), boots, started, tried)
            marks = self._offering_marks(plan, {iid: o.error for iid, o in failed.items()})
            tried += [f"{m.what}: {m.reason}" for m in marks]
            plan = self._replace(plan, marks, tried, why="out of capacity")

    def power_on(self, instance_ids: list[str]) -> dict[str, InstanceOutcome]:
        """StartInstances; an instance still Stopping is waited for, then started."""
        outcomes = self.ecs.start_instances(instance_ids) if instance_ids else {}
        stopping = [i for i, o in outcomes.items() if o.outcome == "stopping"]
        if stopping:
            self.log.info("waiting for %s to finish stopping before starting them", stopping)
            statuses = self.ecs.wait_for_status(stopping, {"Stopped"}, self.stopping_timeout_seconds)
            stuck = {i: s for i, s in statuses.items() if s != "Stopped"}
            if stuck:
                raise AirflowException(f"instances still not Stopped after {self.stopping_timeout_seconds}s: {stuck}")
            outcomes.update(self.ecs.start_instances(stopping))
        return outcomes

    def baselines(self, plan: Plan, outcomes: Mapping[str, InstanceOutcome], before: Mapping[str, dict],
                  requested_at: float) -> list[dict]:
        """Per planned node: when its start was asked for (None: not started by this job), its
        bootID before, the GPUs placed there, and the Node's resourceVersion when it was read
        before this very start request (only then does a watch from it see the whole boot). A
        start made by an earlier try shows as "already": ECS's StartTime says when it happened."""
        by_node = _by_node(plan)
        to_start = self._to_start(plan)
        booting = {n for n, assigned in by_node.items() if n not in to_start and assigned[0].state == NodeState.BOOTING}
        need_time = [to_start[n] for n in to_start if outcomes[to_start[n]].outcome == "already"]
        need_time += [by_node[n][0].instance_id for n in booting if by_node[n][0].instance_id]
        start_times = ({i["InstanceId"]: parse_time(i.get("StartTime")) for i in self.ecs.describe_instances(need_time)}
                       if need_time else {})
        boots = []
        for node, assigned in sorted(by_node.items()):
            iid = assigned[0].instance_id
            if node in to_start:
                since = requested_at if outcomes[iid].outcome == "done" else start_times.get(iid) or requested_at
            elif node in booting:     # started by someone else; no StartTime while Pending/Starting
                since = start_times.get(iid) or requested_at
            else:
                since = None
            read = before.get(node) or {}
            started_now = node in to_start and outcomes[iid].outcome == "done"
            baseline = BootBaseline(node=node, start_requested_at=since,
                                    boot_id_before=((read.get("status") or {}).get("nodeInfo") or {}).get("bootID"),
                                    gpus_needed=sum(a.requests.gpus for a in assigned),
                                    extended_needed=extended_needs(sum((a.requests for a in assigned[1:]),
                                                                       assigned[0].requests)),
                                    resource_version_before=((read.get("metadata") or {}).get("resourceVersion")
                                                             if started_now else None))
            boots.append(baseline.to_json())
            self.log.info("node %s (%s, %s): start requested at %s, bootID before %s, needs %d GPU(s)",
                          node, iid, assigned[0].state.value, since, baseline.boot_id_before, baseline.gpus_needed)
        return boots

    def rebook(self) -> Plan:
        """Place the job again, replacing whatever it held: FITS (reserved) or BUSY (holding nothing)."""
        plan = self.booker.book(self.spec, self.job_id, release_unplaced=True).plan
        if plan.outcome == Outcome.NEVER:
            raise CapacityUnavailable(f"job {self.job_id} can no longer run in this fleet: {plan.message}")
        return plan

    # -- boot timeout -------------------------------------------------------------------
    def fail_over(self, plan: Plan, bad: Mapping[str, str], tried: Sequence[str] = ()) -> BringUp:
        """Nodes in `bad` (node -> why) did not become GPU-ready: mark them, re-place the job in
        the same commit, stop those of them this job started unless claimed, bring the new plan up."""
        tried = [*tried, *(f"node {n}: {why}" for n, why in sorted(bad.items()))]
        marks = self._node_marks(bad)
        new_plan = self._replace(plan, marks, tried, why="not GPU-ready in time", stop_bad=bad)
        return self.bring_up(new_plan, tried)

    def give_up(self, plan: Plan, bad: Mapping[str, str]) -> None:
        """The run fails: mark the bad nodes, drop the job's reservations, stop the bad nodes it started."""
        booking = self.booker.book(self.spec, self.job_id, marks=self._node_marks(bad), release_unplaced=True,
                                   place_job=False)
        self._stop_unclaimed(plan, bad, booking)

    # -- internals ------------------------------------------------------------------------
    def _replace(self, plan: Plan, marks: list[Unavailable], tried: list[str], why: str,
                 stop_bad: Mapping[str, str] | None = None) -> Plan:
        """Commit the marks and a new placement (or, once `max_attempts` failures are used up,
        only the marks and the release), stop abandoned bad nodes, return the new plan."""
        out_of_attempts = len(tried) >= self.max_attempts or self.spec is None
        booking = self.booker.book(self.spec, self.job_id, marks=marks, release_unplaced=True,
                                   place_job=not out_of_attempts)
        if stop_bad:
            self._stop_unclaimed(plan, stop_bad, booking)
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

    def _stop_unclaimed(self, plan: Plan, bad: Mapping[str, str], booking: Booking) -> None:
        """Stop each bad node this job had to start, unless another job claims it (see the module doc)."""
        to_start = self._to_start(plan)
        now = self.clock()
        work = find_work(booking.survey.nodes, booking.survey.pods, booking.state.others(self.job_id, now), now)
        for node in sorted(bad):
            iid = to_start.get(node)
            if iid is None:
                self.log.info("node %s: not started by this job; left running", node)
            elif node in work:
                self.log.info("node %s (%s): not stopping it, another job claims it: %s", node, iid, work[node][1])
            else:
                outcome = self.ecs.stop_instances([iid], stopped_mode="StopCharging")[iid]
                if outcome.ok:
                    self.log.info("node %s (%s): stopped again (StopCharging): this job started it and "
                                  "no other job claims it", node, iid)
                else:
                    self.log.warning("node %s (%s): stop failed (%s); idle scale-down will retry", node, iid,
                                     outcome.error)

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

    def _node_marks(self, bad: Mapping[str, str]) -> list[Unavailable]:
        until = self.clock() + self.unavailable_ttl_seconds
        return [Unavailable(reason=why, expires_at=until, node=node) for node, why in sorted(bad.items())]

    @staticmethod
    def _to_start(plan: Plan) -> dict[str, str | None]:
        by_node = _by_node(plan)
        return {n: by_node[n][0].instance_id for n in plan.nodes_to_start}


def _by_node(plan: Plan) -> dict[str, list[Assignment]]:
    by_node: dict[str, list[Assignment]] = {}
    for a in plan.assignments:
        by_node.setdefault(a.node, []).append(a)
    return by_node

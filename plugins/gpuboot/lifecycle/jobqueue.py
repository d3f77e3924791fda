"""The job queue in the cluster: who waits, since when, and the holds, in one ConfigMap.

Why in the cluster: every worker and triggerer must agree on the order, and the order must
survive restarts of any Airflow process. Why a ConfigMap of its own (`gpuboot-queue`, next to
the ledger): a burst of placements keeps the ledger changing, and a waiter renewing its lease
every poll should not make those commits conflict. Every write is a compare-and-swap on the
resourceVersion, as the ledger's.

Lifetime. An entry keeps the enqueue time of its first write for the life of the run (a retry
or a later poll never moves it back in line), and a lease the waiting step renews at each poll
(`enqueue`). It keeps the job's queue deadline the same way (fixed when the place step first ran,
carried into the admission record): the start step and the sensor, when they wait for capacity
again, read it (`deadline_of`), so the queue timeout counts once per job, not once per step. The run's teardown (release) drops it however the run ends; a run killed
mid-wait loses its place when its lease runs out (LEASE_SECONDS), and its hold with it.

The decision itself is the core's (`gpuboot.core.queue.run_pass`): each place step runs the
same pass over the same waiting set and cluster survey and books only when its own job is
admitted, so all of them agree on who goes first without a leader.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import Reservation, Unavailable
from gpuboot.core.placement import JobRequest, Outcome, Plan, TaskRequest, place
from gpuboot.core.queue import (
    Attempt,
    Entry,
    Hold,
    PassResult,
    QueueConfig,
    Running,
    Step,
    may_preempt,
    releases_of,
    run_pass,
)
from gpuboot.core.timefmt import utc_relative
from gpuboot.exceptions import Conflict, LedgerConflict
from gpuboot.lifecycle.booking import Booker, Booking, survey
from gpuboot.lifecycle.ledger import backoff, write_attempts
from gpuboot.lifecycle.preemption import keep_holding, let_go, preempt, running_jobs

CONFIGMAP = "gpuboot-queue"
ENTRIES_KEY = "entries.json"
HOLDS_KEY = "holds.json"
RUNNING_KEY = "running.json"
PREEMPTED_KEY = "preempted.json"  # job id -> who preempted it and why, until its launch has seen it (or its release)
CHANGES_KEY = "changes"          # releases so far: what wakes a waiter early (gpuboot.triggers.wake_up)
WAKE_POSITIONS = 8               # waiters this near the front are woken by a release; the rest poll on their timer
LEASE_SECONDS = 150.0            # a waiter polls every 30 s: five missed polls and its place is gone
RUNNING_SECONDS = 7 * 24 * 3600  # an admitted job counts for its team's share until release, or this long
CONFIG_ENV = "GPUBOOT_QUEUE_CONFIG"
PREEMPT_TRIES = 3                # passes a place step runs whose preemption lost the queue's compare-and-swap


def changes_of(configmap: dict | None) -> int:
    """The queue's change counter: its releases so far (0 before the first)."""
    return int(((configmap or {}).get("data") or {}).get(CHANGES_KEY) or 0)


def preemptions_of(configmap: dict | None) -> tuple[Preempted, ...]:
    """The preemption records in the queue ConfigMap as read."""
    raw = ((configmap or {}).get("data") or {}).get(PREEMPTED_KEY) or "[]"
    return tuple(Preempted.from_json(d) for d in json.loads(raw))


def preempted_in(configmap: dict | None, job_id: str) -> Preempted | None:
    """The job's preemption record in the queue ConfigMap as read (None: not preempted, or settled)."""
    return next((p for p in preemptions_of(configmap) if p.job_id == job_id), None)


def queue_config(environ=os.environ) -> QueueConfig:
    """Teams, quotas and the starvation threshold from GPUBOOT_QUEUE_CONFIG (JSON; unset: equal
    weights, no quotas), e.g. {"teams": {"vision": {"weight": 2, "nominal": {"A100": 16}}}}."""
    raw = environ.get(CONFIG_ENV)
    if not raw:
        return QueueConfig()
    try:
        return QueueConfig.from_json(json.loads(raw))
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise ValueError(f"{CONFIG_ENV}: not a valid queue configuration ({exc}). Fix the JSON, e.g. "
                         '{"starve_seconds": 600, "teams": {"vision": {"weight": 2, "nominal": {"A100": 16}}}}') from None


def entry_of(spec: JobSpec, job_id: str, now: float) -> Entry:
    """The job's queue entry (its shape: one task's requests, the tasks needed at once, the models)."""
    return Entry(job_id, spec.requests(), spec.gang_size, spec.gpu_model, spec.team, spec.priority_class,
                 now, spec.expected_runtime_seconds, spec.preemptible, spec.name)


def _when(value) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class Waiting:
    entry: Entry
    lease_until: float
    deadline: float | None = None     # the job's queue deadline (None: written before deadlines were kept)

    def to_json(self) -> dict:
        return {**self.entry.to_json(), "lease_until": self.lease_until, "deadline": self.deadline}

    @classmethod
    def from_json(cls, d: dict) -> Waiting:
        return cls(Entry.from_json(d), float(d["lease_until"]), _when(d.get("deadline")))


@dataclass(frozen=True)
class Admitted:
    """A job the queue let through: its team's use of GPUs of one model, until its release."""

    job_id: str
    team: str
    model: str
    gpus: int
    until: float
    deadline: float | None = None     # the queue deadline it was admitted with: later waits keep it
    entry: Entry | None = None        # its queue entry (class, preemptible, enqueue time): what preemption reads
    namespace: str = ""               # where its pods run (a preemptor deletes them there)

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "team": self.team, "model": self.model, "gpus": self.gpus, "until": self.until,
                "deadline": self.deadline, "entry": self.entry.to_json() if self.entry else None,
                "namespace": self.namespace}

    @classmethod
    def from_json(cls, d: dict) -> Admitted:
        return cls(d["job_id"], d["team"], d["model"], int(d["gpus"]), float(d["until"]), _when(d.get("deadline")),
                   Entry.from_json(d["entry"]) if d.get("entry") else None, d.get("namespace") or "")


@dataclass(frozen=True)
class Preempted:
    """A job requeued for another: by whom, why, when (its launch step tells the user, then settles it)."""

    job_id: str
    by: str
    by_name: str
    reason: str
    at: float
    enqueued_at: float | None = None  # its first enqueue: its place in the line, kept through the requeue

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "by": self.by, "by_name": self.by_name, "reason": self.reason, "at": self.at,
                "enqueued_at": self.enqueued_at}

    @classmethod
    def from_json(cls, d: dict) -> Preempted:
        return cls(d["job_id"], d["by"], d.get("by_name") or "", d.get("reason") or "", float(d["at"]),
                   _when(d.get("enqueued_at")))

    @property
    def preemptor(self) -> str:
        return f"{self.by_name} ({self.by})" if self.by_name and self.by_name != self.by else self.by


@dataclass(frozen=True)
class QueueState:
    waiting: tuple[Waiting, ...]
    holds: tuple[Hold, ...]
    version: str | None
    running: tuple[Admitted, ...] = ()
    changes: int = 0           # releases so far (CHANGES_KEY)
    preempted: tuple[Preempted, ...] = ()

    def preempted_of(self, job_id: str) -> Preempted | None:
        return next((p for p in self.preempted if p.job_id == job_id), None)

    def usage(self, now: float) -> dict[str, dict[str, int]]:
        """team -> GPU model -> GPUs of the admitted jobs not released yet (fair share and quotas)."""
        out: dict[str, dict[str, int]] = {}
        for a in self.running:
            if a.until > now:
                out.setdefault(a.team, {})[a.model] = out.get(a.team, {}).get(a.model, 0) + a.gpus
        return out

    def live(self, now: float) -> list[Entry]:
        return [w.entry for w in self.waiting if w.lease_until > now]

    def live_holds(self, now: float) -> dict[str, Hold]:
        alive = {e.job_id for e in self.live(now)}
        return {h.job_id: h for h in self.holds if h.job_id in alive}

    def deadline_of(self, job_id: str, now: float) -> float | None:
        """The job's queue deadline as first written: its live entry's, else its admission's."""
        found = [w.deadline for w in self.waiting if w.entry.job_id == job_id and w.lease_until > now] + \
            [a.deadline for a in self.running if a.job_id == job_id and a.until > now]
        return next((d for d in found if d is not None), None)


class JobQueue:
    """The waiting jobs and their holds, in ConfigMap `gpuboot-queue` of `namespace`."""

    def __init__(self, kube, namespace: str = "default", name: str = CONFIGMAP,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 lease_seconds: float = LEASE_SECONDS) -> None:
        self.kube, self.namespace, self.name, self.clock, self.sleep = kube, namespace, name, clock, sleep
        self.lease_seconds = lease_seconds

    def snapshot(self) -> QueueState:
        cm = self.kube.read_configmap(self.namespace, self.name)
        if cm is None:
            return QueueState((), (), None)
        data = cm.get("data") or {}
        return QueueState(tuple(Waiting.from_json(d) for d in json.loads(data.get(ENTRIES_KEY) or "[]")),
                          tuple(Hold.from_json(d) for d in json.loads(data.get(HOLDS_KEY) or "[]")),
                          cm["metadata"]["resourceVersion"],
                          tuple(Admitted.from_json(d) for d in json.loads(data.get(RUNNING_KEY) or "[]")),
                          changes_of(cm), preemptions_of(cm))

    def enqueue(self, entry: Entry, deadline: float | None = None, lease_seconds: float | None = None) -> QueueState:
        """Add the job, or renew its lease keeping its first enqueue time and deadline; the state written."""
        def change(state: QueueState, now: float):
            mine = next((w for w in state.waiting if w.entry.job_id == entry.job_id and w.lease_until > now), None)
            kept = replace(entry, enqueued_at=mine.entry.enqueued_at) if mine else entry
            others = [w for w in state.waiting if w.entry.job_id != entry.job_id]
            fixed = state.deadline_of(entry.job_id, now) or deadline
            return replace(state, waiting=(*others, Waiting(kept, now + (lease_seconds or self.lease_seconds), fixed)))
        return self._update(change, f"enqueue job {entry.job_id}")

    def admit(self, job_id: str, team: str, model: str | None, gpus: int, deadline: float | None = None,
              entry: Entry | None = None, namespace: str = "") -> None:
        """The job got its place: out of the line, its hold let go, its GPUs counted for its team
        (and its queue deadline kept for the steps that may wait again; its entry and namespace for
        a preemptor)."""
        def change(state: QueueState, now: float):
            fixed = state.deadline_of(job_id, now) or deadline
            kept = next((w.entry.enqueued_at for w in state.waiting if w.entry.job_id == job_id), None)
            first = replace(entry, enqueued_at=kept) if entry is not None and kept is not None else entry
            return replace(_without(state, job_id), running=(
                *(a for a in state.running if a.job_id != job_id),
                Admitted(job_id, team, model or "", gpus, now + RUNNING_SECONDS, fixed, first, namespace)))
        self._update(change, f"admit job {job_id}")

    def deadline(self, job_id: str, timeout_seconds: float) -> float:
        """The job's queue deadline: the one fixed when it first came to the queue, or `timeout_seconds`
        from now when it has none yet (its first place attempt, or a run admitted before deadlines were kept)."""
        now = self.clock()
        return self.snapshot().deadline_of(job_id, now) or now + timeout_seconds

    def drop(self, job_id: str) -> bool:
        """Take the job out entirely (idempotent): its run ended, however it ended. True when it held
        nodes firm (it had preempted and not placed yet): its ledger marks are the caller's to let go."""
        firm = [False]

        def change(state: QueueState, now: float):
            firm[0] = any(h.job_id == job_id and h.firm for h in state.holds)
            known = {w.entry.job_id for w in state.waiting} | {h.job_id for h in state.holds} | \
                {a.job_id for a in state.running} | {p.job_id for p in state.preempted}
            if job_id not in known:
                return None
            return replace(_without(state, job_id), running=tuple(a for a in state.running if a.job_id != job_id),
                           preempted=tuple(p for p in state.preempted if p.job_id != job_id),
                           changes=state.changes + 1)
        self._update(change, f"drop job {job_id}")      # a release (or a waiter gone): wakes the front of the line
        return firm[0]

    def preempt(self, by: Entry, victims: Sequence[str], reasons: Mapping[str, str],
                holds: Mapping[str, Hold] | None = None, based_on: QueueState | None = None) -> list[Admitted]:
        """Requeue `victims` for job `by`, all of them or none: each must still be admitted and not
        preempted already (else nothing is written and [] comes back: another preemptor, or the
        victim's own release, got there first). Each goes back to the line with its first enqueue
        time and a fresh lease (its deadline set anew by its launch step), with a record saying by
        whom and why. The admissions taken out come back: the caller deletes their pods.

        `based_on`: the state the pass that named the victims read; the write is compare-and-swapped on
        it, not retried (a queue that moved since gives []): so `by` was the queue's head preemptor when
        it preempted, as every pass over that state says. `holds`: that pass's, written in the same
        write with `by`'s turned firm. The safety argument: gpuboot.lifecycle.preemption."""
        taken: list[Admitted] = []

        def change(state: QueueState, now: float):
            taken.clear()
            admitted = {a.job_id: a for a in state.running if a.until > now}
            if any(v not in admitted or admitted[v].entry is None or state.preempted_of(v) for v in victims):
                return None
            taken.extend(admitted[v] for v in victims)
            back = [Waiting(a.entry, now + self.lease_seconds, None) for a in taken if a.entry is not None]
            records = [*state.preempted, *(Preempted(a.job_id, by.job_id, by.name, reasons.get(a.job_id, ""), now,
                                                     a.entry.enqueued_at if a.entry else None) for a in taken)]
            kept = state.holds if holds is None else \
                tuple(replace(h, firm=True) if h.job_id == by.job_id else h for h in holds.values())
            return replace(state, waiting=(*(w for w in state.waiting if w.entry.job_id not in victims), *back),
                           running=tuple(a for a in state.running if a.job_id not in victims), holds=kept,
                           preempted=tuple(records), changes=state.changes + 1)
        if based_on is None:
            self._update(change, f"preempt {', '.join(victims)} for job {by.job_id}")
            return list(taken)
        now = self.clock()
        new = change(based_on, now)
        if new is None:
            return []
        try:
            self._write(new, based_on, now)
        except LedgerConflict:
            return []
        return list(taken)

    def settle(self, record: Preempted) -> None:
        """The victim's launch has told the user and re-placed: forget this one preemption (a later one,
        written since, is kept)."""
        def change(state: QueueState, now: float):
            if record not in state.preempted:
                return None
            return replace(state, preempted=tuple(p for p in state.preempted if p != record))
        self._update(change, f"settle the preemption of job {record.job_id}")

    def save_holds(self, holds: dict[str, Hold], based_on: QueueState) -> bool:
        """Write the pass's holds, only if the queue has not moved since `based_on` (False: it has;
        the next poll's pass decides again)."""
        if [h.to_json() for h in based_on.holds] == [h.to_json() for h in sorted(holds.values(), key=_by_job)]:
            return True
        try:
            self._write(replace(based_on, holds=tuple(holds.values())), based_on, self.clock())
            return True
        except LedgerConflict:
            return False

    def _update(self, change: Callable[[QueueState, float], QueueState | None], what: str) -> QueueState:
        """Apply `change` (the new state, or None: nothing to write) by compare-and-swap, through conflicts."""
        for attempt in write_attempts(20):
            state, now = self.snapshot(), self.clock()
            new = change(state, now)
            if new is None:
                return state
            try:
                return self._write(new, state, now)
            except LedgerConflict:
                self.sleep(backoff(attempt))
        raise LedgerConflict(f"could not {what}: the queue ConfigMap {self.namespace}/{self.name} kept changing")

    def _write(self, new: QueueState, prev: QueueState, now: float) -> QueueState:
        """Write `new` by compare-and-swap over `prev`, pruning expired leases and the holds of jobs gone
        (a release has counted itself in `new.changes`, CHANGES_KEY, for the waiters' triggers)."""
        changes = new.changes
        running = sorted((a for a in new.running if a.until > now), key=lambda a: a.job_id)
        waiting = sorted((w for w in new.waiting if w.lease_until > now), key=lambda w: w.entry.job_id)
        alive = {w.entry.job_id for w in waiting}
        holds = sorted((h for h in new.holds if h.job_id in alive), key=_by_job)
        preempted = sorted((p for p in new.preempted if p.at + RUNNING_SECONDS > now), key=lambda p: p.job_id)
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/managed-by": "gpuboot"}},
                "data": {ENTRIES_KEY: json.dumps([w.to_json() for w in waiting], sort_keys=True),
                         HOLDS_KEY: json.dumps([h.to_json() for h in holds], sort_keys=True),
                         RUNNING_KEY: json.dumps([a.to_json() for a in running], sort_keys=True),
                         PREEMPTED_KEY: json.dumps([p.to_json() for p in preempted], sort_keys=True),
                         CHANGES_KEY: str(changes)}}
        try:
            if prev.version is None:
                written = self.kube.create_configmap(self.namespace, body)
            else:
                body["metadata"]["resourceVersion"] = prev.version
                written = self.kube.replace_configmap(self.namespace, body)
        except Conflict as exc:
            raise LedgerConflict(str(exc)) from None
        return QueueState(tuple(waiting), tuple(holds), (written or {}).get("metadata", {}).get("resourceVersion"),
                          tuple(running), changes, tuple(preempted))


def _by_job(hold: Hold) -> str:
    return hold.job_id


def _without(state: QueueState, job_id: str) -> QueueState:
    """`state` with the job out of the line and its hold let go."""
    return replace(state, waiting=tuple(w for w in state.waiting if w.entry.job_id != job_id),
                   holds=tuple(h for h in state.holds if h.job_id != job_id))


def request_of(entry: Entry) -> JobRequest:
    """What placement needs of another waiting job (its shape; its selectors are not in the queue)."""
    return JobRequest(entry.job_id, tuple(TaskRequest(f"{entry.job_id}-{i}", entry.requests, gpu_model=entry.models)
                                          for i in range(entry.tasks)), entry.tasks, entry.expected_runtime)


def decide(entries: Sequence[Entry], own: tuple[str, JobRequest] | None, views: list,
           unavailable: Sequence[Unavailable], holds: dict[str, Hold], config: QueueConfig, usage: dict,
           capacity: dict, now: float, running: Sequence[Running] = ()) -> PassResult:
    """The pass for one place step: every waiting job placed in order on a copy of the survey's views
    (`own`: this job's full request, selectors included); stops at this job's verdict (None: judges all).
    `running`: the admitted jobs' pods (gpuboot.lifecycle.preemption.running_jobs), for preemption and
    for the holds: when their GPUs should free by the runtimes the jobs stated (`releases_of`, as the replay)."""
    releases = releases_of(views, running, now, config.hold_seconds)
    views = list(views)
    plans: dict[str, Plan] = {}
    model_of = {v.name: v.gpu_model for v in views}

    def attempt(entry: Entry, marks: list[Unavailable]) -> Attempt:
        request = own[1] if own and entry.job_id == own[0] else request_of(entry)
        plan = place(request, views, [*unavailable, *marks])
        plans[entry.job_id] = plan
        model = model_of.get(plan.assignments[0].node) if plan.assignments else None
        return Attempt(plan.outcome is Outcome.FITS, model, plan.message, plan.outcome is Outcome.NEVER)

    def commit(entry: Entry, _: Attempt) -> None:
        taken = {a.node: a.requests for a in plans[entry.job_id].assignments}
        for i, v in enumerate(views):
            if v.name in taken:
                views[i] = replace(v, allocated=v.allocated + taken[v.name])

    return run_pass(entries, now=now, config=config, usage=usage, capacity=capacity, holds=holds,
                    nodes=lambda: views, attempt=attempt, commit=commit, releases=releases,
                    only=own[0] if own else None, running=running)


def capacity_of(views) -> dict[str, int]:
    """GPUs per GPU model in the fleet (the denominators of the teams' shares)."""
    capacity: dict[str, int] = {}
    for v in views:
        if v.gpu_model:
            capacity[v.gpu_model] = capacity.get(v.gpu_model, 0) + v.allocatable.gpus
    return capacity


def queue_view(state: QueueState, views, unavailable: Sequence[Unavailable], config: QueueConfig,
               now: float, pods: Sequence[Mapping] = (), reservations: Sequence[Reservation] = ()) -> list[dict]:
    """Every waiting job in order, as the place steps' pass sees it: position, team, class, shape,
    since when it waits and until when (its queue deadline), who is ahead, what blocks it and what
    kind of thing that is (quota, hold, capacity), the nodes held for it, and by whom and why it was
    preempted if it was requeued (the fleet page's queue table and /api/queue; JSON-safe). A hold
    says whether it is firm (the job preempted there: kept for it alone until it places) and when
    its nodes are due to free (None: not known). `pods` and
    `reservations`: the survey's and the ledger's, so the holds shown are the ones the place steps choose."""
    result = decide(state.live(now), None, list(views), unavailable, state.live_holds(now), config,
                    state.usage(now), capacity_of(views), now, running_jobs(state, pods, now, reservations))
    deadlines = {w.entry.job_id: w.deadline for w in state.waiting}
    preempted = {p.job_id: p for p in state.preempted}
    return [{"position": s.position + 1, "job_id": s.entry.job_id, "name": s.entry.name, "team": s.entry.team,
             "priority_class": s.entry.priority_class, "gpus": s.entry.gpus, "tasks": s.entry.tasks,
             "gpus_per_task": s.entry.requests.gpus, "gpu_models": list(s.entry.models),
             "preemptible": s.entry.preemptible, "enqueued_at": s.entry.enqueued_at,
             "deadline": deadlines.get(s.entry.job_id), "ahead": list(s.ahead), "next": s.admitted,
             "blocked_by": s.blocked_by, "blocker": s.blocker,
             "held_nodes": list(result.holds[s.entry.job_id].nodes) if s.entry.job_id in result.holds else [],
             "hold_firm": s.entry.job_id in result.holds and result.holds[s.entry.job_id].firm,
             "hold_due": result.holds[s.entry.job_id].due if s.entry.job_id in result.holds else None,
             "preempted_by": preempted[s.entry.job_id].preemptor if s.entry.job_id in preempted else None,
             "preempted_why": preempted[s.entry.job_id].reason if s.entry.job_id in preempted else None}
            for s in result.steps]


@dataclass(frozen=True)
class Turn:
    """What the queue said to one place step: the plan (FITS once booked), the job's line, its deadline."""

    plan: Plan
    step: Step | None = None
    waiting: int = 0
    deadline: float | None = None
    changes: int | None = None      # the queue's change counter the decision saw
    names: Mapping[str, str] = field(default_factory=dict)    # job id -> the job's name, for the line
    hold: Hold | None = None        # the nodes held for this job, if any

    @property
    def wake_after(self) -> int | None:
        """The counter past which the waiter's trigger wakes it early (None: its timer only). Only the
        first WAKE_POSITIONS in line: a release frees room for the front of the line, and waking every
        waiter would run the pass in a worker for each of them at every release."""
        if self.step is None or self.step.admitted or self.step.position >= WAKE_POSITIONS:
            return None
        return self.changes

    def line(self, now: float | None = None) -> str:
        """Position, who is ahead, what blocks it, until when it waits: the waiting step's log line."""
        if self.step is None:
            return "no other job waits: placed on its own"
        ahead = [f"{self.names[j]} ({j})" if self.names.get(j) else j for j in self.step.ahead]
        who = ", ".join(ahead[:5]) + (f" and {len(ahead) - 5} more" if len(ahead) > 5 else "") if ahead else "nobody"
        now = time.time() if now is None else now
        until = "" if self.deadline is None else f"; queue deadline {utc_relative(self.deadline, now)}"
        return (f"queue position {self.step.position + 1} of {self.waiting}; ahead: {who}; "
                f"blocked by: {self.step.blocker or 'nothing (admitted)'}{held(self.hold, now)}{until}")


def held(hold: Hold | None, now: float) -> str:
    """The nodes held for a waiting job, for its log line: firm (it preempted there) or when due."""
    if hold is None:
        return ""
    when = ", firm: it preempted there, kept for it alone until it places" if hold.firm else \
        f", due {utc_relative(hold.due, now)}" if hold.due is not None else ", due when their work ends (not stated)"
    return f"; holds node(s) {', '.join(hold.nodes)}{when}"


def book_in_order(booker: Booker, queue: JobQueue, spec: JobSpec, job_id: str, config: QueueConfig,
                  first: Callable[[], Booking], deadline: float | None = None,
                  enqueued_at: float | None = None) -> Turn:
    """Place the job only when the queue admits it (module doc); `first` is the place step's own path
    (the batch) when no other job waits. A job that does not get its place stays in the line, with
    `deadline` (kept from its first enqueue, whatever a later call passes); `enqueued_at`: its place
    in the line when it had one before (a preempted job, requeued). When the pass names jobs to
    preempt for this job, they are requeued here and the job places again at once
    (gpuboot.lifecycle.preemption)."""
    now = booker.clock()
    state = queue.snapshot()
    entry = entry_of(spec, job_id, now if enqueued_at is None else enqueued_at)
    if not any(e.job_id != job_id for e in state.live(now)):
        booking = first()
        plan = booking.plan
        if plan.outcome is Outcome.FITS:
            queue.admit(job_id, spec.team, _model(plan, booking.survey.views if booking.survey else (), entry),
                        entry.gpus, deadline, entry, spec.namespace)
            if any(h.job_id == job_id and h.firm for h in state.holds):
                let_go(booker.ledger, job_id)
            return Turn(plan, deadline=deadline)
        if plan.outcome is not Outcome.BUSY:
            return Turn(plan, deadline=deadline)
        if not _may_preempt(state, entry, config, now):
            state = queue.enqueue(entry, deadline)
            _still_held(booker, state, job_id)
            return Turn(plan, Step(entry, 0, False, plan.message), len(state.live(now)),
                        state.deadline_of(job_id, now), state.changes,
                        hold=next((h for h in state.holds if h.job_id == job_id), None))
        # busy, alone in the line, and it may preempt a job running: the pass decides (it may hold and preempt)
    tries = PREEMPT_TRIES      # passes that may preempt; after a preemption, one more places on the room made
    firm = any(h.job_id == job_id and h.firm for h in state.holds)
    while True:
        state = queue.enqueue(entry, deadline)
        deadline = state.deadline_of(job_id, now)
        ledger = booker.ledger.snapshot()
        seen = survey(booker.kube, booker.ecs, ledger.others(job_id, now), now, booker.boot_grace_seconds)
        result = decide(state.live(now), (job_id, spec.to_job_request(job_id)), seen.views,
                        ledger.live_unavailable(now), state.live_holds(now), config, state.usage(now),
                        capacity_of(seen.views), now, running_jobs(state, seen.pods, now, ledger.reservations))
        step = result.step(job_id)
        victims = result.preempt.get(job_id) if tries and step is not None and not step.admitted else None
        if not victims:
            queue.save_holds(result.holds, state)
            break
        tries -= 1
        # the hold and the preemption in one write over the state this pass read (module doc of preemption)
        mine = next(e for e in state.live(now) if e.job_id == job_id)    # with its first enqueue time
        if preempt(booker.kube, booker.ledger, queue, mine, victims, result.holds, state, booker.log, now):
            tries, firm = 0, True
        now = booker.clock()
    waiting = len(state.live(now))
    names = {e.job_id: e.name for e in state.live(now) if e.name and e.name != e.job_id}
    if step is None or not step.admitted:
        _still_held(booker, state, job_id)
        blocker = step.blocker if step else "not judged"
        return Turn(Plan(job_id, Outcome.BUSY, f"waiting in the job queue: {blocker}"), step, waiting, deadline,
                    state.changes, names, result.holds.get(job_id))
    held = [m for h in result.holds.values() if h.job_id != job_id and not h.lets(step.entry, now) for m in h.marks()]
    plan = booker.book(spec, job_id, held=held).plan
    if plan.outcome is Outcome.FITS:
        queue.admit(job_id, spec.team, _model(plan, seen.views, entry), entry.gpus, deadline, entry, spec.namespace)
        if firm:
            let_go(booker.ledger, job_id)        # its place is committed: the nodes freed for it are no longer kept
    else:
        _still_held(booker, state, job_id)
    return Turn(plan, step, waiting, deadline, state.changes, names)


def _still_held(booker: Booker, state: QueueState, job_id: str) -> None:
    """The job's turn ends without its place: if it holds nodes firm (it preempted for them), its
    ledger marks are moved on to the lease its entry was just given in `state`, so other placements
    keep off them as long as the entry lives, not only for the lease of the preemption's moment
    (the safety argument: gpuboot.lifecycle.preemption, "The preemptor still waiting")."""
    lease = next((w.lease_until for w in state.waiting if w.entry.job_id == job_id), None)
    if lease is not None and any(h.job_id == job_id and h.firm for h in state.holds):
        keep_holding(booker.ledger, job_id, lease)


def _may_preempt(state: QueueState, entry: Entry, config: QueueConfig, now: float) -> bool:
    """Could the pass preempt anything for `entry` (its class or wait, and a preemptible job admitted)?"""
    kept = next((e for e in state.live(now) if e.job_id == entry.job_id), entry)
    return may_preempt(kept, now, config) and any(a.entry is not None and a.entry.preemptible and a.until > now
                                                  for a in state.running)


def _model(plan: Plan, views, entry: Entry) -> str | None:
    """The GPU model the job got (the batch path shows no views: the one model it accepts, if one)."""
    by_name = {v.name: v.gpu_model for v in views}
    found = by_name.get(plan.assignments[0].node) if plan.assignments else None
    return found or (entry.models[0] if len(entry.models) == 1 else None)

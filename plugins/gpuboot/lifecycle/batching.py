"""Group commit for bursts: one placer reads the cluster and commits every waiting first placement.

Why. Each placement needs one full cluster read (Nodes, every active Pod, ECS): on a large
fleet that is a lot of client and API-server CPU and a large heap of parsed pods. A burst of
place steps, each reading for itself, costs one read per step however well conflicts are
retried (`gpuboot.lifecycle.booking`, "Bursts"): more CPU than the burst goal's time allows
(docs/performance.md, Bursts), and more memory than the workers have. A burst's placements are
independent, so one read can serve them all.

How. A place step reads nothing before it queues its request (`Queued`: resources and constraints
only, never the command or env; a `ticket` names this wait) in one of the queue's shards
(`RequestQueue`, its own ConfigMaps, so a burst queueing does not contend on the ledger): one
merge patch, whose answer, the shard as written, already shows the lease's copy. It then polls its
shard (GETs, which never conflict), where the leader copies its answer and its lease after each commit
(`RequestQueue`); the ledger root only when those copies do not show a live lease or its answer.
A thousand waiters queueing at once thus cost the API server a thousand patches, not three
thousand requests, while the leader's first round waits behind them.
A waiter that sees no live lease takes it (one compare-and-swap on the ledger root) and leads:
after GATHER_SECONDS, so the rest of the burst queues behind it, one survey, then every queued request is placed in queue order against that survey plus every live
reservation plus the requests placed before it in the batch, and one ledger write adds all their
reservations and `Decided` answers (fits, busy or never, with the plan: its whole candidate table
for a batch of one, a few rows each in a burst, ANSWER_ROWS in all for every live answer, so
however many batches follow each other the answers stay within that budget plus their chosen
rows) and renews the lease.
Each waiter reads its answer (its reservations are already there), from its queue shard, or
from the ledger root, which keeps it DECIDED_SECONDS, when the copy is missing. A leader keeps
leading while requests arrive (for LEAD_SECONDS at most once its own job is answered, then it hands the lease
over, so no place step leads forever), re-placing against its survey as `gpuboot.lifecycle.booking` does
after a conflict, and reads again when the survey is too old or a tombstone it would need was
pruned. A "busy" or "never" answer comes only from a survey younger than VERDICT_MAX_AGE_SECONDS
with no release since (nothing it counts as reserved was freed meanwhile): a burst on a full
fleet is told "busy" from one read, not one read per job.

Why it is safe. Promises stay serialised by the ledger alone: the batch write is a
compare-and-swap against the ledger state L the plans were computed from, exactly like a single
placement's, and the queue is only a hint of who waits (an answer exists only in the ledger; a
request lost or read twice delays a job, never books it twice: a ticket already answered is never
placed again). When the write conflicts, the plans are kept only if the ledger moved by removing
reservations the plans counted (no reservation added, none released that the plans' ledger state
did not hold, by its tombstones; no mark added or removed, none of the batch's tickets answered by
another leader): capacity then only grew, and everything removed was counted as reserved when
the plans were made, which is what the tombstone rule of `gpuboot.lifecycle.booking` asks. (Live
reservations alone do not say it: a job that reserved, bound its pod and released in between
leaves them as they were, its node taken by a pod the plans never saw.) Any other change
places the batch again. A batch write only adds reservations, never removes one (its pod may be
about to be bound, and a placer that saw neither would promise the node twice: rule (d) of
`gpuboot.lifecycle.booking`); so a queued request of a job that holds a placement made meanwhile is
answered `alone` and places itself on the single path. A gang is placed whole by `place` or not at all.

Nothing is lost. A leader that dies stops renewing its lease; after LEASE_SECONDS a waiter
takes over the queue. A waiter that dies leaves its request, which expires after QUEUED_SECONDS
or is placed; its reservations then expire with their TTL like any crashed run's. A waiter that
is not answered within `contended_seconds` withdraws its request, takes an answer given meanwhile,
or else places itself on the single path (`Booker.book`, whose `LedgerContended` makes the place
step defer): a batch that cannot keep up costs at worst what no batching costs. Its budget starts
again whenever it sees a live lease, up to PROGRESS_WAIT_SECONDS in all: a thousand waiters
behind a leader that is placing them must not all fall back to full cluster reads at once, which
would starve the API server the leader needs. A live lease means a live leader: a place step's
lease is renewed only by its commits, a placer's by a thread that stops when the placer's loop
stops coming round (`gpuboot.lifecycle.placer`); the first batch on 10,000 nodes may take longer
than a waiter's budget. An answer given after the withdrawal is found by the next
try as reservations the job holds, which the single path replaces. A waiter that found neither copy nor
root answer queues its ticket again; the leader that answered it gives it the same answer again
(`decide`), any other answers it `alone`. Re-placements
(fail-over, retries of a started job, releases) keep the single-placement path: they need the
job's record, marks and the abandoned-node rule of `gpuboot.lifecycle.booking`. The place step
cannot tell one from a first placement without reading the ledger, so the leader, which reads
every shard anyway, answers a job with a live record or reservations `alone` (`placed_alone`),
and a waiter about to lead a batch reads its own record first (its batch would survey the
cluster only for the single path to survey it again).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from gpuboot.core.inventory import with_reservations
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import Reservation, Unavailable
from gpuboot.core.placement import Fleet, JobRequest, Outcome, Plan, Verdict, place
from gpuboot.exceptions import LedgerContended, Overloaded
from gpuboot.lifecycle.booking import (
    Basis,
    Booker,
    Booking,
    Survey,
    outdated_marks,
    reservation_ttl,
    survey,
)
from gpuboot.lifecycle.ledger import (
    Batch,
    Decided,
    Lead,
    LedgerConflict,
    LedgerState,
    Look,
    Queued,
    RequestQueue,
    backoff,
)

if TYPE_CHECKING:
    from gpuboot.lifecycle.view import ClusterView

LEASE_SECONDS = 15         # a leader renews its lease with every batch it commits (half the contention budget:
                            # a dead leader costs its waiters half their wait, not all of it)
QUEUED_SECONDS = 60         # a queued request nobody decided by then is dropped (a live waiter queues again)
DECIDED_SECONDS = 120       # how long an answer waits in the ledger for its waiter
POLL_SECONDS = (0.3, 0.9)   # a waiter's reads of its queue shard while its request is queued (jittered)
POLL_CROWD = 100            # beyond this many waiters, each reads its shard less often (`poll_seconds`)
POLL_MAX_SECONDS = 8.0     # (1,000 waiters: 125-250 reads a second in all)
LEASE_CHECK_SECONDS = 5     # and of the ledger (is anyone leading?) at least this often
COPIES_WAIT_SECONDS = 10    # a leader stepping down waits this long at most for its lease's copies under way
GATHER_SECONDS = 0.5        # a new leader waits this long before its survey, so a burst queues up behind it
VERDICT_MAX_AGE_SECONDS = 5  # "busy" or "never" only from a survey this recent (the job then waits a while)
ANSWER_ROWS = 400           # candidate-table rows all live answers carry together (~200 KiB): the ledger's answer budget
DECIDE_SECONDS = LEASE_SECONDS / 5   # placing one batch's requests takes this long at most (the rest: next batch)
ANSWER_BYTES = 150_000      # the answers the ledger root holds at once: a batch answers no more than fit, and the
                            # oldest, copied to the queue shards, make room (every place step reads the root once)
PROGRESS_WAIT_SECONDS = 300   # a waiter behind a leader that keeps committing batches waits this long at most
LEAD_SECONDS = 20           # a place step leads this long at most once its own job is decided, then hands over
VIEW_PATIENCE_SECONDS = 60  # a leader with a connected view that is behind waits this long for it, then reads in full


def book_first(booker: Booker, spec: JobSpec, job_id: str) -> Booking:
    """The place step's transaction: through a batch, or `booker.book` when the job holds a placement
    or has a record (a re-run of place after a start, say, needs the record and the abandoned-node
    rule). It reads nothing before queueing: the leader, which reads every ledger shard anyway,
    answers such a job `alone`, and a waiter about to lead looks at its own record first (module doc)."""
    return BatchPlacer(booker, spec).wait_for_batch(spec.to_job_request(job_id), reservation_ttl(spec))


class BatchPlacer:
    """The group-commit path for a first placement (see the module doc), on `booker`'s clients,
    clock and contention budget."""

    def __init__(self, booker: Booker, spec: JobSpec, lease_seconds: float = LEASE_SECONDS) -> None:
        self.booker, self.spec, self.lease_seconds = booker, spec, lease_seconds   # the lease it takes, as leader
        self.ledger, self.log = booker.ledger, booker.log
        self.queue = RequestQueue(booker.ledger.kube, booker.ledger.namespace, booker.ledger.name, booker.clock)
        self.alive_at = booker.monotonic()     # the leader's loop last came round (`renew` keeps a live one's lease)
        self.committed_at = 0.0                # when it last committed a batch (the `Lead` copies' `at`)
        self.lost_to: str | None = None        # who held the lease when `lead` found it lost
        self.given: dict[str, Decided] = {}    # ticket -> its "fits" answer, while it lives (`decide`: given again)
        self._view_behind: float | None = None  # since when its view could not say what it covers

    # ------------------------------------------------------------------ the waiter
    def wait_for_batch(self, request: JobRequest, ttl: float) -> Booking:
        """Queue `request`, lead a batch when nobody does, and return the batch's answer."""
        b = self.booker
        job_id = request.job_id
        give_up = b.monotonic() + b.contended_seconds
        ticket = f"{job_id}:{uuid.uuid4().hex[:12]}"
        entry = Queued(job_id, ticket, request.to_json(), ttl, b.clock() + QUEUED_SECONDS)
        try:
            queued: Look | None = self.queue.add(entry)   # a merge patch: a conflict only when the API server gives up
        except LedgerConflict as exc:
            raise LedgerContended(f"could not queue job {job_id} for a batch ({exc}); nothing held, retry later") \
                from None
        state: LedgerState | None = None    # the ledger root, once this waiter had to read it
        check_every = min(LEASE_CHECK_SECONDS, b.contended_seconds / 3)    # sees a leader's progress within its budget
        # the shard as queued into is the first look: if the lease's copy there shows nobody leading, read
        # the root at once; if someone leads, its answer is a round away at least, so the first poll waits like
        # the later ones (a thousand waiters reading at once, right after queueing, slowed the API server the
        # leader's round needs)
        checked = b.monotonic() if queued.lead is not None and queued.lead.lease_until > b.clock() else -check_every
        if checked >= 0:
            b.sleep(poll_seconds(queued.waiting, b.rng))
            queued = None
        longest = b.monotonic() + PROGRESS_WAIT_SECONDS
        while True:
            # its shard says whether it still waits, its answer once decided, and the leader's last commit
            # (`RequestQueue`: copies, never ahead of the ledger); the ledger root, once the entry is gone
            # with no answer, or every few seconds while the copied lead does not show a live lease
            try:
                look, queued = queued or self.queue.look(entry.ticket), None     # the patch's answer serves once
            except Overloaded:      # the API server turned the poll away (429) past the client's tries: nothing
                if b.monotonic() >= give_up:    # learnt, the budget as it was; the next poll a crowd's pause later
                    return self._withdraw(ticket, job_id)
                b.sleep(POLL_MAX_SECONDS * (b.rng or random).uniform(0.5, 1.0))
                continue
            if look.answer is not None:
                return self._answered(look.answer, state)
            gone, waiting, now = not look.waits, look.waiting, b.clock()
            # the copy is refreshed best effort (a renewal's copy may miss a shard): one lease stale still
            # counts, so a slow API server does not send a thousand waiters to the root at once
            led = look.lead is not None and look.lead.lease_until + LEASE_SECONDS > now
            if led:         # a leader lives (module doc, "Nothing is lost"): its waiters wait on
                give_up = min(longest, max(give_up, b.monotonic() + b.contended_seconds))
            if gone or (b.monotonic() - checked >= check_every and (not led or checked < 0)):
                checked = b.monotonic()
                state = self.ledger.snapshot()
                now = b.clock()
                answer = state.batch.answer(ticket)
                if answer is not None:
                    return self._answered(answer, state)
                if state.batch.led_by(now) is None:
                    if self.ledger.record_of(job_id, state, now) is not None:
                        # its own batch would answer it `alone` after a survey the single path repeats
                        self.queue.drop([ticket])
                        self.log.info("job %s has a record of an earlier try; placing it on its own", job_id)
                        return self.booker.book(self.spec, job_id)
                    if self._take_lease(state, ticket):
                        self.lead(ticket)
                        continue
                if state.batch.led_by(now) is not None:
                    give_up = min(longest, max(give_up, b.monotonic() + b.contended_seconds))   # a leader lives
            now = b.clock()
            if b.monotonic() >= give_up:
                return self._withdraw(ticket, job_id)
            if gone or now >= entry.expires_at - QUEUED_SECONDS / 2:      # keep the entry there while waiting
                entry = dataclasses.replace(entry, expires_at=now + QUEUED_SECONDS)
                with contextlib.suppress(LedgerConflict):     # the next poll tries again
                    self.queue.add(entry)
            b.sleep(poll_seconds(waiting, b.rng))

    def _take_lease(self, state: LedgerState, me: str) -> bool:
        """Become the leader, if nobody is (one compare-and-swap; losing it means another did)."""
        now = self.booker.clock()
        batch = dataclasses.replace(state.batch.live(now), leader=me, lease_until=now + self.lease_seconds)
        try:
            self.ledger.put_batch(state, batch)
        except LedgerConflict:
            return False
        # its copy in the queue shards, so the waiters queueing now need not read the root to know (in the
        # background: a burst queueing into the same shards must not hold up the leader, RequestQueue)
        self.queue.publish_later((), Lead(me, batch.lease_until, self.committed_at))
        return True

    def _answered(self, answer: Decided, state: LedgerState | None) -> Booking:
        """The waiter's booking from its answer: no record (a batch writes none, and a job that had one was
        answered `alone`), and the ledger root only if the waiter read it."""
        if answer.alone:
            self.log.info("job %s holds a placement or a record already; placing it again on its own", answer.job_id)
            return self.booker.book(self.spec, answer.job_id)
        plan = Plan.from_json(answer.plan)
        if plan.outcome == Outcome.FITS:
            self.log.info("placed in a batch led by %s: %s", answer.by,
                          "; ".join(f"{a.task} -> {a.node}" for a in plan.assignments))
        return Booking(plan, plan.outcome == Outcome.FITS, state, None)

    def _withdraw(self, ticket: str, job_id: str) -> Booking:
        """Give up the wait: take the request out of the queue, then take an answer given meanwhile."""
        self.queue.drop([ticket], attempts=20)
        state = self.ledger.snapshot()
        answer = state.batch.answer(ticket)
        if answer is not None:
            return self._answered(answer, state)
        self.log.info("no batch answered job %s within %.0f s; placing it on its own", job_id,
                      self.booker.contended_seconds)
        return self.booker.book(self.spec, job_id)      # LedgerContended from there: the step defers

    # ------------------------------------------------------------------ the leader
    def lead(self, me: str, view: ClusterView | None = None, stay: bool = False,
             state: LedgerState | None = None) -> None:
        """Decide every queued request, batch after batch, until the queue is empty (module doc).
        `view`: the cluster from a watch-fed view (`gpuboot.lifecycle.placer`), full reads only when
        it cannot say what it covers; `stay`: keep the lease when the queue is empty (a placer
        leads for as long as it lives; a place step hands over); `state`: the ledger as the caller
        has just read it, for the first round (a thousand waiters queueing make every read slow)."""
        b = self.booker
        basis: Basis | None = None
        fresh, first = False, state
        began = b.monotonic()
        if not stay:
            b.sleep(GATHER_SECONDS)     # let the rest of a burst queue behind the one read
        while True:
            self.alive_at = round_began = b.monotonic()
            state, first = (first if first is not None else self.ledger.snapshot()), None
            rooted = b.monotonic()
            now = b.clock()
            if state.batch.led_by(now) != me:
                self.lost_to = state.batch.led_by(now)
                return                  # the lease went to someone else (ours expired): they lead
            queue = latest_per_job(self.queue.waiting(d.ticket for d in state.batch.decided))
            queued_at = b.monotonic()
            if not queue and self.queue.unread:     # an empty queue only if every shard was read
                b.sleep(POLL_SECONDS[1])
                continue
            if not queue and stay:
                return
            if not queue or (b.monotonic() - began > LEAD_SECONDS and state.batch.answer(me) is not None):
                return self._step_down(me)      # done, or led long enough: a waiter takes the lease over
            got = self._basis(basis, state, now, fresh, view)
            if got is None:
                continue                # the view is catching up (it waited WAIT_PAST_SECONDS): look again
            basis, released = got
            fresh = False
            based = b.monotonic()
            # boot-failure marks whose evidence is gone go, as on the single path (booking.outdated_marks)
            outdated = outdated_marks([m for m in state.live_unavailable(now) if m in basis.marks],
                                      basis.survey.nodes, basis.survey.views)
            # the Nodes it books are claimed for this ledger while the rest of the batch is placed
            claims = self.ledger.claims_as_placed(basis.survey.nodes)
            try:
                plans, added = self.decide(queue, basis.survey, state.others("", now), released,
                                           [m for m in state.live_unavailable(now) if m not in outdated], now,
                                           answer_rows(state.batch.live(now), len(queue)),
                                           fitted=lambda plan: claims.add(a.node for a in plan.assignments),
                                           alone=recorded(state, now))
            finally:
                placed_at = b.monotonic()
                claims.finish()         # the claims under way, whatever happened
            queue = queue[:len(plans)]  # what the time budget let it place; the rest waits for the next batch
            claims.wait()               # SecondLedger: another ledger books one of them; nothing committed
            spent = (based - round_began, rooted - round_began, queued_at - rooted, based - queued_at,
                     placed_at - based, b.monotonic() - placed_at)
            unfit = [p for p in plans if p.outcome != Outcome.FITS]
            if unfit and (released or b.monotonic() - basis.at > VERDICT_MAX_AGE_SECONDS):
                # a verdict of busy or never rests on a recent read, no release pending
                self.log.info("batch: %d of %d plans do not fit (job %s: %s) on a read %.1f s old with %d "
                              "release(s) since; placing the batch again on a fresh read", len(unfit), len(plans),
                              unfit[0].job_id, unfit[0].outcome.value, b.monotonic() - basis.at, len(released))
                fresh = True
                continue
            for attempt in range(1, 1 << 30):
                try:
                    self._commit(state, me, queue, plans, added, outdated, spent)
                    break
                except LedgerConflict:
                    newer = self.ledger.snapshot()
                    if not still_valid(state, newer, queue, b.clock()):
                        break           # place the batch again against the newer ledger
                    state = newer
                    b.sleep(backoff(attempt, base=0.02, cap=0.5, rng=b.rng))

    def _basis(self, basis: Basis | None, state: LedgerState, now: float, fresh: bool,
               view: ClusterView | None) -> tuple[Basis, list[Reservation]] | None:
        """The survey to place against and the releases since it to count: from the view when there is one
        and it can say what it covers, else the survey already read (`Basis.reusable`), else a full read.
        `fresh`: read after `state` itself. None: the view is connected but behind (re-listing after a
        410, say), for less than VIEW_PATIENCE_SECONDS so far: on a large fleet a full read costs more
        than the view's catching up, and a thousand waiters' batch would wait for it anyway."""
        b = self.booker
        if view is not None:
            got = view.basis(self.ledger.name, state, now, fresh=fresh)
            if got is not None:
                self._view_behind = None
                return got
            if view.connected():
                self._view_behind = self._view_behind or b.monotonic()
                if b.monotonic() - self._view_behind < VIEW_PATIENCE_SECONDS:
                    self.log.info("the cluster view's pod stream is behind the ledger (for %.1f s); looking again",
                                  b.monotonic() - self._view_behind)
                    return None
            behind, self._view_behind = self._view_behind, None
            self.log.info("the cluster view %s; reading the cluster in full",
                          f"has been behind for {b.monotonic() - behind:.0f} s" if behind is not None
                          else "is disconnected")
        released = None if fresh or basis is None else basis.reusable(state, "", b.monotonic())
        if released is not None:
            return basis, released
        b.full_reads += 1
        read_at = b.monotonic()
        return Basis(state.seq, survey(b.kube, b.ecs, state.others("", now), now, b.boot_grace_seconds),
                     read_at, frozenset(state.live_unavailable(now))), []

    def decide(self, queue: Sequence[Queued], seen: Survey, reserved: list[Reservation], released: list[Reservation],
               unavailable: list[Unavailable], now: float, rows: int = ANSWER_ROWS,
               fitted: Callable[[Plan], object] | None = None,
               alone: Collection[str] = ()) -> tuple[list[Plan], list[Reservation]]:
        """Place each queued request in turn against `seen` plus `reserved` (the live reservations) plus
        `released` (releases the survey may not show yet, counted as still reserved) plus the ones before
        it, for DECIDE_SECONDS at most (at least one): a batch must be committed well within the lease, or
        a waiter takes the lease over and the batch is lost (a thousand jobs on 10,000 nodes take seconds
        to place). A job with a live reservation holds a placement made meanwhile (answered `alone`); one
        whose reservations were released holds nothing and is placed (a batch taken back after a
        conflict left its jobs' tombstones: counted as holders, they were told busy, round after round).
        `fitted` is told of each plan that fits as soon as it is made; `alone`: jobs with a record
        (`recorded`), answered `alone` as well (`placed_alone`).

        A request whose very ticket this leader answered "fits", its job holding just that answer's
        reservations and no record, gets the same answer again (nothing placed): its waiter never read the
        first (the copy landed after the waiter's poll, or was not written; the root let it go) and queued
        again. Answered `alone`, it would place itself on the single path, reading the whole cluster: on
        the 10,000-node real plane 59 such waiters at once brought the API server down."""
        plans, added = [], []
        holds: dict[str, set[tuple[str, str]]] = {}       # job -> the (task, node) it holds
        for r in reserved:
            holds.setdefault(r.job_id, set()).add((r.task, r.node))
        holders = holds.keys() | set(alone)
        fleet = Fleet(seen.recounted([*reserved, *released], now).views)     # prepared once for the batch
        until = self.booker.monotonic() + DECIDE_SECONDS
        room = ANSWER_BYTES
        for entry in queue:
            if plans and (self.booker.monotonic() > until or room < 0):
                break
            request = JobRequest.from_json(entry.request)
            earlier = self.given.get(entry.ticket)
            if earlier is not None and entry.job_id not in alone and holds.get(entry.job_id) == {
                    (a["task"], a["node"]) for a in earlier.plan["assignments"]}:
                self.log.info("batch: job %s asked again with the ticket it was answered (its answer's copy was "
                              "late or lost): the same answer again", entry.job_id)
                plans.append(Plan.from_json(earlier.plan))
                room -= answer_bytes(compact(plans[-1], rows).to_json(), entry.ticket)
                continue
            if entry.job_id in holders:     # placed meanwhile (its wait gave up and placed itself), or re-placed
                plans.append(Plan(entry.job_id, Outcome.BUSY, "the job holds a placement made meanwhile, or a "
                                  "record of an earlier try; placing it again on its own"))
                continue
            plan = place(request, fleet, unavailable, table_rows=rows)     # only the rows its answer keeps
            plans.append(plan)
            room -= answer_bytes(compact(plan, rows).to_json(), entry.ticket)
            if plan.outcome == Outcome.FITS:
                mine = [Reservation(job_id=entry.job_id, task=a.task, node=a.node, resources=a.requests,
                                    expires_at=now + entry.ttl) for a in plan.assignments]
                added += mine
                # counted on top: only the new ones, on their nodes only (not a new list of 10,000 views a job)
                touched = [fleet.nodes[i] for i in sorted({fleet.at[r.node] for r in mine})]
                fleet.update(with_reservations(touched, seen.backed, mine, now))
                if fitted is not None:
                    fitted(plan)
        return plans, added

    def _commit(self, state: LedgerState, me: str, queue: Sequence[Queued], plans: Sequence[Plan],
                added: list[Reservation], outdated: Sequence[Unavailable] = (),
                spent: tuple[float, ...] = (0.0,) * 6) -> None:
        """Every reservation and answer of the batch in one write, the lease renewed, the `outdated`
        marks dropped. `spent`: seconds the round took to read (in all; the ledger root; the queue; the view
        and the ledger's shards), to place, and to wait for the claims of the never-booked nodes still under
        way after that."""
        now = self.booker.clock()
        began = self.booker.monotonic()
        live = state.batch.live(now)
        rows = answer_rows(live, len(queue))
        holders = placed_alone(state, now)     # answered `alone` (see decide)
        answers = tuple(Decided(q.job_id, q.ticket, compact(p, rows).to_json(), me.split(":", maxsplit=1)[0],
                                now + DECIDED_SECONDS, alone=q.job_id in holders and p.outcome != Outcome.FITS)
                        for q, p in zip(queue, plans))
        batch = Batch(kept_answers(live.decided, answers), me, now + self.lease_seconds)
        # never removes a reservation: its pod may still be bound (the tombstone rule of gpuboot.lifecycle.booking)
        self.ledger._write([*state.reservations, *added], [m for m in state.unavailable if m not in set(outdated)], state,
                           state.jobs, batch=batch)
        for mark in outdated:
            self.log.info("dropped the mark on %s (%s): the node is Ready or booted again since", mark.what,
                          mark.reason)
        self.committed_at = now
        self.given = {t: d for t, d in self.given.items() if d.expires_at > now}
        self.given.update((d.ticket, d) for d, p in zip(answers, plans) if p.outcome == Outcome.FITS)
        written = self.booker.monotonic()
        # copies for the waiters, in the background (RequestQueue): a burst queueing into the same shards
        # must not hold up the next round
        self.queue.publish_later(answers, Lead(me, batch.lease_until, now))
        for q, p in zip(queue, plans):
            self.log.info("batch: job %s: %s%s", q.job_id, p.outcome.value,
                          "".join(f"; {a.task} -> {a.node}" for a in p.assignments))
        self.log.info("batch: decided %d queued placement(s) (%d fit) in one write (read %.2f s: ledger root %.2f, "
                      "queue %.2f, view and ledger shards %.2f; placed %.2f s, claims waited %.2f s, written %.2f s: "
                      "ledger %.2f, queue copies handed over %.2f)", len(queue), sum(p.outcome == Outcome.FITS for p in plans),
                      *spent, self.booker.monotonic() - began, written - began, self.booker.monotonic() - written)

    def renew(self, me: str, below: float | None = None) -> bool:
        """The lease renewed if `me` holds it with less than `below` seconds of it left (two thirds of the
        lease by default; one compare-and-swap
        of the root; losing it to a batch commit is fine, that renewed it), and its copy in the queue shards,
        `at` unchanged (waiters take a new `at` for a committed batch). Whether it was renewed."""
        state = self.ledger.snapshot()
        now = self.booker.clock()
        if state.batch.led_by(now) != me or state.batch.lease_until - now >= (
                self.lease_seconds * 2 / 3 if below is None else below):
            return False
        batch = dataclasses.replace(state.batch.live(now), lease_until=now + self.lease_seconds)
        try:
            self.ledger.put_batch(state, batch)
        except LedgerConflict:
            return False
        self.queue.publish_later((), Lead(me, batch.lease_until, self.committed_at))   # in the background, as `_take_lease`
        return True

    def _step_down(self, me: str) -> None:
        """Give the lease up (a waiter whose request came after the last read takes it over)."""
        for attempt in range(1, 21):
            state = self.ledger.snapshot()
            live = state.batch.live(self.booker.clock())
            if live.leader != me:
                return
            try:
                self.ledger.put_batch(state, dataclasses.replace(live, leader=None, lease_until=0.0))
                # the copies in the queue shards say so too, or waiters trusting them would not look: after
                # the lease's copies still under way, which would say it lives
                self.queue.wait_copied(COPIES_WAIT_SECONDS)
                return self.queue.publish((), Lead(me, 0.0, self.booker.clock()))
            except LedgerConflict:
                self.booker.sleep(backoff(attempt, rng=self.booker.rng))
        # not given up: the lease lapses on its own within LEASE_SECONDS


def still_valid(old: LedgerState, new: LedgerState, queue: Sequence[Queued], now: float) -> bool:
    """Plans made against `old` hold against `new` when the ledger only lost reservations the plans
    counted: no reservation added, none released that `old` did not hold (the tombstones since `old`
    say: a job that reserved and released in between, its pod bound meanwhile, left the live sets
    alike and its node taken by a pod the plans never saw), the marks unchanged, none of the batch's
    requests answered by another leader meanwhile (the module doc's safety argument)."""
    def key(r: Reservation) -> tuple:
        return r.job_id, r.task, r.node, r.resources

    before = {key(r) for r in old.reservations if r.expires_at > now}
    after = {key(r) for r in new.reservations if r.expires_at > now}
    released = new.released_since(old.seq, "")
    return (released is not None and after <= before and {key(r) for r in released} <= before
            and set(old.live_unavailable(now)) == set(new.live_unavailable(now))
            and not any(new.batch.answer(q.ticket) for q in queue))


def placed_alone(state: LedgerState, now: float) -> set[str]:
    """Jobs a batch does not place: those holding live reservations (placed meanwhile) or a live record
    (an earlier try started or failed nodes: the single path's record and abandoned-node rule). Their
    waiters are answered `alone` and book on the single path."""
    return {r.job_id for r in state.reservations if r.expires_at > now} | recorded(state, now)


def recorded(state: LedgerState, now: float) -> set[str]:
    """Jobs with a live record (an earlier try started or failed nodes)."""
    return {j.job_id for j in state.jobs if j.expires_at > now}


def latest_per_job(queue: Sequence[Queued]) -> list[Queued]:
    """One request per job, its newest (an older ticket of the same job is a wait that gave up)."""
    newest = {q.job_id: q for q in queue}      # queue order is oldest first
    return [q for q in queue if newest[q.job_id] is q]


def poll_seconds(waiting: int, rng: random.Random | None = None) -> float:
    """A waiter's pause before its next read of its queue shard: POLL_SECONDS (jittered) while few wait,
    longer in proportion beyond POLL_CROWD waiters (up to POLL_MAX_SECONDS), so that the waiters of a
    large burst read the API server at about POLL_CROWD / mean(POLL_SECONDS) times a second in all."""
    return min(POLL_MAX_SECONDS, (rng or random).uniform(*POLL_SECONDS) * max(1.0, waiting / POLL_CROWD))


def answer_rows(live: Batch, n: int) -> int:
    """Candidate rows each of `n` new answers may carry: what the live answers of earlier batches
    (they stay DECIDED_SECONDS) leave of ANSWER_ROWS, shared. One job alone gets its table, a burst
    a few rows each, and batch after batch in a row only their chosen rows, so the answers in the
    ledger never pass the budget plus their chosen rows, however long the burst."""
    held = sum(len(d.plan.get("candidates", ())) for d in live.decided)
    return max(0, ANSWER_ROWS - held) // max(1, n)


def answer_bytes(plan: dict, ticket: str) -> int:
    """About what one answer takes in the ledger root (its plan, ticket and the rest of a `Decided`)."""
    return len(json.dumps(plan)) + len(ticket) * 2 + 150


def kept_answers(older: Sequence[Decided], new: Sequence[Decided]) -> tuple[Decided, ...]:
    """The root's answers after a batch: `new`, and as many of the `older` (newest first) as ANSWER_BYTES
    leaves room for. Why dropping one early is safe: its copy is in its waiter's queue shard (copied
    after its own commit), and a waiter that finds neither withdraws and books on the single path,
    which takes over the reservations the answer gave it; a leader meeting its request again
    answers it `alone` (the job holds a placement), never places it twice."""
    room = ANSWER_BYTES - sum(answer_bytes(d.plan, d.ticket) for d in new)
    kept: list[Decided] = []
    for d in reversed(older):
        room -= answer_bytes(d.plan, d.ticket)
        if room < 0:
            break
        kept.append(d)
    return (*reversed(kept), *new)


def compact(plan: Plan, rows: int) -> Plan:
    """The plan as its waiter reads it from the ledger: at most `rows` rows of its candidate table,
    the chosen ones first (the rest are counted as omitted), so that a burst's answers stay small."""
    chosen = [c for c in plan.candidates if c.verdict == Verdict.CHOSEN]
    kept = (chosen + [c for c in plan.candidates if c.verdict != Verdict.CHOSEN])[:max(rows, len(chosen))]
    order = {id(c): i for i, c in enumerate(plan.candidates)}
    kept.sort(key=lambda c: order[id(c)])
    return dataclasses.replace(plan, candidates=tuple(kept),
                               candidates_omitted=plan.candidates_omitted + len(plan.candidates) - len(kept))

"""Live preemption: the jobs the queue's pass names for a starving job are requeued, not failed.

The decision is the core's (`gpuboot.core.queue.victims`, through the pass): only jobs that said
`preemptible: true`, of a lower class (or ranking below a job that waited past the thresholds),
on the nodes held for the starving job, and only when that makes room for its whole gang. An
admitted job with no pod yet (its start or wait step) counts by its reservations (`running_jobs`):
it goes first, having lost no work.

Who acts: the preemptor's own place step, for its own job only (`gpuboot.lifecycle.jobqueue.book_in_order`):
every step runs the same pass, which names victims for one job only, the queue's head preemptor
(`gpuboot.core.queue.run_pass`). In this order:

0. the held nodes are marked in the ledger as held for the preemptor (`keep_for`: a node mark in
   the shard the node's reservations live in, expiring with its queue entry's lease and renewed with
   it while the preemptor waits: `keep_holding`), unless one is marked for another job already
   (that job is preempting there: nothing done);
1. the queue's compare-and-swap (`JobQueue.preempt`), over the very state the pass read, takes the
   victims out of the admitted jobs and puts them back in the line with their first enqueue time,
   each with a record: by whom and why; and writes the pass's holds, the preemptor's turned firm;
2. their pods are deleted (every rank of a gang) and waited for until gone;
3. their reservations are dropped from the ledger (their job records stay: release still stops a
   node a victim started and no pod ran on);
4. the preemptor places again at once, its own placement ignoring the marks held for it
   (`Unavailable.held_for`), and drops them once placed (`let_go`).

The victim's launch step (`gpuboot.operators.launch`) reads the record before it creates pods,
after it created them, and when its gang ends short: it logs by whom and why, drops what it still
holds (3 again, idempotent), waits in the line and places again through the same booking code.
A victim still in its start or wait step re-places nothing (`JobBoot.not_preempted`, before every
re-placement) and goes on to its launch step at once, which does the above.

Why this is safe:

- Two preemptors, one victim. Step 0 refuses a node marked for another job, and step 1 is one
  compare-and-swap over the state the pass read that takes every victim or none, only victims
  still admitted and not preempted yet: the loser writes nothing there, drops its marks (no pod
  deleted, no reservation dropped) and places only when a later pass admits it. Since step 1 is
  written over the state its pass read, the preemptor was the queue's head preemptor then.
- The room freed goes to the preemptor, not to a job ahead of it, nor to a placement that read the
  queue before step 1 (or never reads it: the batch path). Every pass after step 1 sees the firm
  hold and keeps every other job off those nodes; and every placement does, through the ledger: the
  marks of step 0 are in the shard of each node's reservations, written before step 3 drops them
  (or the victim's own launch or release does), so a placement that commits on the node after it
  has room there read the mark (the shard's compare-and-swap). The ledger never gives one GPU twice.
  Eight preemptors at once on the fakes: the job recorded as preemptor is the one that got the room.
- A victim finishing on its own. Released before step 1, it is no longer admitted: nothing is
  written. Released after, its release drops its entry and record (`JobQueue.drop`); its pods had
  ended (they hold nothing); its launch either saw the success first, or saw its pods deleted and
  the record, and runs the job again (a preemptible job must be restartable; that is what it said).
- A victim launching while preempted. Step 1 is written before step 2 lists the pods, and launch
  reads the record after it created its pods: either step 2 sees the pods, or launch sees the
  record and deletes them itself. No pod of a preempted job runs on.
- A victim still coming up. Its start or wait step re-places only through `JobBoot.rebook` or a
  fail-over, and both read the record first; step 1 is written before step 3 drops its
  reservations, so a step that found them gone sees the record and books nothing. A step that
  re-placed just before step 1 holds new reservations it is not owed, until its launch reads the
  record (before creating pods) and gives them back; the ledger never gives one GPU twice
  meanwhile, so at worst the preemptor waits one more poll. The fakes' tests run the victim's
  re-placement at each of these moments.
- The preemptor still waiting after step 4 (its placement found the room not free yet: a pod still
  going, part of a gang's nodes still draining). Its firm hold lives as long as its queue entry,
  which its place step renews at every poll; so does each mark: every turn that ends without a
  commit moves the marks on to the lease just written (`keep_holding`, in `book_in_order`). A
  renewal only extends marks live in the state its compare-and-swap read, never brings one back:
  once a mark lapsed (another job may have booked the node since) or was let go (the preemptor
  placed; its release ran: `JobQueue.drop` says it held firm, release lets go), no renewal, stale
  or racing, writes it again. A mark never outlives the entry: its expiry is the lease of the
  enqueue that preceded it, and an entry that lapses takes its marks with it at the same moment.
  The ledger still never gives one GPU twice (marks only keep other placements off; every commit
  is the shard's compare-and-swap). On the fakes: the preemptor polling for 5 leases while other
  jobs place at once, then committing, or stopping, with no mark left and no GPU over-promised.
- The preemptor dying after step 0, 1 or 2. The record was written first, so the victim's launch
  still requeues and drops its own reservations; the preemptor's hold and its marks end with its
  lease (150 s), and its retry decides again. Preemption starts no instance and removes no job
  record, so no instance runs without a record.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuboot.core.inventory import parse_time
from gpuboot.core.model import LABEL_JOB, TERMINATED_PHASES, Reservation, Unavailable
from gpuboot.core.ports import PodControl
from gpuboot.core.queue import PRIORITY_CLASSES, Entry, Hold, Running
from gpuboot.core.timefmt import duration, utc
from gpuboot.lifecycle.ledger import ReservationLedger

if TYPE_CHECKING:    # jobqueue calls this module (its place step's turn); the types only, here
    from gpuboot.lifecycle.jobqueue import Admitted, JobQueue, Preempted, QueueState

GONE_SECONDS = 60.0          # how long a deleted pod may take to go before it is force-deleted
RENEW_SLACK_SECONDS = 30.0   # the preemptor's marks are moved on when they would lapse this long before its lease


def running_jobs(state: QueueState, pods: Sequence[Mapping], now: float,
                 reservations: Sequence[Reservation] = ()) -> list[Running]:
    """The admitted jobs as preemption and the holds (by the jobs' stated runtimes) see them: one
    `Running` per live pod on its node (a pod being deleted is already going: it is not counted),
    and, for an admitted job with no live pod yet (its start or wait step: node booting, GPUs not
    registered), one per reservation, started now (it has lost no work: the first to go) with its
    end unknown. A job whose preemption is not settled yet (being requeued) is not counted: the
    queue refuses to preempt it again."""
    admitted = {a.job_id: a for a in state.running if a.until > now and a.entry is not None
                and state.preempted_of(a.job_id) is None}
    out = []
    for pod in pods:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        job = admitted.get((meta.get("labels") or {}).get(LABEL_JOB, ""))
        if job is None or job.entry is None or not spec.get("nodeName") or meta.get("deletionTimestamp"):
            continue
        started = parse_time((pod.get("status") or {}).get("startTime")) or parse_time(meta.get("creationTimestamp"))
        out.append(Running(job.job_id, spec["nodeName"], job.entry.requests, job.entry.priority_class,
                           job.entry.preemptible, now if started is None else started, job.entry.enqueued_at,
                           job.entry.expected_runtime, job.entry.team))
    with_pods = {r.job_id for r in out}
    for r in reservations:
        job = admitted.get(r.job_id)
        if job is not None and job.entry is not None and r.job_id not in with_pods and r.expires_at > now:
            out.append(Running(job.job_id, r.node, r.resources, job.entry.priority_class, job.entry.preemptible,
                               now, job.entry.enqueued_at, team=job.entry.team))
    return out


def reason(preemptor: Entry, victim: Entry, hold: Hold | None, now: float) -> str:
    """Why, in words for the victim's log: the class (or the wait) that outranks it, and where."""
    where = f" on node(s) {', '.join(hold.nodes)}" if hold else ""
    if PRIORITY_CLASSES[preemptor.priority_class] > PRIORITY_CLASSES[victim.priority_class]:
        why = f"priority class {preemptor.priority_class} outranks {victim.priority_class}"
    else:
        why = f"it has waited {duration(now - preemptor.enqueued_at)}, past the starvation and preemption thresholds"
    gpus = f"{preemptor.gpus} GPU(s)" + (f" as a gang of {preemptor.tasks}" if preemptor.tasks > 1 else "")
    return f"it needs {gpus}{where} and {why}; this job said preemptible: true"


def delete_and_wait(kube: PodControl, pods: Sequence[Mapping], poll_seconds: float = 1.0,
                    gone_seconds: float = GONE_SECONDS, sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Delete `pods` and wait until they are gone; a pod still there after `gone_seconds` (its node
    lost: it stays Terminating) is force-deleted and waited for 30 s more. The names still there
    ([]: all gone). Launch's clearing of an earlier attempt and a preemption share it.

    The reads start 50 ms apart and double up to `poll_seconds`: a pod whose kubelet confirms its
    end within a few hundred milliseconds (the usual case) is seen gone then, not a whole poll later
    (the preemptor's place step waits on this: 1.97 s on the real control plane with 1 s polls, 0.99 s
    so; docs/performance.md)."""
    left = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods}
    for grace, wait in ((None, gone_seconds), (0, 30.0)):
        for namespace, name in sorted(left):
            kube.delete_pod(namespace, name, grace_seconds=grace)
        deadline, pause = time.monotonic() + wait, min(poll_seconds, 0.05)
        while left and time.monotonic() < deadline:
            left = {(ns, n) for ns, n in left if kube.read_pod(ns, n) is not None}
            if left:
                sleep(pause)
                pause = min(poll_seconds, pause * 2)
        if not left:
            return []
    return sorted(n for _, n in left)


def drop_reservations(ledger: ReservationLedger, job_id: str) -> int:
    """Give back the job's reservations, keeping its job record (the instances it started: its
    release still stops one no pod ran on). How many were dropped (0: none left, idempotent)."""
    dropped: set[tuple[str, str]] = set()     # over every round: a sharded ledger writes in rounds

    def change(state):
        mine = {(r.task, r.node) for r in state.reservations if r.job_id == job_id}
        dropped.update(mine)
        if not mine:
            return None
        return [r for r in state.reservations if r.job_id != job_id], list(state.unavailable), list(state.jobs)

    ledger.update(change, f"drop the reservations of preempted job {job_id}")
    return len(dropped)


def keep_for(ledger: ReservationLedger, job_id: str, nodes: Sequence[str], until: float) -> bool:
    """Mark `nodes` in the ledger as held for `job_id` until `until` (its queue entry's lease): every
    other placement keeps off them, this job's does not (`Unavailable.held_for`). False, writing
    nothing more, when one is held for another job already (a preemption there is under way)."""
    free = [True]

    def change(state):
        live = state.live_unavailable(ledger.clock())
        if any(u.node in nodes and u.held_for not in (None, job_id) for u in live):
            free[0] = False
            return None
        have = {u.node for u in live if u.held_for == job_id}
        add = [Unavailable.holding(job_id, n, until) for n in nodes if n not in have]
        return (list(state.reservations), [*state.unavailable, *add], list(state.jobs)) if add else None

    ledger.update(change, f"hold node(s) {', '.join(nodes)} for job {job_id}")
    return free[0]


def keep_holding(ledger: ReservationLedger, job_id: str, until: float, slack: float = RENEW_SLACK_SECONDS) -> int:
    """Move the live marks held for `job_id` on to `until`, the lease its queue entry was just
    renewed to (the preemptor still waits: its place step's poll). How many it holds now (0: none,
    they lapsed or were let go).

    Why this is safe (module doc, "Renewal"): a mark is only ever extended, never brought back. The
    change reads the marks inside the ledger's compare-and-swap and moves only those still live
    then, so a mark that lapsed (another job may have booked the node since) or was let go (the
    preemptor placed, or its release ran) stays gone, whichever write comes first; and `until` is
    the entry's own lease, so no mark outlives the entry it keeps the room for. Marks are only
    written when one would lapse more than `slack` seconds before `until`: a waiter woken by every
    release does not write the ledger at every poll."""
    held = [0]      # in the last state read: the one the writes ended on

    def change(state):
        now = ledger.clock()
        mine = [u for u in state.unavailable if u.held_for == job_id and u.expires_at > now]
        held[0] = len(mine)
        if not any(u.expires_at < until - slack for u in mine):
            return None
        renewed = [replace(u, expires_at=until) if u.held_for == job_id and now < u.expires_at < until else u
                   for u in state.unavailable]
        return list(state.reservations), renewed, list(state.jobs)

    ledger.update(change, f"keep the nodes held for job {job_id} until its entry's lease")
    return held[0]


def let_go(ledger: ReservationLedger, job_id: str) -> None:
    """Drop the ledger's marks holding nodes for `job_id` (idempotent): it placed, or gave up preempting."""
    def change(state):
        if not any(u.held_for == job_id for u in state.unavailable):
            return None
        return list(state.reservations), [u for u in state.unavailable if u.held_for != job_id], list(state.jobs)

    ledger.update(change, f"let go of the nodes held for job {job_id}")


def preempt(kube: PodControl, ledger: ReservationLedger, queue: JobQueue, preemptor: Entry, victims: Sequence[str],
            holds: Mapping[str, Hold], state: QueueState, log: logging.Logger, now: float) -> list[Admitted]:
    """Steps 1 to 4 of the module doc for `victims` (named by the pass over `state`, whose `holds`
    are written with the preemption); the jobs requeued ([]: the queue moved since `state`, another
    preemptor holds the nodes, or the victims were requeued or ended meanwhile; nothing kept)."""
    hold = holds.get(preemptor.job_id)
    entries = {a.job_id: a.entry for a in state.running if a.entry is not None}
    why = {v: reason(preemptor, entries[v], hold, now) for v in victims if v in entries}
    lease = next((w.lease_until for w in state.waiting if w.entry.job_id == preemptor.job_id), now)
    taken = []
    if hold is None or keep_for(ledger, preemptor.job_id, hold.nodes, lease):
        taken = queue.preempt(preemptor, victims, why, holds, based_on=state)
    if not taken:
        let_go(ledger, preemptor.job_id)
        log.info("the preemption of %s for %s did not happen (the queue moved, another job is being given those "
                 "nodes, or they were requeued or ended meanwhile): deciding again", ", ".join(victims),
                 preemptor.name or preemptor.job_id)
        return []
    for victim in taken:
        pods = [p for p in kube.list_pods(f"{LABEL_JOB}={victim.job_id}")
                if (p.get("status") or {}).get("phase") not in TERMINATED_PHASES]
        left = delete_and_wait(kube, pods)
        dropped = drop_reservations(ledger, victim.job_id)
        name = victim.entry.name if victim.entry and victim.entry.name else victim.job_id
        log.warning("preempted job %s (%s, class %s, preemptible): deleted its pod(s) %s, gave back %d "
                    "reservation(s), requeued it with its first enqueue time; why: %s%s", name, victim.job_id,
                    victim.entry.priority_class if victim.entry else "?",
                    ", ".join(sorted(p["metadata"]["name"] for p in pods)) or "none (not launched yet)", dropped,
                    why.get(victim.job_id, ""), f"; still going: {', '.join(left)}" if left else "")
    return taken


def told(record: Preempted) -> str:
    """The victim's log line."""
    return (f"preempted by job {record.preemptor} at {utc(record.at)}: "
            f"{record.reason}. Requeued (not failed): waiting in the job queue with its first enqueue time, "
            "it runs again when it gets a place")

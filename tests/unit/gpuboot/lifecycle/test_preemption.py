"""Live preemption (gpuboot.lifecycle.preemption) on the in-memory fakes: the pass's victims are
requeued with their first enqueue time and a record saying by whom and why, their pods deleted and
their reservations given back, and the preemptor places at once; two preemptors never both take one
victim's place; a victim that ended meanwhile is left alone; nothing leaks."""
from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import LABEL_JOB, LABEL_TASK
from gpuboot.core.placement import Outcome
from gpuboot.core.queue import Hold, QueueConfig
from gpuboot.exceptions import CapacityBusy, JobPreempted
from gpuboot.lifecycle.booking import Booker, survey
from gpuboot.lifecycle.boot import JobBoot
from gpuboot.lifecycle.jobqueue import LEASE_SECONDS, JobQueue, book_in_order, entry_of, queue_view
from gpuboot.lifecycle.preemption import (
    delete_and_wait,
    drop_reservations,
    keep_for,
    keep_holding,
    let_go,
    preempt,
    running_jobs,
    told,
)
from tests.builders import pod
from tests.fakes import T4X2, Cloud, cloud

LOG = logging.getLogger("test-preemption")


def spec(name: str, gpus: int = 2, **more) -> JobSpec:
    return JobSpec.from_dict({"name": name, "image": "python:3.11", "command": ["true"], "gpus": gpus, "cpu": "1",
                              "memory": "1Gi", "boot_timeout_seconds": 300, **more})


LOW = {"priority_class": "low", "preemptible": True}


def turn(c: Cloud, name: str, job: JobSpec, enqueued_at: float | None = None):
    """The place step's turn for job `name`, with its own clients (as each worker has)."""
    booker = Booker(c.cluster, c.ecs, c.ledger(), LOG, clock=c.clock)
    queue = JobQueue(c.cluster, clock=c.clock)
    return book_in_order(booker, queue, job, name, QueueConfig(), lambda: booker.book(job, name),
                         c.clock() + 3600, enqueued_at)


def running(c: Cloud, name: str, job: JobSpec) -> None:
    """Place `name` and run its pods where it was placed (what launch does)."""
    placed = turn(c, name, job)
    assert placed.plan.outcome is Outcome.FITS, placed.plan.message
    for a in placed.plan.assignments:
        c.cluster.add_pod(pod(f"{name}-{a.task}", a.node, namespace=job.namespace,
                              requests={"nvidia.com/gpu": str(job.gpus), "cpu": job.cpu, "memory": job.memory},
                              labels={LABEL_JOB: name, LABEL_TASK: a.task}))


def reserved(c: Cloud, job_id: str) -> list:
    return [r for r in c.ledger().live(c.clock()) if r.job_id == job_id]


def test_a_high_job_preempts_a_low_preemptible_one_which_is_requeued_and_runs_again():
    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "low", spec("low", **LOW))
    enqueued = JobQueue(c.cluster).snapshot().running[0].entry.enqueued_at
    c.clock.advance(60)
    high = turn(c, "high", spec("high", priority_class="high"))
    assert high.plan.outcome is Outcome.FITS and [a.node for a in high.plan.assignments] == ["gpu2"]
    assert c.cluster.list_pods(f"{LABEL_JOB}=low") == [] and reserved(c, "low") == []
    state = JobQueue(c.cluster).snapshot()
    record = state.preempted_of("low")
    assert (record.by, record.enqueued_at) == ("high", enqueued)
    assert "priority class high outranks low" in record.reason and "gpu2" in record.reason
    assert "preempted by job high" in told(record) and "Requeued (not failed)" in told(record)
    (waiting,) = state.waiting
    assert (waiting.entry.job_id, waiting.entry.enqueued_at) == ("low", enqueued)    # its place in line kept
    assert [a.job_id for a in state.running] == ["high"]
    (row,) = queue_view(state, [], [], QueueConfig(), c.clock())            # the fleet page and /api/queue
    assert (row["job_id"], row["preempted_by"]) == ("low", "high") and "outranks low" in row["preempted_why"]
    # the victim's launch requeues it: it waits while the high job runs, then gets the node back
    again = turn(c, "low", spec("low", **LOW), record.enqueued_at)
    assert again.plan.outcome is Outcome.BUSY and "queue position 1 of 1" in again.line()
    c.ledger().release("high")
    JobQueue(c.cluster).drop("high")                       # the high job's release
    back = turn(c, "low", spec("low", **LOW), record.enqueued_at)
    assert back.plan.outcome is Outcome.FITS
    admitted = {a.job_id: a for a in JobQueue(c.cluster).snapshot().running}
    assert admitted["low"].entry.enqueued_at == enqueued


def test_only_preemptible_jobs_of_a_lower_class_are_preempted():
    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "normal", spec("normal", preemptible=True))          # the same class as the newcomer
    assert turn(c, "other", spec("other", priority_class="normal")).plan.outcome is Outcome.BUSY
    c2 = cloud({"gpu2": ("Running", T4X2)})
    running(c2, "fixed", spec("fixed", priority_class="low"))      # low, but not preemptible
    assert turn(c2, "high", spec("high", priority_class="high")).plan.outcome is Outcome.BUSY
    for each, victim in ((c, "normal"), (c2, "fixed")):
        assert len(each.cluster.list_pods(f"{LABEL_JOB}={victim}")) == 1 and reserved(each, victim)
        assert JobQueue(each.cluster).snapshot().preempted == ()


def test_two_preemptors_never_both_take_one_victims_place():
    """Eight high jobs at once, each with its own clients, polling until one of them runs, want the one
    node a low job runs on: the victim is preempted once, one high job gets the node, the others wait;
    the ledger never holds more GPUs on the node than it has, and no reservation of the victim is left."""
    for _ in range(5):
        c = cloud({"gpu2": ("Running", T4X2)})
        running(c, "low", spec("low", **LOW))
        results, errors = {}, []    # the job that preempted is the one that runs on the freed node
        start = threading.Barrier(8)

        def preemptor(i: int) -> None:
            try:
                start.wait()
                for _poll in range(10):      # each poll of a waiting place step, until one of them runs
                    results[i] = turn(c, f"high-{i}", spec(f"high-{i}", priority_class="high"))
                    if any(r.plan.outcome is Outcome.FITS for r in results.values()):
                        return
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=preemptor, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        fits = [i for i, r in results.items() if r.plan.outcome is Outcome.FITS]
        assert len(fits) == 1, {i: r.plan.message for i, r in results.items()}
        assert sum(r.resources.gpus for r in c.ledger().live(c.clock()) if r.node == "gpu2") == 2
        state = JobQueue(c.cluster).snapshot()
        assert [(p.job_id, p.by) for p in state.preempted] == [("low", f"high-{fits[0]}")]   # the job that got it
        assert reserved(c, "low") == [] and c.cluster.list_pods(f"{LABEL_JOB}=low") == []
        assert not [u for u in c.ledger().live_unavailable(c.clock()) if u.held_for]   # let go once it placed


def test_a_preemption_that_lost_the_race_writes_nothing():
    """The compare-and-swap: a second preemptor's write, interleaved with the first, finds the victim
    no longer admitted and writes nothing; a victim released on its own is never preempted."""
    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "low", spec("low", **LOW))
    queue = JobQueue(c.cluster, clock=c.clock)
    first, second = (entry_of(spec(n, priority_class="high"), n, c.clock()) for n in ("h1", "h2"))
    won = []
    c.cluster.before_next_write(lambda: won.extend(queue.preempt(first, ["low"], {"low": "first"})))
    assert queue.preempt(second, ["low"], {"low": "second"}) == []      # its write conflicted, then found it gone
    assert [a.job_id for a in won] == ["low"]
    assert JobQueue(c.cluster).snapshot().preempted_of("low").by == "h1"
    c2 = cloud({"gpu2": ("Running", T4X2)})
    running(c2, "low", spec("low", **LOW))
    JobQueue(c2.cluster).drop("low")                                    # it finished: its release ran
    assert JobQueue(c2.cluster, clock=c2.clock).preempt(first, ["low"], {}) == []
    assert JobQueue(c2.cluster).snapshot().preempted == ()


def test_the_victims_release_drops_its_entry_and_record_and_settling_forgets_only_the_record_seen():
    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "low", spec("low", **LOW))
    turn(c, "high", spec("high", priority_class="high"))
    queue = JobQueue(c.cluster)
    record = queue.snapshot().preempted_of("low")
    queue.settle(dataclasses.replace(record, at=record.at - 1))      # an older preemption: this one is kept
    assert queue.snapshot().preempted_of("low") == record
    queue.settle(record)
    assert queue.snapshot().preempted == ()
    c2 = cloud({"gpu2": ("Running", T4X2)})
    running(c2, "low", spec("low", **LOW))
    turn(c2, "high", spec("high", priority_class="high"))
    JobQueue(c2.cluster).drop("low")                                 # the victim's run ended (its release)
    state = JobQueue(c2.cluster).snapshot()
    assert state.preempted == () and [w.entry.job_id for w in state.waiting] == []


def test_dropping_a_victims_reservations_keeps_its_job_record_and_is_idempotent():
    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "low", spec("low", **LOW))
    c.ledger().record_starts("low", [], c.clock() + 600)
    assert drop_reservations(c.ledger(), "low") == 1
    assert drop_reservations(c.ledger(), "low") == 0
    assert reserved(c, "low") == [] and c.ledger().snapshot().record("low", c.clock()) is not None


def test_running_jobs_are_the_admitted_jobs_live_pods():
    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "low", spec("low", team="vision", **LOW))
    c.cluster.add_pod(pod("stranger", "gpu2", labels={LABEL_JOB: "not-admitted"}))
    state = JobQueue(c.cluster).snapshot()
    (one,) = running_jobs(state, c.cluster.list_active_pods(), c.clock())
    assert (one.job_id, one.node, one.priority_class, one.preemptible) == ("low", "gpu2", "low", True)
    assert one.team == "vision"             # whose waits its requeue would add to (queue.choose_room)


def test_a_preemptor_dying_after_its_queue_write_leaks_nothing():
    """The record is written first: the victim's launch still requeues and gives back its own
    reservations (what its requeue does), and the dead preemptor's entry and hold end with its lease."""
    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "low", spec("low", **LOW))
    queue = JobQueue(c.cluster, clock=c.clock)
    dead = entry_of(spec("high", priority_class="high"), "high", c.clock())
    queue.enqueue(dead)
    assert [a.job_id for a in queue.preempt(dead, ["low"], {"low": "why"})] == ["low"]   # then it died
    record = queue.snapshot().preempted_of("low")
    assert record.by == "high" and reserved(c, "low")                   # its pods and reservation not touched
    c.cluster.pods.clear()                                              # the victim's launch deletes its gang
    assert drop_reservations(c.ledger(), "low") == 1                    # and gives back what it held
    c.clock.advance(LEASE_SECONDS + 1)                                  # the preemptor's lease runs out
    back = turn(c, "low", spec("low", **LOW), record.enqueued_at)
    assert back.plan.outcome is Outcome.FITS
    assert sum(r.resources.gpus for r in c.ledger().live(c.clock())) == 2


def preempted_for(c: Cloud, name: str, at: float) -> None:
    """Job `name` (high, enqueued at `at`) preempts "low" on gpu2 and stops there (steps 1 to 3, not 4)."""
    queue = JobQueue(c.cluster, clock=c.clock)
    state = queue.enqueue(entry_of(spec(name, priority_class="high"), name, at))
    (mine,) = [e for e in state.live(c.clock()) if e.job_id == name]
    holds = {name: Hold(name, ("gpu2",), None, c.clock())}
    assert [a.job_id for a in preempt(c.cluster, c.ledger(), queue, mine, ["low"], holds, state, LOG, c.clock())] \
        == ["low"]


def test_the_room_freed_goes_to_the_job_that_preempted_not_to_one_ahead_of_it_nor_to_a_stale_placement():
    """Between the preemption and the preemptor's placement: a job of the same class enqueued before it
    (ahead of it in the queue), a placement that never looks at the queue (what a place step that read
    the queue before the preemption does), and a job behind it (whose pass finds the preemptor would fit
    and must not give the hold away) all find gpu2 held for the preemptor (its firm hold, and the
    ledger's mark in the shard its reservations go to); the preemptor then places there and lets go."""
    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "low", spec("low", **LOW))
    c.clock.advance(60)
    preempted_for(c, "late", c.clock())
    state = JobQueue(c.cluster).snapshot()
    assert [(h.job_id, h.firm) for h in state.holds] == [("late", True)] and reserved(c, "low") == []
    early = turn(c, "early", spec("early", priority_class="high"), enqueued_at=c.clock() - 30)
    assert early.plan.outcome is Outcome.BUSY and "held for job late" in early.plan.message
    stale = Booker(c.cluster, c.ecs, c.ledger(), LOG, clock=c.clock).book(spec("stale"), "stale")
    assert stale.plan.outcome is Outcome.BUSY and "held for job late" in stale.plan.message
    c.clock.advance(1)
    behind = turn(c, "behind", spec("behind", priority_class="high"))   # its pass finds "late" would fit there
    assert behind.plan.outcome is Outcome.BUSY and [h.job_id for h in JobQueue(c.cluster).snapshot().holds] == ["late"]
    late = turn(c, "late", spec("late", priority_class="high"))
    assert late.plan.outcome is Outcome.FITS and [a.node for a in late.plan.assignments] == ["gpu2"]
    assert [u for u in c.ledger().live_unavailable(c.clock()) if u.held_for] == []
    assert JobQueue(c.cluster).snapshot().holds == ()
    assert sum(r.resources.gpus for r in c.ledger().live(c.clock())) == 2


def test_a_preemptor_dying_before_it_placed_keeps_the_room_only_until_its_entry_lapses():
    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "low", spec("low", **LOW))
    preempted_for(c, "dead", c.clock())                                   # then it died
    assert turn(c, "other", spec("other", priority_class="high")).plan.outcome is Outcome.BUSY
    c.clock.advance(LEASE_SECONDS + 1)                                  # its entry lapses, its marks expire
    assert turn(c, "other", spec("other", priority_class="high")).plan.outcome is Outcome.FITS
    state = JobQueue(c.cluster).snapshot()
    assert [a.job_id for a in state.running] == ["other"] and state.holds == ()
    assert [r.job_id for r in c.ledger().live(c.clock())] == ["other"]


def test_nodes_held_for_one_preemptor_are_not_held_for_another():
    c = cloud({"gpu2": ("Running", T4X2)})
    until = c.clock() + 60
    assert keep_for(c.ledger(), "a", ["gpu2"], until) and keep_for(c.ledger(), "a", ["gpu2"], until)   # idempotent
    assert not keep_for(c.ledger(), "b", ["gpu2"], until)
    assert [(u.node, u.held_for) for u in c.ledger().live_unavailable(c.clock())] == [("gpu2", "a")]


def boot_of(c: Cloud, name: str, job: JobSpec, **kwargs) -> JobBoot:
    return JobBoot(c.cluster, c.ecs, c.ledger(), LOG, spec=job, job_id=name, clock=c.clock, **kwargs)


@pytest.mark.parametrize("status", ["Running", "Stopped"])
def test_a_victim_with_no_pod_yet_is_preempted_and_its_start_or_wait_step_books_nothing_around_the_queue(status):
    """Admitted, its node up (its wait step) or booting (its start step), no pod yet: it holds the
    capacity a high job needs, so it is preempted (nothing to delete, its reservation given back); its
    start or wait step then re-places nothing (JobPreempted: it hands the job to launch, which
    requeues it); the requeue's own bring-up, carrying that record, goes on."""
    c = cloud({"gpu2": (status, T4X2)})
    low = spec("low", **LOW)
    placed = turn(c, "low", low)
    assert placed.plan.outcome is Outcome.FITS
    up = boot_of(c, "low", low).ensure_up(placed.plan)            # its start step: the node boots (or is up)
    assert [b["node"] for b in up.baselines] == ["gpu2"] and c.cluster.list_pods(f"{LABEL_JOB}=low") == []
    (row,) = running_jobs(JobQueue(c.cluster).snapshot(), c.cluster.list_active_pods(), c.clock(),
                          c.ledger().snapshot().reservations)
    assert (row.job_id, row.node, row.started_at, row.expected_runtime) == ("low", "gpu2", c.clock(), None)
    c.clock.advance(5)
    high = turn(c, "high", spec("high", priority_class="high"))
    assert high.plan.outcome is Outcome.FITS and [a.node for a in high.plan.assignments] == ["gpu2"]
    record = JobQueue(c.cluster).snapshot().preempted_of("low")
    assert record.by == "high" and reserved(c, "low") == []
    with pytest.raises(JobPreempted, match="preempted by job high"):   # its wait step (or a start retry)
        boot_of(c, "low", low).ensure_up(placed.plan, [], up.baselines)
    assert reserved(c, "low") == [] and [r.job_id for r in c.ledger().live(c.clock())] == ["high"]
    boot_of(c, "low", low, handling=record).not_preempted()           # the requeue's bring-up goes on
    c.ledger().release("high")
    JobQueue(c.cluster).drop("high")                                 # the high job's release
    assert turn(c, "low", low, record.enqueued_at).plan.outcome is Outcome.FITS    # its requeue placed it again
    # admitted and reserved, but its record is not settled yet (no pod): no victim of another preemption
    assert running_jobs(JobQueue(c.cluster).snapshot(), [], c.clock(), c.ledger().snapshot().reservations) == []


class Lingering:
    """A pod that is still there for `reads` reads after its deletion (its kubelet confirming the end)."""

    def __init__(self, reads: int):
        self.reads, self.deleted = reads, []

    def delete_pod(self, namespace, name, grace_seconds=None):
        self.deleted.append((name, grace_seconds))

    def read_pod(self, namespace, name):
        self.reads -= 1
        return {"metadata": {"name": name}} if self.reads >= 0 else None


def test_a_deleted_pod_is_seen_gone_soon_the_reads_backing_off_from_50_ms_to_the_poll():
    pods = [{"metadata": {"namespace": "gpu-jobs", "name": "p"}}]
    slept: list[float] = []
    kube = Lingering(reads=6)
    assert delete_and_wait(kube, pods, poll_seconds=1.0, sleep=slept.append) == []
    assert slept == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0] and kube.deleted == [("p", None)]


def interleave(c: Cloud, when, action) -> list:
    """Run `action` once, just before the first ConfigMap write at which `when()` holds (the fake
    applies writes one at a time: a step of another actor, placed exactly there); its outcome."""
    done: list = []

    def run() -> None:
        done.append(None)
        try:
            done[0] = action()
        except (JobPreempted, CapacityBusy) as exc:
            done[0] = exc
    c.cluster.before_write_when(when, run)
    return done


@pytest.mark.parametrize("moment", ["victim between its check and its commit", "between the record and the drop",
                                    "between the drop and the preemptor's placement"])
def test_a_victims_start_step_re_placing_at_any_moment_of_its_preemption_never_keeps_the_place(moment):
    """The victim (admitted, no pod) re-places in its start step (`JobBoot.ensure_up`) at each moment of
    a high job's preemption of it. Whichever way, the ledger never holds more than the node's 2 GPUs,
    and once the victim's launch has done its part (given back what it holds while its record stands)
    the high job has the node; a step that found its reservation gone raised JobPreempted."""
    c = cloud({"gpu2": ("Running", T4X2)})
    low = spec("low", **LOW)
    placed = turn(c, "low", low)

    def state() -> tuple[bool, bool]:
        return JobQueue(c.cluster).snapshot().preempted_of("low") is not None, bool(reserved(c, "low"))

    def high_turn():
        return turn(c, "high", spec("high", priority_class="high"))

    if moment.startswith("victim"):
        done = interleave(c, lambda: True, high_turn)                # the preemptor, wholly, inside the victim's step
        with pytest.raises(CapacityBusy):                            # its commit conflicts: then the node is taken
            boot_of(c, "low", low).ensure_up(dataclasses.replace(placed.plan, assignments=()))
        assert done[0].plan.outcome is Outcome.FITS
    else:
        when = (lambda: state() == (True, True)) if "record and the drop" in moment else \
            (lambda: state() == (True, False) and not reserved(c, "high"))
        done = interleave(c, when, lambda: boot_of(c, "low", low).ensure_up(placed.plan))
        high_turn()
        if "drop and" in moment:
            assert isinstance(done[0], JobPreempted)                  # it found its reservation gone: booked nothing
        else:
            assert done[0].plan.job_id == "low"                       # still held: nothing to re-place
    assert sum(r.resources.gpus for r in c.ledger().live(c.clock()) if r.node == "gpu2") <= 2
    assert JobQueue(c.cluster).snapshot().preempted_of("low") is not None
    drop_reservations(c.ledger(), "low")                              # the victim's launch, seeing its record
    high = turn(c, "high", spec("high", priority_class="high"))
    assert high.plan.outcome is Outcome.FITS, high.plan.message
    assert sorted(r.job_id for r in c.ledger().live(c.clock())) == ["high"]


# -- the preemptor still waiting: its ledger marks live as long as its queue entry -----------------
STRAY = 1      # GPUs of gpu2 a pod that is not the queue's keeps: the preemptor (2 GPUs) cannot place yet


def waiting_preemptor(c: Cloud) -> None:
    """"late" preempted "low" on gpu2 (steps 0 to 3) but cannot place yet: a stray pod keeps one GPU."""
    running(c, "low", spec("low", **LOW))
    preempted_for(c, "late", c.clock())
    c.cluster.add_pod(pod("stray", "gpu2", requests={"nvidia.com/gpu": str(STRAY)}))


def marks_for(c: Cloud, job_id: str) -> list:
    return [u for u in c.ledger().live_unavailable(c.clock()) if u.held_for == job_id]


def lease_of(c: Cloud, job_id: str) -> float | None:
    return next((w.lease_until for w in JobQueue(c.cluster).snapshot().waiting if w.entry.job_id == job_id), None)


def promised(c: Cloud) -> dict[str, int]:
    """GPUs promised per node: live reservations plus the stray pod's."""
    out = {"gpu2": STRAY if c.cluster.list_pods("") and any(
        p["metadata"]["name"] == "stray" for p in c.cluster.list_active_pods()) else 0}
    for r in c.ledger().live(c.clock()):
        out[r.node] = out.get(r.node, 0) + r.resources.gpus
    return out


def round_at_once(c: Cloud, actors: list) -> list:
    """Run every actor at once (a barrier, then each in its own thread); their results, or errors raised."""
    start, results = threading.Barrier(len(actors)), [None] * len(actors)

    def run(i: int) -> None:
        start.wait()
        results[i] = actors[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(actors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


def others(c: Cloud, poll: int, count: int = 4) -> list:
    """`count` 1-GPU placements that fit on gpu2's free GPU but for the marks: half through the queue
    (a place step's turn), half through the batch path (which never reads the queue)."""
    def queued(name: str):
        return lambda: turn(c, name, spec(name, gpus=1))

    def batch(name: str):
        return lambda: Booker(c.cluster, c.ecs, c.ledger(), LOG, clock=c.clock).book(spec(name, gpus=1), name)

    return [(queued if i % 2 else batch)(f"other-{poll}-{i}") for i in range(count)]


def test_the_preemptors_marks_are_renewed_while_it_waits_and_let_go_when_it_places():
    """The preemptor polls for five leases (its place step's turn every 30 s) while, at each poll,
    four other 1-GPU jobs try to place at once (half through the queue, half through the batch path
    that never reads it) on the free GPU of gpu2: none gets it, whenever they run against the
    renewal; its marks never outlive its entry; the ledger never promises more GPUs than a node has.
    Then the room frees and the preemptor places there: no mark is left."""
    for _ in range(3):
        c = cloud({"gpu2": ("Running", T4X2)})
        waiting_preemptor(c)
        for poll in range(int(5 * LEASE_SECONDS / 30)):
            c.clock.advance(30)
            late, *rest = round_at_once(c, [lambda: turn(c, "late", spec("late", priority_class="high")),
                                            *others(c, poll)])
            assert late.plan.outcome is Outcome.BUSY
            assert all(getattr(r, "plan", r).outcome is Outcome.BUSY for r in rest)
            assert [u.node for u in marks_for(c, "late")] == ["gpu2"]
            assert all(u.expires_at <= lease_of(c, "late") for u in marks_for(c, "late"))
            assert promised(c)["gpu2"] <= 2 and [r.job_id for r in c.ledger().live(c.clock())] == []
        c.cluster.pods[:] = [p for p in c.cluster.pods if p["metadata"]["name"] != "stray"]   # the room frees
        c.clock.advance(30)
        late, *rest = round_at_once(c, [lambda: turn(c, "late", spec("late", priority_class="high")),
                                        *others(c, "last")])
        assert late.plan.outcome is Outcome.FITS and [a.node for a in late.plan.assignments] == ["gpu2"]
        assert marks_for(c, "late") == [] and promised(c)["gpu2"] == 2
        assert [r.job_id for r in c.ledger().live(c.clock())] == ["late"]


def test_a_waiting_preemptor_shows_its_firm_hold_in_its_log_line_the_queue_table_and_the_fleets_marks():
    """Issue 32 #5 for preemption: the preemptor's line and its queue row say which nodes it holds and
    that the hold is firm; the job blocked by it names it; the ledger's mark says for whom, until when."""
    c = cloud({"gpu2": ("Running", T4X2)})
    waiting_preemptor(c)
    c.clock.advance(60)
    late = turn(c, "late", spec("late", priority_class="high"))
    assert "holds node(s) gpu2, firm: it preempted there, kept for it alone until it places" in late.line(c.clock())
    early = turn(c, "early", spec("early", gpus=1), enqueued_at=c.clock() - 600)
    assert "held for job late" in early.line(c.clock())
    ledger = c.ledger().snapshot()
    live = [r for r in ledger.reservations if r.expires_at > c.clock()]      # as the fleet page reads them
    seen = survey(c.cluster, c.ecs, live, c.clock())
    rows = {r["job_id"]: r for r in queue_view(JobQueue(c.cluster).snapshot(), seen.views,
                                              ledger.live_unavailable(c.clock()), QueueConfig(), c.clock(),
                                              seen.pods, live)}
    assert (rows["late"]["held_nodes"], rows["late"]["hold_firm"]) == (["gpu2"], True)
    assert rows["early"]["blocked_by"] == "hold" and "held for job late" in rows["early"]["blocker"]
    assert (rows["early"]["held_nodes"], rows["early"]["hold_firm"], rows["early"]["hold_due"]) == ([], False, None)
    (mark,) = marks_for(c, "late")
    assert (mark.node, mark.reason, mark.expires_at) == ("gpu2", "held for job late", lease_of(c, "late"))


def test_the_marks_of_a_preemptor_that_stops_polling_lapse_with_its_entry_and_are_never_brought_back():
    c = cloud({"gpu2": ("Running", T4X2)})
    waiting_preemptor(c)
    c.clock.advance(60)
    assert turn(c, "late", spec("late", priority_class="high")).plan.outcome is Outcome.BUSY   # renews
    lease = lease_of(c, "late")
    assert [u.expires_at for u in marks_for(c, "late")] == [lease]
    c.clock.advance(LEASE_SECONDS - 1)                                 # its place step died after that poll
    assert marks_for(c, "late") and Booker(c.cluster, c.ecs, c.ledger(), LOG, clock=c.clock).book(
        spec("early", gpus=1), "early").plan.outcome is Outcome.BUSY
    c.clock.advance(2)                                                 # the entry lapses, its marks with it
    assert marks_for(c, "late") == [] and lease_of(c, "late") is not None and lease_of(c, "late") < c.clock()
    assert keep_holding(c.ledger(), "late", c.clock() + LEASE_SECONDS) == 0       # a stale renewal: nothing
    assert marks_for(c, "late") == []
    assert turn(c, "other", spec("other", gpus=1)).plan.outcome is Outcome.FITS  # the free GPU is anyone's now


def test_a_renewal_racing_the_let_go_never_brings_a_mark_back():
    """The compare-and-swap: a renewal whose write comes after a let-go (the preemptor placed, or its
    release ran) finds no live mark and writes nothing; one before it is undone by it."""
    c = cloud({"gpu2": ("Running", T4X2)})
    waiting_preemptor(c)
    c.clock.advance(60)
    c.cluster.before_next_write(lambda: let_go(c.ledger(), "late"))
    assert keep_holding(c.ledger(), "late", c.clock() + LEASE_SECONDS) == 0 and marks_for(c, "late") == []
    c2 = cloud({"gpu2": ("Running", T4X2)})
    waiting_preemptor(c2)
    c2.clock.advance(60)
    writes = c2.cluster.writes
    assert keep_holding(c2.ledger(), "late", c2.clock() + LEASE_SECONDS) == 1
    assert [u.expires_at for u in marks_for(c2, "late")] == [c2.clock() + LEASE_SECONDS]
    assert c2.cluster.writes == writes + 1
    assert keep_holding(c2.ledger(), "late", c2.clock() + LEASE_SECONDS + 20) == 1   # within the slack: no write
    assert c2.cluster.writes == writes + 1
    let_go(c2.ledger(), "late")
    assert marks_for(c2, "late") == []


def test_the_release_of_a_preemptor_that_never_placed_lets_its_marks_go(monkeypatch):
    """Its run ended (cancelled, or timed out waiting): the queue says it held firm, release lets go
    at once rather than keeping the room for nobody until the lease ends."""
    from airflow.sdk.exceptions import AirflowFailException

    from gpuboot.operators.release import ReleaseReservationOperator
    from tests.builders import step_context

    c = cloud({"gpu2": ("Running", T4X2)})
    waiting_preemptor(c)
    step = ReleaseReservationOperator(task_id="release", job_id="late")
    monkeypatch.setattr(step, "kube", lambda: c.cluster)
    monkeypatch.setattr(step, "ecs", lambda: c.ecs)
    with pytest.raises(AirflowFailException, match="did not run to completion"):
        step.execute(step_context())
    assert marks_for(c, "late") == [] and lease_of(c, "late") is None
    assert JobQueue(c.cluster).drop("late") is False                  # idempotent, nothing firm left

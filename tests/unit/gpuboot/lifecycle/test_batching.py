"""Group commit (gpuboot.lifecycle.batching) on the in-memory fakes: first placements queue in the ledger,
one leader reads the cluster once and commits every waiting job in one write. The ledger is the
real one on the fake ConfigMap; tests/stress/test_burst.py runs the place step itself in a
burst on the local cloud."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import Reservation, Unavailable
from gpuboot.core.placement import JobRequest, Outcome, Plan
from gpuboot.core.resources import Resources
from gpuboot.lifecycle.batching import (
    ANSWER_ROWS,
    LEASE_SECONDS,
    POLL_CROWD,
    POLL_SECONDS,
    PROGRESS_WAIT_SECONDS,
    BatchPlacer,
    answer_rows,
    book_first,
    compact,
    still_valid,
)
from gpuboot.lifecycle.booking import Booker, reservation_ttl
from gpuboot.lifecycle.ledger import (
    ANSWER_KEEP_SECONDS,
    CONFIGMAP,
    LEAD_EVERYWHERE_SECONDS,
    LEAD_KEY,
    MAX_LEDGER_BYTES,
    Batch,
    Decided,
    Lead,
    LedgerFull,
    Queued,
    RequestQueue,
    StartedNode,
)
from tests.fakes import T4, Cloud, cloud

LOG = logging.getLogger("test-batching")


def spec(name: str = "train", gpus: int = 1, replicas: int = 1) -> JobSpec:
    return JobSpec.from_dict({"name": name, "image": "python:3.11", "command": ["true"], "gpus": gpus, "cpu": "1",
                              "memory": "1Gi", "replicas": replicas, "boot_timeout_seconds": 300})


def booker(c: Cloud, **kwargs) -> Booker:
    kwargs.setdefault("sleep", lambda s: time.sleep(min(s, 0.05)))     # real, short: threads must interleave
    return Booker(c.cluster, c.ecs, c.ledger(), LOG, clock=c.clock, monotonic=c.clock, **kwargs)


def held(c: Cloud) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in c.ledger().snapshot().reservations:
        out.setdefault(r.job_id, []).append(r.node)
    return {k: sorted(v) for k, v in out.items()}


def ghost(c: Cloud, job: str, lease_for: float | None) -> None:
    """A placer that queued `job` and (with `lease_for`) took the lease, then died."""
    ledger = c.ledger()
    RequestQueue(c.cluster, clock=c.clock).add(
        Queued(job, f"{job}:dead", spec(job).to_job_request(job).to_json(), 1200.0, c.clock() + 60))
    if lease_for:
        state = ledger.snapshot()
        ledger._write(list(state.reservations), state.unavailable, state, state.jobs,
                      batch=Batch(state.batch.decided, f"{job}:dead", c.clock() + lease_for))


def at_once(jobs: list[str], bookers: dict[str, Booker], barrier: threading.Barrier) -> dict[str, Outcome]:
    """`book_first` for each job in a thread of its own, all released together by `barrier`: their outcomes."""
    def run(job: str) -> Outcome:
        barrier.wait()
        return book_first(bookers[job], spec(job), job).plan.outcome

    with ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(jobs, pool.map(run, jobs)))


def queued(c: Cloud) -> list[str]:
    return [q.job_id for q in RequestQueue(c.cluster, clock=c.clock).waiting()]


def test_a_first_placement_goes_through_a_batch_of_one_and_leaves_no_queue_or_lease():
    c = cloud()
    b = booker(c)
    booking = book_first(b, spec(), "job")
    assert booking.committed and booking.plan.outcome == Outcome.FITS
    assert held(c) == {"job": ["gpu-run"]} and b.full_reads == 1
    batch = c.ledger().snapshot().batch
    assert batch.leader is None and [d.job_id for d in batch.decided] == ["job"]


@pytest.mark.parametrize("cache_behind", [False, True], ids=["shards-read-as-written", "shards-read-behind"])
def test_a_burst_is_placed_from_few_cluster_reads_and_never_promises_a_gpu_twice(cache_behind):
    """24 one-GPU jobs at once for the fleet's 4 GPUs: 4 fit, 20 are told busy; far fewer surveys than jobs.
    The queue shards are read from the API server's watch cache: read behind each write once (an entry
    not there yet, an answered one still there, an answer not copied yet), the burst is placed the same."""
    c = cloud()
    c.cluster.cache_behind = cache_behind
    jobs = [f"job-{i:02d}" for i in range(24)]
    barrier = threading.Barrier(len(jobs))
    bookers = {j: booker(c) for j in jobs}

    outcomes = at_once(jobs, bookers, barrier)
    assert Counter(outcomes.values()) == {Outcome.FITS: 4, Outcome.BUSY: 20}
    state = c.ledger().snapshot()
    assert sorted(r.job_id for r in state.reservations) == sorted(j for j, o in outcomes.items() if o == Outcome.FITS)
    assert Counter(r.node for r in state.reservations) == {"gpu-run": 1, "gpu-stop": 1, "gpu2-stop": 2}
    reads = sum(b.full_reads for b in bookers.values())
    assert reads <= len(jobs) // 3, f"{reads} cluster reads for {len(jobs)} placements"
    assert state.batch.leader is None
    assert set(queued(c)) <= {d.job_id for d in state.batch.decided}     # what is left there was answered


def test_a_gang_in_a_batch_is_placed_whole_or_not_at_all():
    c = cloud()
    assert book_first(booker(c), spec("one"), "one").plan.outcome == Outcome.FITS       # takes gpu-run
    gang = book_first(booker(c), spec("gang", replicas=3), "gang")
    assert gang.plan.outcome == Outcome.FITS and sorted(held(c)["gang"]) == ["gpu-stop", "gpu2-stop", "gpu2-stop"]
    too_big = book_first(booker(c), spec("big", replicas=2), "big")
    assert too_big.plan.outcome == Outcome.BUSY and "big" not in held(c)


def test_a_dead_leaders_queue_is_taken_over_once_its_lease_expires():
    c = cloud()
    ghost(c, "ghost", lease_for=LEASE_SECONDS)
    b = booker(c, sleep=c.clock.advance)       # waiting moves the fake clock: the lease runs out
    booking = book_first(b, spec(), "job")
    assert booking.plan.outcome == Outcome.FITS
    assert sorted(held(c)) == ["ghost", "job"]     # the dead placer's request was decided too
    assert c.clock() - 1_800_000_000.0 >= LEASE_SECONDS
    assert c.ledger().snapshot().batch.leader is None


def test_twenty_waiters_taking_a_free_lease_at_once_one_wins_with_one_write_each_and_no_shard_read():
    """The lease is one compare-and-swap of the root (ReservationLedger.put_batch): of twenty waiters that
    read the same free lease, exactly one holds it; each wrote the root once, read no shard, wrote no shard,
    and the reservations are as they were."""
    c = cloud()
    assert book_first(booker(c), spec("one"), "one").plan.outcome == Outcome.FITS     # a reservation to keep
    before = c.ledger().snapshot().reservations
    states = [c.ledger().snapshot() for _ in range(20)]     # every waiter read the ledger: no leader
    assert all(s.batch.led_by(c.clock()) is None for s in states)
    reads, writes, lock = Counter(), Counter(), threading.Lock()
    read, replace_ = c.cluster.read_configmap, c.cluster.replace_configmap

    def counted_read(namespace, name):
        with lock:
            reads[name] += 1
        return read(namespace, name)

    def counted_replace(namespace, body):
        with lock:
            writes[body["metadata"]["name"]] += 1
        return replace_(namespace, body)
    c.cluster.read_configmap, c.cluster.replace_configmap = counted_read, counted_replace
    go = threading.Barrier(20)

    def take(i: int) -> bool:
        go.wait()
        return BatchPlacer(booker(c), spec())._take_lease(states[i], f"waiter-{i}")
    with ThreadPoolExecutor(20) as pool:
        won = list(pool.map(take, range(20)))
    assert won.count(True) == 1
    assert writes == Counter({CONFIGMAP: 20}) and reads == Counter()     # one try each, the root only, no read
    state = c.ledger().snapshot()
    assert state.batch.led_by(c.clock()) == f"waiter-{won.index(True)}"
    assert state.reservations == before


def test_a_waiter_no_batch_answers_withdraws_its_request_and_places_itself():
    """A leader that holds the lease and never decides: the waiter waits on it (a live lease is a live
    leader, whose first batch on a large fleet can take longer than the waiter's own budget) for
    PROGRESS_WAIT_SECONDS at most, then places itself."""
    c = cloud()
    ghost(c, "ghost", lease_for=10_000)
    b = booker(c, sleep=c.clock.advance, contended_seconds=20)
    start = c.clock()
    booking = book_first(b, spec(), "job")
    assert PROGRESS_WAIT_SECONDS <= c.clock() - start < PROGRESS_WAIT_SECONDS + 20
    assert booking.committed and booking.plan.outcome == Outcome.FITS and b.full_reads == 1
    assert "job" not in queued(c) and held(c) == {"job": ["gpu-run"]}
    assert c.ledger().snapshot().batch.answer("job") is None          # placed on the single path


def test_a_batch_write_that_meets_a_release_keeps_its_plans_without_reading_again():
    """Another job's reservation is released between the leader's read and its write: the write is
    refused, the plans still hold (capacity only grew) and go in at the next try, from the same survey."""
    c = cloud()
    book_first(booker(c), spec("other"), "other")             # holds gpu-run
    b = booker(c)
    placer = BatchPlacer(b, spec())
    original, releases = placer._commit, []

    def commit_after_a_release(*args, **kwargs):
        if not releases:
            releases.append(c.ledger().release("other"))
        return original(*args, **kwargs)

    placer._commit = commit_after_a_release
    booking = placer.wait_for_batch(spec().to_job_request("job"), reservation_ttl(spec()))
    assert booking.plan.outcome == Outcome.FITS and b.full_reads == 1 and releases
    assert held(c) == {"job": ["gpu-stop"]}     # placed while gpu-run still counted as reserved


def test_plans_hold_only_while_the_ledger_just_lost_reservations_or_gained_requests():
    c = cloud()
    ledger = c.ledger()
    gpu = Resources.parse({"nvidia.com/gpu": 1})
    r = Reservation(job_id="a", task="t", node="gpu-run", resources=gpu, expires_at=c.clock() + 600)
    empty = ledger.snapshot()
    ledger._write([r], [], empty, [])
    with_r = ledger.snapshot()
    assert not still_valid(empty, with_r, (), c.clock())               # a new promise: place again
    mark = Unavailable(reason="NoStock", expires_at=c.clock() + 600, node="gpu-stop")
    ledger._write([r], [mark], with_r, [])
    marked = ledger.snapshot()
    assert not still_valid(with_r, marked, (), c.clock())              # a new mark: place again
    ledger.release("a")
    assert still_valid(marked, ledger.snapshot(), (), c.clock())       # a release of what was counted: still valid


def test_plans_do_not_hold_over_a_promise_made_and_released_meanwhile():
    """Between the read the plans were made from and the conflict, another job reserved gpu-run and
    released it (its pod bound there: the release of a launched job). The live reservations look the
    same as before, but gpu-run is taken by a pod the plans never counted: place again. (The burst
    stress test saw it: a batch put two jobs on a 2-GPU node one GPU of which a new pod held.)"""
    c = cloud()
    ledger = c.ledger()
    book_first(booker(c), spec("one"), "one")       # the ledger exists, with its shards
    before = ledger.snapshot()
    assert before.reservations                      # its shards read now, as a leader's are when it places
    r = Reservation(job_id="quick", task="t", node="gpu-run", resources=Resources.parse({"nvidia.com/gpu": 1}),
                    expires_at=c.clock() + 600)
    ledger.commit("quick", [r], ledger.snapshot().version)
    ledger.release("quick")
    after = ledger.snapshot()
    assert {x.job_id for x in after.reservations if x.expires_at > c.clock()} <= \
        {x.job_id for x in before.reservations if x.expires_at > c.clock()}
    assert not still_valid(before, after, (), c.clock())


def test_a_job_with_a_record_is_re_placed_on_the_single_path_not_batched():
    c = cloud()
    ledger = c.ledger()
    ledger.record_starts("job", [StartedNode("gpu-stop", "i-gpu-stop", c.clock())], c.clock() + 600)
    b = booker(c)
    booking = book_first(b, spec(), "job")
    assert booking.committed and c.ledger().snapshot().batch.decided == ()


def test_other_ledger_writes_keep_the_lease_and_the_answers():
    c = cloud({"gpu-run": ("Running", T4)})
    ghost(c, "waiting", lease_for=30)
    c.ledger().release("someone-else")
    c.ledger().record_starts("other", [StartedNode("gpu-run", "i-gpu-run", c.clock())], c.clock() + 600)
    assert c.ledger().snapshot().batch.leader == "waiting:dead" and queued(c) == ["waiting"]


def test_the_largest_burst_answered_at_once_stays_far_below_the_limit_and_a_bigger_one_is_refused():
    """200 answers waiting in the ledger at once next to their 200 reservations (the bench's largest
    burst at its worst moment), with a realistic answer; 20x that is refused by name."""
    c = cloud()
    book_first(booker(c), spec("first"), "first")
    ledger = c.ledger()
    state = ledger.snapshot()
    (answer,) = state.batch.decided
    (mine,) = state.reservations

    def write(n: int):
        plan = compact(Plan.from_json(answer.plan), ANSWER_ROWS // n).to_json()     # a batch of n: a few rows each
        decided = tuple(dataclasses.replace(answer, job_id=f"gpu-job-sweep-{i:04d}", ticket=f"t-{i:012x}", plan=plan)
                        for i in range(n))
        held = [dataclasses.replace(mine, job_id=f"gpu-job-sweep-{i:04d}") for i in range(n)]
        now = ledger.snapshot()
        ledger._write(held, now.unavailable, now, now.jobs, batch=Batch(decided, "t-0:x", c.clock() + 30))

    write(200)
    size = len(json.dumps(c.cluster.read_configmap("default", CONFIGMAP)["data"]).encode())
    assert size < MAX_LEDGER_BYTES // 3, size     # ~1.4 KiB per job: its reservation and a two-row answer
    before = json.dumps(c.cluster.read_configmap("default", CONFIGMAP))
    with pytest.raises(LedgerFull, match="4000 batch answers"):
        write(4000)
    assert json.dumps(c.cluster.read_configmap("default", CONFIGMAP)) == before


def test_answers_of_batch_after_batch_share_one_row_budget_so_the_ledger_stays_bounded():
    """The bench's 200-job burst peaked at 530 KiB when each write had its own ANSWER_ROWS: answers
    live DECIDED_SECONDS, so batches in a row piled up budgets. Now all live answers share one."""
    c = cloud()
    book_first(booker(c), spec("first"), "first")
    (answer,) = c.ledger().snapshot().batch.decided
    plan = Plan.from_json(answer.plan)
    many = dataclasses.replace(plan, candidates=plan.candidates * 100)    # a big fleet's table
    assert answer_rows(Batch(), 1) == ANSWER_ROWS and answer_rows(Batch(), 50) == ANSWER_ROWS // 50
    live = Batch()
    for i in range(30):                     # thirty batches of one, each within the lease of the last
        rows = answer_rows(live, 1)
        kept = compact(many, rows).to_json()
        live = Batch((*live.decided, dataclasses.replace(answer, ticket=f"t{i}", plan=kept)), "x", c.clock() + 30)
    chosen = sum(c.verdict.value == "chosen" for c in many.candidates)
    held = sum(len(d.plan["candidates"]) for d in live.decided)
    assert held <= ANSWER_ROWS + 30 * chosen, held
    assert answer_rows(live, 5) == 0 and len(compact(many, 0).candidates) == chosen     # the chosen rows stay


def test_the_queue_shards_are_the_ones_the_ledger_role_names():
    """tests/static/test_permissions.py checks the Role against these names."""
    assert RequestQueue(None).shards == [f"{CONFIGMAP}-queue-{i}" for i in range(64)]


def test_a_queued_request_reads_back_as_the_same_request_and_carries_no_command_or_env():
    s = JobSpec.from_dict({"name": "x", "image": "python:3.11", "command": ["python", "train.py"], "gpus": 2,
                           "cpu": "4", "memory": "16Gi", "replicas": 2, "gpu_model": "T4",
                           "env": {"WANDB_API_KEY": "secret-value"}, "node_selector": {"pool": "a"},
                           "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]})
    request = s.to_job_request("job-x")
    text = json.dumps(request.to_json())
    assert "secret-value" not in text and "train.py" not in text and "python:3.11" not in text
    assert JobRequest.from_json(json.loads(text)) == request


def test_a_stale_request_of_a_job_that_placed_itself_is_not_placed_again_nor_its_reservation_removed():
    """The job's wait gave up and it placed itself on the single path; its old request is still
    queued. A batch must not give it a second placement, nor drop the one it holds: its pod may be
    about to be bound there, and a placer that saw neither would promise the node twice."""
    c = cloud()
    booker(c).book(spec(), "job")                   # the single path: job holds gpu-run
    ghost(c, "job", lease_for=None)                 # its old ticket, still queued
    book_first(booker(c), spec("other"), "other")
    assert held(c) == {"job": ["gpu-run"], "other": ["gpu-stop"]}
    stale = c.ledger().snapshot().batch.answer("job:dead")
    assert stale is not None and stale.plan["outcome"] == "busy" and "meanwhile" in stale.plan["message"]


def requests_to(c: Cloud) -> list[str]:
    """From now on, every ConfigMap request of the fake API server, in order, as "verb name"."""
    seen: list[str] = []
    for verb in ("read_configmap", "merge_patch_configmap"):
        real = getattr(c.cluster, verb)

        def counted(namespace, name, *args, _real=real, _verb=verb, **kwargs):
            seen.append(f"{_verb.split('_')[0]} {name}")
            return _real(namespace, name, *args, **kwargs)
        setattr(c.cluster, verb, counted)
    return seen


def test_a_job_placed_by_an_earlier_batch_is_placed_again_on_its_own_and_reads_nothing_before_queueing():
    """A batch writes reservations but no job record, so only the ledger says that a job holds a placement (a
    re-run of place after its first answer). The waiter queues without reading anything; the leader, which
    reads every shard, answers it `alone`, and the waiter books on the single path: the job ends with one
    placement, not two."""
    c = cloud()
    b = booker(c)
    assert book_first(b, spec(), "job").plan.outcome == Outcome.FITS
    assert held(c) == {"job": ["gpu-run"]}
    requests = requests_to(c)
    again = book_first(booker(c), spec(), "job")
    assert again.committed and held(c) == {"job": [again.plan.assignments[0].node]}
    answered = next(d for d in c.ledger().snapshot().batch.decided if d.job_id == "job" and d.alone)
    assert answered.plan["outcome"] == Outcome.BUSY.value
    assert requests[0].startswith("merge ") and "-queue-" in requests[0], requests[:3]    # queued first


def test_a_job_with_a_record_queued_behind_a_live_leader_is_answered_alone_and_re_placed_on_the_single_path():
    """The place step of a job that has a record (an earlier try started a node) cannot tell it has one without
    reading the ledger; it queues like any other, and the leader, which reads every shard, answers it `alone`:
    it never gets a second placement from a batch, and its record (the node it started) is kept."""
    c = cloud({"gpu-run": ("Running", T4), "gpu-stop": ("Stopped", T4)})
    c.ledger().record_starts("job", [StartedNode("gpu-stop", "i-gpu-stop", c.clock())], c.clock() + 600)
    ghost(c, "leader", lease_for=600)           # someone leads: the waiter does not read the root
    leader = BatchPlacer(booker(c), None, LEASE_SECONDS)   # type: ignore[arg-type]
    done = threading.Event()

    def lead() -> None:         # the live leader's rounds, as a placer's, until the waiter has its answer
        while not done.is_set():
            if leader.queue.waiting():
                leader.lead("leader:dead", stay=True)
            done.wait(0.02)
    thread = threading.Thread(target=lead)
    thread.start()
    try:
        RequestQueue(c.cluster, clock=c.clock).publish((), Lead("leader:dead", c.clock() + 600, c.clock()))
        booking = book_first(booker(c), spec(), "job")
    finally:
        done.set()
        thread.join()
    decided = {d.job_id: d for d in c.ledger().snapshot().batch.decided}
    assert decided["job"].alone and "record of an earlier try" in decided["job"].plan["message"]
    assert booking.committed and held(c)["job"] == [booking.plan.assignments[0].node]
    assert c.ledger().snapshot().record("job", c.clock()).started_on("gpu-stop") is not None


@pytest.mark.parametrize("seen_in", ["root", "queue-shard-copies"])
def test_a_waiter_keeps_its_place_while_the_leader_commits_batches_and_withdraws_only_without_progress(seen_in):
    """A large burst: the leader commits batch after batch (the root's write counter moves; with copies, the
    `Lead` in the queue shards too) and has not reached this job after the waiter's own budget (20 s). The
    waiter keeps waiting rather than falling back to a full cluster read (seeing the copies, without reading
    the root); once the leader stops (its lease runs out), the waiter leads and answers itself in a batch."""
    c = cloud()
    ghost(c, "ghost", lease_for=5)
    start = c.clock()
    waiter_root_reads, ghost_writing = [], threading.Event()
    read = c.cluster.read_configmap

    def counted(namespace, name, cached=False):
        if name == CONFIGMAP and not ghost_writing.is_set() and c.clock() < start + 60:
            waiter_root_reads.append(c.clock())
        return read(namespace, name, cached)
    c.cluster.read_configmap = counted

    def sleep(seconds: float) -> None:
        c.clock.advance(seconds)
        if c.clock() < start + 60:      # the leader commits a batch: its lease renewed, the root written
            ghost_writing.set()
            state = c.ledger().snapshot()
            c.ledger()._write(list(state.reservations), state.unavailable, state, state.jobs,
                              batch=Batch(state.batch.decided, "ghost:dead", c.clock() + 5))
            if seen_in == "queue-shard-copies":
                RequestQueue(c.cluster, clock=c.clock).publish((), Lead("ghost:dead", c.clock() + 5, c.clock()))
            ghost_writing.clear()

    b = booker(c, sleep=sleep, contended_seconds=20)
    booking = book_first(b, spec(), "job")
    assert booking.committed and booking.plan.outcome == Outcome.FITS
    assert c.clock() - start > 60                                        # it waited through the leader's batches
    # the root every LEASE_CHECK_SECONDS (5 s) for a minute, or only book_first's read when the copies show a lease
    assert len(waiter_root_reads) == 1 if seen_in == "queue-shard-copies" else len(waiter_root_reads) >= 10
    assert c.ledger().snapshot().batch.answer(next(iter(
        d.ticket for d in c.ledger().snapshot().batch.decided if d.job_id == "job"))) is not None   # by a batch


def test_a_batch_copies_each_answer_into_its_waiters_queue_shard_and_its_lease_into_every_shard():
    """RequestQueue.publish, after the ledger commit: the answered entries leave their shards and their answers'
    copies come in (for ANSWER_KEEP_SECONDS), the lead into all shards; a step-down publishes a lapsed lead."""
    c = cloud()
    q = RequestQueue(c.cluster, clock=c.clock)
    tickets = [f"job-{i}:t{i}" for i in range(12)]
    for t in tickets:
        q.add(Queued(t.split(":")[0], t, spec().to_job_request("x").to_json(), 600.0, c.clock() + 60))
    answered = [Decided(t.split(":")[0], t, {"outcome": "fits"}, "leader", c.clock() + 120) for t in tickets[:8]]
    q.publish(answered, Lead("leader:1", c.clock() + 15, c.clock()))
    looks = {t: q.look(t) for t in tickets}
    assert all(looks[t].answer == dataclasses.replace(d, expires_at=c.clock() + ANSWER_KEEP_SECONDS)
               and not looks[t].waits for t, d in zip(tickets, answered))
    assert all(looks[t].answer is None and looks[t].waits for t in tickets[8:])
    assert [x.ticket for x in q.waiting()] == sorted(tickets[8:], key=lambda t: t)
    assert {q._read(name).lead for name in q.shards} == {Lead("leader:1", c.clock() + 15, c.clock())}
    c.clock.advance(ANSWER_KEEP_SECONDS + 1)
    q.publish((), Lead("leader:1", 0.0, c.clock()))              # a step-down
    assert all(q.look(t).answer is None for t in tickets)        # the copies went; the root still has them
    assert {q._read(name).lead.lease_until for name in q.shards} == {0.0}


def test_an_answer_whose_copy_was_lost_is_read_from_the_ledger_root():
    """The copy is best effort (written after the commit): without it the waiter finds its answer in the root."""
    c = cloud()
    b = booker(c, sleep=c.clock.advance)
    lost = []
    b_queue_publish = RequestQueue.publish
    try:
        RequestQueue.publish = lambda self, answers, lead, attempts=5, everywhere=False: lost.extend(answers)
        booking = book_first(b, spec(), "job")
    finally:
        RequestQueue.publish = b_queue_publish
    assert booking.committed and booking.plan.outcome == Outcome.FITS and [d.job_id for d in lost] == ["job"]
    assert held(c) == {"job": ["gpu-run"]}


def test_waiters_take_their_answers_from_their_queue_shard_and_read_the_ledger_root_twice_at_most():
    """Twelve first placements at once: one leads; each other waiter reads the root only while its queue shard
    shows no lease yet (at once: it may have to lead; the lease's copy comes when the lease is taken), twice
    at most, and then only its queue shard, where its answer's copy comes."""
    c = cloud()
    assert book_first(booker(c), spec("one"), "one").plan.outcome == Outcome.FITS     # the ledger exists
    jobs = [f"job-{i:02d}" for i in range(12)]
    barrier = threading.Barrier(len(jobs))
    reads: Counter = Counter()
    read = c.cluster.read_configmap

    def counted(namespace, name, cached=False):
        if name == CONFIGMAP:
            reads[threading.current_thread().name] += 1
        return read(namespace, name, cached)
    c.cluster.read_configmap = counted
    bookers = {j: booker(c) for j in jobs}

    def run(job: str) -> Outcome:
        threading.current_thread().name = job
        barrier.wait()
        return book_first(bookers[job], spec(job), job).plan.outcome

    with ThreadPoolExecutor(len(jobs)) as pool:
        outcomes = list(pool.map(run, jobs))
    assert Counter(outcomes) == {Outcome.FITS: 3, Outcome.BUSY: 9}
    leaders = {d.by for d in c.ledger().snapshot().batch.decided if d.job_id in jobs}
    waiters = [reads[job] for job in jobs if job not in leaders]     # 0: its queue patch showed the lease
    assert len(leaders) == 1 and len(waiters) == len(jobs) - 1 and max(waiters) <= 2, reads


def test_waiters_of_a_large_burst_poll_less_often():
    import random

    from gpuboot.lifecycle.batching import POLL_CROWD, POLL_MAX_SECONDS, POLL_SECONDS, poll_seconds

    rng = random.Random(0)
    few = [poll_seconds(10, rng) for _ in range(200)]
    assert POLL_SECONDS[0] <= min(few) and max(few) <= POLL_SECONDS[1]
    crowd = [poll_seconds(POLL_CROWD * 4, rng) for _ in range(200)]
    assert min(crowd) >= 4 * POLL_SECONDS[0] and max(crowd) <= POLL_MAX_SECONDS
    # what 1,000 waiters ask of the API server in all: about POLL_CROWD / mean(POLL_SECONDS) reads a second
    assert 1000 / (sum(poll_seconds(1000, rng) for _ in range(1000)) / 1000) < 2 * POLL_CROWD / sum(POLL_SECONDS) * 2


def test_a_leaders_lease_is_renewed_at_two_thirds_left_and_its_copy_keeps_the_last_commit_time():
    """`BatchPlacer.renew` (the placer's lease thread): one write of the root when less than two thirds of
    the lease are left, the copy in every queue shard with the last commit's `at` (a new `at` would tell the
    waiters a batch was committed); never someone else's lease, nor a lapsed one."""
    c = cloud()
    p = BatchPlacer(booker(c), None)
    me = "placer-1:x"
    assert p._take_lease(c.ledger().snapshot(), me)
    assert not p.renew(me)                          # a fresh lease: no write
    c.clock.advance(LEASE_SECONDS / 2)
    p.committed_at = 1_799_999_990.0
    assert p.renew(me)
    assert c.ledger().snapshot().batch.lease_until == c.clock() + LEASE_SECONDS
    assert p.queue.wait_copied(5)                   # its copies are written in the background
    queue = RequestQueue(c.cluster, clock=c.clock)
    assert {queue._read(name).lead for name in queue.shards} == {Lead(me, c.clock() + LEASE_SECONDS, p.committed_at)}
    c.clock.advance(LEASE_SECONDS + 1)
    assert not p.renew(me)                          # lapsed: taken again, not renewed
    assert p._take_lease(c.ledger().snapshot(), "placer-2:y")
    c.clock.advance(LEASE_SECONDS / 2)
    assert not p.renew(me) and c.ledger().snapshot().batch.leader == "placer-2:y"


def test_a_batch_commit_that_met_only_a_renewal_keeps_its_plans():
    c = cloud()
    p = BatchPlacer(booker(c), None)
    assert p._take_lease(c.ledger().snapshot(), "placer-1:x")
    state = c.ledger().snapshot()
    c.clock.advance(LEASE_SECONDS / 2)
    assert p.renew("placer-1:x")
    assert still_valid(state, c.ledger().snapshot(), [], c.clock())


def test_a_batch_commit_that_meets_its_own_lease_renewed_writes_once_and_takes_nothing_back():
    """The placer's lease thread renews the lease between a round's read and its commit (a round on 10,000
    nodes outlasts a third of the lease). The root's batch then differs from the one read by its lease only:
    the commit goes through. Refused, it took back the batch's reservations (a tombstone each) and placed
    it again, and those tombstones then read as releases: each job holding them was told busy."""
    c = cloud()
    p = BatchPlacer(booker(c), None)
    me = "placer-1:x"
    assert p._take_lease(c.ledger().snapshot(), me)
    RequestQueue(c.cluster, clock=c.clock).add(
        Queued("job", "job:t", spec().to_job_request("job").to_json(), 600.0, c.clock() + 60))
    renewed: list[float] = []

    def renew() -> None:                            # a second later, the lease thread renews
        c.clock.advance(1)
        assert p.renew(me, below=float("inf"))
        renewed.append(c.ledger().snapshot().batch.lease_until)

    # once the batch's reservation is in its shard, and before the root is written
    c.cluster.before_write_when(lambda: bool(held(c)), renew)
    p.lead(me, stay=True)
    state = c.ledger().snapshot()
    assert renewed == [c.clock() + LEASE_SECONDS]
    assert Plan.from_json(state.batch.answer("job:t").plan).outcome == Outcome.FITS and held(c) == {"job": ["gpu-run"]}
    assert state.tombstones == ()                   # nothing taken back
    assert p.booker.full_reads == 1                 # placed once


def test_a_queued_job_whose_reservations_were_released_is_placed_not_told_busy():
    """Releases the survey may not show yet are counted as reserved capacity, but the job they belonged to
    holds nothing now: it is placed (only a live reservation means a placement made meanwhile)."""
    from gpuboot.lifecycle.booking import survey

    c = cloud()
    p = BatchPlacer(booker(c), None)
    entry = Queued("job", "job:t", spec().to_job_request("job").to_json(), 600.0, c.clock() + 60)
    gone = Reservation(job_id="job", task="main", node="gpu-run", resources=Resources.parse({"nvidia.com/gpu": 1}),
                       expires_at=c.clock() + 600)
    seen = survey(c.cluster, c.ecs, [], c.clock(), 900)
    plans, added = p.decide([entry], seen, [], [gone], [], c.clock())
    assert plans[0].outcome == Outcome.FITS
    assert [r.node for r in added] != ["gpu-run"]   # the released GPU still counted as taken
    plans, _ = p.decide([entry], seen, [gone], [], [], c.clock())
    assert plans[0].outcome == Outcome.BUSY and "placement made meanwhile" in plans[0].message


def test_a_burst_led_while_the_lease_is_renewed_again_and_again_never_promises_a_gpu_twice():
    """24 waiters at once for the fleet's 4 GPUs while a lease thread renews whoever leads as fast as it
    can (each renewal a compare-and-swap of the root racing the batch commits): 4 fit, 20 are told busy,
    no GPU promised twice, and the renewals did land between the commits."""
    c = cloud()
    jobs = [f"job-{i:02d}" for i in range(24)]
    barrier = threading.Barrier(len(jobs) + 1)
    bookers = {j: booker(c) for j in jobs}
    done, renewals = threading.Event(), [0]

    def renew_whoever_leads() -> None:
        renewer = BatchPlacer(booker(c), None)
        barrier.wait()
        while not done.is_set():
            leader = c.ledger().snapshot().batch.led_by(c.clock())
            if leader is not None and renewer.renew(leader, below=float("inf")):
                renewals[0] += 1
            done.wait(0.001)        # as fast as it can, yielding to the waiters

    keeper = threading.Thread(target=renew_whoever_leads)
    keeper.start()
    try:
        outcomes = at_once(jobs, bookers, barrier)
    finally:
        done.set()
        keeper.join()
    assert Counter(outcomes.values()) == {Outcome.FITS: 4, Outcome.BUSY: 20}
    state = c.ledger().snapshot()
    assert sorted(r.job_id for r in state.reservations) == sorted(j for j, o in outcomes.items() if o == Outcome.FITS)
    assert Counter(r.node for r in state.reservations) == {"gpu-run": 1, "gpu-stop": 1, "gpu2-stop": 2}
    assert renewals[0] > 0


def test_the_root_keeps_the_newest_answers_that_fit_its_budget(monkeypatch):
    from gpuboot.lifecycle import batching

    plan = {"job_id": "j", "outcome": "busy", "message": "x" * 300}
    old = tuple(Decided(f"old-{i}", f"old-{i}:t", plan, "p", 1e10) for i in range(10))
    new = tuple(Decided(f"new-{i}", f"new-{i}:t", plan, "p", 1e10) for i in range(3))
    size = batching.answer_bytes(plan, "old-0:t")
    monkeypatch.setattr(batching, "ANSWER_BYTES", size * 5 + 1)
    kept = batching.kept_answers(old, new)
    assert [d.job_id for d in kept] == ["old-8", "old-9", "new-0", "new-1", "new-2"]
    assert batching.kept_answers((), new) == new


def test_a_burst_larger_than_the_roots_answer_budget_is_answered_over_several_batches(monkeypatch):
    """1,000 jobs' answers would pass the root's size limit: a batch answers what fits in ANSWER_BYTES
    (here about four answers), the rest go to the next batches; every waiter is answered, no GPU is
    promised twice and the root never holds more than the budget."""
    from gpuboot.lifecycle import batching

    c = cloud()
    first = book_first(booker(c), spec("first"), "first")
    budget = 4 * batching.answer_bytes(compact(first.plan, ANSWER_ROWS).to_json(), "job-00:0123456789ab")
    monkeypatch.setattr(batching, "ANSWER_BYTES", budget)
    jobs = [f"job-{i:02d}" for i in range(16)]
    barrier = threading.Barrier(len(jobs))
    bookers = {j: booker(c) for j in jobs}
    peak = [0]
    real = c.cluster.replace_configmap

    def watched(namespace, body):
        if body["metadata"]["name"] == CONFIGMAP and "batch.json" in body["data"]:
            decided = json.loads(body["data"]["batch.json"]).get("decided", [])
            peak[0] = max(peak[0], sum(batching.answer_bytes(d["plan"], d["ticket"]) for d in decided))
        return real(namespace, body)
    c.cluster.replace_configmap = watched

    outcomes = at_once(jobs, bookers, barrier)
    assert Counter(outcomes.values()) == {Outcome.FITS: 3, Outcome.BUSY: 13}
    assert Counter(r.node for r in c.ledger().snapshot().reservations) == {"gpu-run": 1, "gpu-stop": 1, "gpu2-stop": 2}
    assert 0 < peak[0] <= budget + batching.answer_bytes(compact(first.plan, ANSWER_ROWS).to_json(), "x" * 30)


def test_waiters_queueing_at_once_never_conflict_and_none_is_lost():
    """Every entry is a key of its own, added by a merge patch: 64 waiters queueing at the same instant
    (two per shard) meet no conflict and are all there for the leader."""
    c = cloud()
    q = RequestQueue(c.cluster, clock=c.clock)
    barrier = threading.Barrier(64)
    refused = c.cluster.refused

    def add(i: int) -> None:
        barrier.wait()
        q.add(Queued(f"job-{i}", f"job-{i}:t", spec().to_job_request(f"job-{i}").to_json(), 600.0, c.clock() + 60))

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(add, range(64)))
    assert sorted(e.job_id for e in q.waiting()) == sorted(f"job-{i}" for i in range(64))
    assert c.cluster.refused == refused


def test_publish_prunes_what_the_leaders_read_found_expired_and_keeps_what_came_since():
    c = cloud()
    q = RequestQueue(c.cluster, clock=c.clock)
    entry = lambda job, ttl: Queued(job, f"{job}:t", spec().to_job_request(job).to_json(), 600.0, c.clock() + ttl)  # noqa: E731
    q.add(entry("a", 60))
    q.add(entry("old", 5))
    c.clock.advance(10)
    assert [e.job_id for e in q.waiting()] == ["a"]         # the leader's read: "old" expired
    q.add(entry("new", 60))                                 # queued after that read
    answer = Decided("a", "a:t", {"job_id": "a", "outcome": "busy"}, "p", c.clock() + 120)
    q.publish([answer], Lead("p", c.clock() + 15, c.clock()))
    assert sorted(e.job_id for e in q.waiting()) == ["new"]
    assert q.look("a:t").answer is not None and q.look("new:t").waits
    keys = {k for name in q.shards for k in (c.cluster.read_configmap("default", name) or {}).get("data", {})}
    assert len([k for k in keys if k.startswith("q.")]) == 1    # "old" and "a" gone, "new" kept


def test_a_batch_copies_its_lead_only_into_the_shards_it_writes_and_into_every_shard_now_and_then():
    """A lone job's batch patches its own shard, not all QUEUE_SHARDS: the other shards keep the copy the
    lease's take (or renewal) wrote, still live for their waiters, until LEAD_EVERYWHERE_SECONDS have passed
    since the last copy into every shard."""
    c = cloud()
    q = RequestQueue(c.cluster, clock=c.clock)
    leads = lambda: {name: q._read(name).lead for name in q.shards}     # noqa: E731
    taken = Lead("p", c.clock() + 15, c.clock())
    q.publish((), taken)                                            # the lease taken: every shard
    assert set(leads().values()) == {taken}
    c.clock.advance(1)
    q.add(Queued("a", "a:t", spec().to_job_request("a").to_json(), 600.0, c.clock() + 60))
    first = Lead("p", c.clock() + 15, c.clock())
    q.publish([Decided("a", "a:t", {"job_id": "a", "outcome": "fits"}, "p", c.clock() + 120)], first)
    after = leads()
    assert after[q.shard_of("a:t")] == first
    assert {lead for name, lead in after.items() if name != q.shard_of("a:t")} == {taken}
    other = next(f"b:{i}" for i in range(100) if q.shard_of(f"b:{i}") != q.shard_of("a:t"))
    assert q.look(other).lead.lease_until > c.clock()               # a waiter there still sees a live lead
    c.clock.advance(LEAD_EVERYWHERE_SECONDS)
    q.add(Queued("c", "c:t", spec().to_job_request("c").to_json(), 600.0, c.clock() + 60))
    later = Lead("p", c.clock() + 15, c.clock())
    q.publish([Decided("c", "c:t", {"job_id": "c", "outcome": "fits"}, "p", c.clock() + 120)], later)
    assert set(leads().values()) == {later}


def test_a_renewal_that_crossed_its_answer_does_not_queue_the_job_again():
    """A waiter renews its entry just as the leader answers it: the patch lands after the answer's, and
    the entry is back beside its answer's copy. Once the root has let the answer go, the leader must not
    take it for a new request (it would answer `alone` and overwrite the copy); the next publish prunes it."""
    c = cloud()
    q = RequestQueue(c.cluster, clock=c.clock)
    entry = Queued("a", "a:t", spec().to_job_request("a").to_json(), 600.0, c.clock() + 60)
    q.add(entry)
    q.add(Queued("b", "b:t", spec().to_job_request("b").to_json(), 600.0, c.clock() + 60))
    answer = Decided("a", "a:t", {"job_id": "a", "outcome": "fits"}, "p", c.clock() + 120)
    q.publish([answer], Lead("p", c.clock() + 15, c.clock()))
    q.add(dataclasses.replace(entry, expires_at=c.clock() + 90))    # the renewal that crossed the answer
    crossed = q.look("a:t")
    assert crossed.waits and crossed.answer is not None           # entry and copy side by side
    assert [e.job_id for e in q.waiting(answered=())] == ["b"]     # the root no longer holds a's answer
    q.publish((), Lead("p", c.clock() + 15, c.clock()))
    look = q.look("a:t")
    assert not look.waits and look.answer is not None and look.answer.plan["outcome"] == "fits"
    assert [e.job_id for e in q.waiting()] == ["b"]


@pytest.mark.parametrize("led", [True, False])
def test_a_waiter_behind_a_live_lease_waits_before_its_first_look_as_long_as_the_crowd_says(led):
    """Queued behind a leader, a waiter's answer is a round away at least: it pauses before its first look, by
    the crowd its queue patch's answer showed (a thousand waiters looking at once, right after queueing, slowed
    the API server the leader needed). It learns who leads from that answer too (the lease's copy the leader
    wrote on taking it), reading nothing before. With nobody leading it reads the ledger root at once (it may
    have to lead)."""
    c = cloud()
    queue = RequestQueue(c.cluster, clock=c.clock)
    for i in range(600):                             # a crowd queued before it (~19 in each shard)
        queue.add(Queued(f"other-{i}", f"other-{i}:t", spec().to_job_request(f"other-{i}").to_json(), 600.0,
                         c.clock() + 60))
    if led:
        leader = BatchPlacer(booker(c), None)
        assert leader._take_lease(c.ledger().snapshot(), "placer-1:x") and leader.queue.wait_copied(5)
    events = requests_to(c)
    b = booker(c, contended_seconds=0.5, sleep=lambda s: events.append(s) or c.clock.advance(s))   # the lease lapses
    book_first(b, spec(), "job")
    assert isinstance(events[0], str) and events[0].startswith("merge ") and "-queue-" in events[0]   # queued first
    first = next(i for i, e in enumerate(events[1:], 1) if isinstance(e, str))
    if led:
        shard = events[0].split()[1]                                           # its ticket's
        crowd = sum(queue.shard_of(f"other-{i}:t") == shard for i in range(600)) + 1
        floor = POLL_SECONDS[0] * crowd * len(queue.shards) / POLL_CROWD     # what its shard said of the crowd
        assert first == 2 and events[1] >= floor > POLL_SECONDS[0]
        assert events[2] == f"read {shard}"                                    # its shard, not the root
    else:
        assert first == 1 and events[1] == f"read {CONFIGMAP}"


def test_a_queue_patch_the_api_server_gives_up_on_is_tried_again_and_past_that_the_step_defers():
    """A merge patch may still meet a 409 when the API server's own retries give up: a few are tried again;
    a shard that refuses every try makes the place step defer, holding nothing, with no cluster read."""
    from gpuboot.exceptions import LedgerContended

    c = cloud()
    q = RequestQueue(c.cluster, clock=c.clock)
    q.add(Queued("x", "x:t", spec().to_job_request("x").to_json(), 600.0, c.clock() + 60))   # the shards exist
    c.cluster.conflict_next_writes(2)
    q.add(Queued("y", "y:t", spec().to_job_request("y").to_json(), 600.0, c.clock() + 60))
    assert {e.job_id for e in q.waiting()} == {"x", "y"}
    b = booker(c)
    c.cluster.conflict_next_writes(1000)
    with pytest.raises(LedgerContended, match="could not queue job job"):
        book_first(b, spec(), "job")
    assert b.full_reads == 0 and "job" not in held(c)


@pytest.mark.parametrize("status", [504, 503, 429])
def test_a_queue_patch_the_api_server_times_out_on_is_tried_again_and_past_that_the_step_defers(status):
    """A thousand waiters' queue patches at once made kube-apiserver answer some 504 Timeout (the write landed
    or not; the adapter raises it as Overloaded): the same merge patch is tried again, and a shard that keeps
    failing makes the place step defer, holding nothing, where the 504 failed the job. Another refusal (403,
    say) is no load and is not retried."""
    from kubernetes.client.exceptions import ApiException

    from gpuboot.exceptions import LedgerContended, Overloaded

    c = cloud()
    q = RequestQueue(c.cluster, clock=c.clock)
    q.add(Queued("x", "x:t", spec().to_job_request("x").to_json(), 600.0, c.clock() + 60))   # the shards exist
    real, failing = c.cluster.merge_patch_configmap, [2]

    def overloaded(namespace, name, body):
        if failing[0] > 0:
            failing[0] -= 1
            raise Overloaded(f"{status} Gateway Timeout")
        return real(namespace, name, body)
    c.cluster.merge_patch_configmap = overloaded
    q.add(Queued("y", "y:t", spec().to_job_request("y").to_json(), 600.0, c.clock() + 60))
    assert {e.job_id for e in q.waiting()} == {"x", "y"} and failing == [0]
    failing[0] = 1000
    b = booker(c)
    with pytest.raises(LedgerContended, match=f"could not queue job job.*{status}"):
        book_first(b, spec(), "job")
    assert b.full_reads == 0 and "job" not in held(c)
    c.cluster.merge_patch_configmap = lambda *args: (_ for _ in ()).throw(ApiException(status=403, reason="no"))
    with pytest.raises(ApiException):
        q.add(Queued("z", "z:t", spec().to_job_request("z").to_json(), 600.0, c.clock() + 60))


def test_a_shard_of_the_compare_and_swap_format_is_read_as_empty_and_its_keys_pruned():
    """An upgrade: a shard written by the old code (one JSON list of entries) is not read as entries (their
    waiters, old code, withdraw and place themselves), and the leader's next patch removes its keys."""
    c = cloud()
    q = RequestQueue(c.cluster, clock=c.clock)
    c.cluster.create_configmap("default", {"metadata": {"name": q.shards[0]},
                                           "data": {"queue.json": "[]", "answers.json": "[]"}})
    assert q.waiting() == []
    q.publish((), Lead("p", c.clock() + 15, c.clock()))
    assert set(c.cluster.read_configmap("default", q.shards[0])["data"]) == {"lead.json"}


class CountingStop(threading.Event):
    """A stop event that counts the waits on it (the rounds of a loop paced by it)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return super().wait(timeout)


def test_the_placers_lease_thread_renews_while_its_loop_comes_round_and_never_when_it_is_stuck(monkeypatch):
    from gpuboot.lifecycle import placer as placer_module
    from simcloud.harness import wait_until

    monkeypatch.setattr(placer_module, "RENEW_SECONDS", 0.01)
    c = cloud()
    p = placer_module.Placer(booker(c), view=None, name="test")
    renewals = []
    renew = p.batcher.renew
    p.batcher.renew = lambda me: renewals.append(me) or renew(me)
    lease = placer_module.PLACER_LEASE_SECONDS              # a placer's: twice a place step's
    assert p.batcher._take_lease(c.ledger().snapshot(), p.me)
    assert c.ledger().snapshot().batch.lease_until == c.clock() + lease and lease == 2 * LEASE_SECONDS
    c.clock.advance(lease / 2)
    p.batcher.alive_at = c.clock() - placer_module.STUCK_SECONDS - 1    # its loop has not come round for long
    stop = CountingStop()
    keeper = threading.Thread(target=p._keep_lease, args=(stop,))
    keeper.start()
    try:
        assert wait_until(lambda: stop.waits >= 20, timeout=10, interval=0.01)
        assert renewals == []                   # stuck: the lease is left to lapse
        p.batcher.alive_at = c.clock()          # the loop comes round again
        assert wait_until(lambda: c.ledger().snapshot().batch.lease_until == c.clock() + lease,
                          timeout=10, interval=0.01)
    finally:
        stop.set()
        keeper.join()


def test_a_lease_is_taken_and_renewed_without_waiting_for_its_copies_which_follow_latest_first():
    """The lease's copies into every queue shard go in the background (`RequestQueue.publish_later`): with the
    shards' patches held up (a burst queueing into them), taking and renewing the lease return at once;
    once they flow, only the latest lease is copied (the renewal's, not the take's), and a leader stepping
    down writes its last copy (lease 0) after them, so no shard ends up saying it still leads."""
    c = cloud()
    p = BatchPlacer(booker(c), None)
    me = "placer-1:x"
    RequestQueue(c.cluster, clock=c.clock).add(Queued("x", "x:t", spec().to_job_request("x").to_json(), 600.0,
                                                      c.clock() + 60))     # the shards exist
    flowing, patched = threading.Event(), []
    patch = c.cluster.merge_patch_configmap

    def held_up(namespace, name, body):
        assert flowing.wait(10)
        patched.append(json.loads(body["data"][LEAD_KEY]) if LEAD_KEY in body["data"] else None)
        return patch(namespace, name, body)
    c.cluster.merge_patch_configmap = held_up

    assert p._take_lease(c.ledger().snapshot(), me)             # returns with its copies held up
    c.clock.advance(LEASE_SECONDS / 2)
    assert p.renew(me)
    renewed = c.ledger().snapshot().batch.lease_until
    assert not p.queue.wait_copied(0.05) and patched == []        # nothing written yet
    flowing.set()
    assert p.queue.wait_copied(10)
    queue = RequestQueue(c.cluster, clock=c.clock)
    assert {queue._read(name).lead.lease_until for name in queue.shards} == {renewed}
    # the take's copy started before the renewal; any copy after it carries the renewal's lease
    assert len(patched) <= 2 * len(queue.shards) and patched[-1]["lease_until"] == renewed

    flowing.clear()
    c.clock.advance(LEASE_SECONDS / 2)
    assert p.renew(me)                          # a copy held up again ...
    threading.Timer(0.2, flowing.set).start()
    p._step_down(me)                            # ... and the step-down's copy written after it
    assert {queue._read(name).lead.lease_until for name in queue.shards} == {0.0}


def test_a_batchs_answers_are_copied_in_the_background_and_not_placed_again_while_their_copies_wait():
    """A leader commits its batch and goes on without waiting for its answers' copies (their shards held
    up by a burst queueing into them); until a copy is written its ticket is left out of the queue, even
    once the ledger root has let the answer go; then the waiter's shard has its answer and no entry."""
    c = cloud()
    p = BatchPlacer(booker(c), None)
    me = "placer-1:x"
    RequestQueue(c.cluster, clock=c.clock).add(Queued("job", "job:t", spec().to_job_request("job").to_json(),
                                                      600.0, c.clock() + 60))
    assert p._take_lease(c.ledger().snapshot(), me) and p.queue.wait_copied(5)
    flowing = threading.Event()
    patch = c.cluster.merge_patch_configmap

    def held_up(namespace, name, body):
        assert flowing.wait(10)
        return patch(namespace, name, body)
    c.cluster.merge_patch_configmap = held_up

    p.lead(me, view=None, stay=True)                        # returns with the copies held up
    assert held(c) == {"job": ["gpu-run"]} and not p.queue.wait_copied(0.05)
    assert p.queue.waiting(answered=()) == []               # as if the root had let the answer go
    flowing.set()
    assert p.queue.wait_copied(10)
    look = RequestQueue(c.cluster, clock=c.clock).look("job:t")
    assert not look.waits and look.answer is not None and look.answer.plan["outcome"] == Outcome.FITS.value
    assert p.queue.waiting(answered=()) == []               # the copy now says it


@pytest.mark.parametrize("same_leader", [True, False], ids=["the-leader-that-answered-it", "a-new-leader"])
def test_a_ticket_queued_again_after_its_answer_went_missing_gets_the_same_answer_from_its_leader(
        monkeypatch, same_leader):
    """A waiter that found neither its answer's copy (written after its poll, or not at all) nor its answer in
    the root (let go batches later) queues its ticket again. The leader that answered it gives the same
    answer again, nothing placed anew; a leader that did not (one taking over) answers it `alone`, and its
    waiter re-places on the single path, as before. On the 10,000-node real plane, 59 waiters answered
    `alone` at once each read the whole cluster, and the API server went down."""
    c = cloud()
    p = BatchPlacer(booker(c), None)
    me = "placer-1:x"
    entry = Queued("job", "job:t", spec().to_job_request("job").to_json(), 600.0, c.clock() + 60)
    queue = RequestQueue(c.cluster, clock=c.clock)
    queue.add(entry)
    assert p._take_lease(c.ledger().snapshot(), me) and p.queue.wait_copied(5)
    publish = RequestQueue.publish
    monkeypatch.setattr(RequestQueue, "publish", lambda self, answers, lead, attempts=5, everywhere=False:
                        publish(self, (), lead, attempts, everywhere))     # the answers' copies are lost
    p.lead(me, view=None, stay=True)
    # the copies' write is over (written without the answers) before the waiter finds none and queues again
    # (until then the leader leaves the ticket out of its queue as answered, whatever the shard says)
    assert p.queue.wait_copied(5)
    first = c.ledger().snapshot().batch.answer("job:t")
    assert first is not None and first.plan["outcome"] == Outcome.FITS.value and held(c) == {"job": ["gpu-run"]}
    state = c.ledger().snapshot()
    c.ledger().put_batch(state, dataclasses.replace(state.batch, decided=()))   # the root let it go
    queue.add(entry)                     # the waiter's ticket, queued again (its entry was gone, no answer)

    leader = p if same_leader else BatchPlacer(booker(c), None)
    leader.lead(me, view=None, stay=True)
    again = c.ledger().snapshot().batch.answer("job:t")
    assert held(c) == {"job": ["gpu-run"]}                      # nothing placed anew, nothing taken back
    if same_leader:
        assert not again.alone and again.plan == first.plan
    else:
        assert again.alone and again.plan["outcome"] == Outcome.BUSY.value


def test_a_queue_shard_read_turned_away_leaves_its_requests_for_the_next_round():
    """The leader's read of every shard: one the API server turns away (429 past the client's tries) is
    skipped, its requests placed at the next round, instead of the round failing."""
    c = cloud()
    queue = RequestQueue(c.cluster, clock=c.clock)
    jobs = [f"job-{i}" for i in range(6)]
    for job in jobs:
        queue.add(Queued(job, f"{job}:t", spec(job).to_job_request(job).to_json(), 1200.0, c.clock() + 60))
    c.cluster.turn_away_cached_reads(len(queue.shards))        # every shard, this round
    assert queue.waiting() == [] and c.cluster.turned_away == 0
    assert sorted(queue.unread) == sorted(queue.shards)       # not an empty queue: the leader looks again
    assert sorted(q.job_id for q in queue.waiting()) == jobs and queue.unread == []


def test_a_burst_whose_polls_the_api_server_turns_away_is_placed_all_the_same():
    """Four jobs at once on the fleet's four GPUs while 300 reads of the queue shards are turned away (the
    waiters' polls and the leader's reads alike): every one is placed, none twice, none fails."""
    c = cloud()
    jobs = [f"job-{i}" for i in range(4)]
    bookers = {j: booker(c) for j in jobs}
    c.cluster.turn_away_cached_reads(300)
    outcomes = at_once(jobs, bookers, threading.Barrier(len(jobs)))
    assert Counter(outcomes.values()) == {Outcome.FITS: 4}
    assert Counter(r.node for r in c.ledger().snapshot().reservations) == {"gpu-run": 1, "gpu-stop": 1, "gpu2-stop": 2}
    assert c.cluster.turned_away < 300          # the polls were turned away indeed

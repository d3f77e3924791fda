"""The job queue in the cluster (gpuboot.lifecycle.jobqueue) on the in-memory fakes: entries with a
fixed enqueue time and a lease, holds, admissions, many writers at once, and the place step's
turn (a newcomer never takes the place of an older waiter)."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpuboot.core.jobspec import JobSpec
from gpuboot.core.placement import Outcome, Plan
from gpuboot.core.queue import Entry, Hold, QueueConfig, Step
from gpuboot.core.resources import GPU, Resources
from gpuboot.core.timefmt import utc
from gpuboot.lifecycle.booking import Booker, survey
from gpuboot.lifecycle.jobqueue import (
    LEASE_SECONDS,
    WAKE_POSITIONS,
    JobQueue,
    Turn,
    book_in_order,
    queue_config,
    queue_view,
)
from tests.fakes import T4, cloud

LOG = logging.getLogger("test-jobqueue")


def entry(job_id: str, at: float, gpus: int = 1, team: str = "default") -> Entry:
    return Entry(job_id, Resources({GPU: gpus}), enqueued_at=at, team=team)


def spec(name: str, **more) -> JobSpec:
    return JobSpec.from_dict({"name": name, "image": "python:3.11", "command": ["true"], "gpus": 1, "cpu": "1",
                              "memory": "1Gi", "boot_timeout_seconds": 300, **more})


def test_an_entry_keeps_its_first_enqueue_time_while_its_lease_is_renewed():
    c = cloud()
    queue = JobQueue(c.cluster, clock=c.clock)
    queue.enqueue(entry("a", c.clock()))
    c.clock.advance(100)
    state = queue.enqueue(entry("a", c.clock()))       # the next poll: same place in line, a new lease
    (waiting,) = state.waiting
    assert waiting.entry.enqueued_at == c.clock() - 100 and waiting.lease_until == c.clock() + LEASE_SECONDS


def test_the_queue_deadline_is_fixed_at_the_first_enqueue_and_kept_through_admission():
    c = cloud()
    queue = JobQueue(c.cluster, clock=c.clock)
    first = queue.deadline("a", 3600)                    # the place step's first try: an hour from now
    assert first == c.clock() + 3600
    queue.enqueue(entry("a", c.clock()), first)
    c.clock.advance(100)
    assert queue.deadline("a", 3600) == first           # a later poll, or a retry of the step, keeps it
    queue.enqueue(entry("a", c.clock()), c.clock() + 3600)
    assert queue.snapshot().waiting[0].deadline == first
    queue.admit("a", "default", "Tesla-T4", 1, c.clock() + 3600)
    c.clock.advance(600)
    assert queue.deadline("a", 3600) == first           # start and wait read the same one
    queue.drop("a")
    assert queue.deadline("a", 3600) == c.clock() + 3600   # a new run of the job: a new deadline


def test_releases_move_the_change_counter_arrivals_renewals_and_admissions_do_not():
    c = cloud()
    queue = JobQueue(c.cluster, clock=c.clock)
    assert queue.snapshot().changes == 0
    assert queue.enqueue(entry("a", c.clock())).changes == 0            # an arrival frees nothing
    assert queue.enqueue(entry("a", c.clock())).changes == 0            # its renewal
    queue.admit("a", "default", "Tesla-T4", 1)
    assert queue.snapshot().changes == 0
    queue.drop("a")                                                      # a release
    assert queue.snapshot().changes == 1
    queue.drop("a")                                                      # nothing left to drop
    assert queue.snapshot().changes == 1


def test_only_the_front_of_the_line_is_woken_early_the_rest_wait_on_their_timer():
    def turn(position: int, admitted: bool = False) -> Turn:
        return Turn(Plan("j", Outcome.BUSY, ""), Step(entry("j", 0), position, admitted, "capacity busy"), 20,
                    changes=7)

    assert turn(0).wake_after == 7 and turn(WAKE_POSITIONS - 1).wake_after == 7
    assert turn(WAKE_POSITIONS).wake_after is None and turn(0, admitted=True).wake_after is None
    assert Turn(Plan("j", Outcome.FITS, ""), changes=7).wake_after is None


def test_the_log_line_names_the_jobs_ahead_by_name_and_id_and_says_the_deadline():
    step = Step(entry("gb-3", 0), 2, False, "capacity busy: every node that fits is in use", ("gb-1", "gb-2", "gb-3"))
    turn = Turn(Plan("gb-3", Outcome.BUSY, ""), step, 3, 1_800_003_600.0, names={"gb-1": "resnet"})
    assert turn.line(1_800_000_000.0) == (
        "queue position 3 of 3; ahead: resnet (gb-1), gb-2; blocked by: capacity busy: every node that fits is in "
        "use; queue deadline 2027-01-15 09:00:00 UTC (in 60 min)")


def test_the_log_line_says_which_nodes_the_job_holds_and_whether_firm_or_when_due():
    step = Step(entry("gb-3", 0), 0, False, "capacity busy: every node that fits is in use")
    now = 1_800_000_000.0

    def line(hold: Hold) -> str:
        return Turn(Plan("gb-3", Outcome.BUSY, ""), step, 1, hold=hold).line(now)

    assert line(Hold("gb-3", ("gpu8",), None, now, firm=True)).endswith(
        "; holds node(s) gpu8, firm: it preempted there, kept for it alone until it places")
    assert line(Hold("gb-3", ("gpu8", "gpu8b"), now + 600, now)).endswith(
        "; holds node(s) gpu8, gpu8b, due 2027-01-15 08:10:00 UTC (in 10 min)")
    assert line(Hold("gb-3", ("gpu8",), None, now)).endswith("; holds node(s) gpu8, due when their work ends "
                                                             "(not stated)")


def test_a_waiter_killed_mid_wait_loses_its_place_and_its_hold_within_one_lease():
    c = cloud()
    queue = JobQueue(c.cluster, clock=c.clock)
    state = queue.enqueue(entry("dead", c.clock()))
    assert queue.save_holds({"dead": Hold("dead", ("gpu-run",), None, c.clock())}, state)
    c.clock.advance(LEASE_SECONDS - 1)
    state = queue.enqueue(entry("alive", c.clock()))
    assert [e.job_id for e in state.live(c.clock())] == ["alive", "dead"] and state.live_holds(c.clock())
    c.clock.advance(2)                                  # the dead waiter never renewed
    state = queue.snapshot()
    assert [e.job_id for e in state.live(c.clock())] == ["alive"] and state.live_holds(c.clock()) == {}
    state = queue.enqueue(entry("alive", c.clock()))    # the next write prunes it
    assert [w.entry.job_id for w in state.waiting] == ["alive"] and state.holds == ()


def test_admission_counts_the_teams_gpus_until_the_release_drops_them():
    c = cloud()
    queue = JobQueue(c.cluster, clock=c.clock)
    queue.enqueue(entry("a", c.clock(), gpus=2, team="vision"))
    queue.admit("a", "vision", "Tesla-T4", 2)
    state = queue.snapshot()
    assert state.live(c.clock()) == [] and state.usage(c.clock()) == {"vision": {"Tesla-T4": 2}}
    queue.drop("a")
    queue.drop("a")                                     # idempotent: a teardown may run twice
    assert queue.snapshot().usage(c.clock()) == {}


def test_a_stale_hold_write_is_refused_not_lost_over_a_newer_queue():
    c = cloud()
    queue = JobQueue(c.cluster, clock=c.clock)
    before = queue.enqueue(entry("a", c.clock()))
    queue.enqueue(entry("b", c.clock()))
    assert not queue.save_holds({"a": Hold("a", ("gpu-run",), None, c.clock())}, before)
    assert [w.entry.job_id for w in queue.snapshot().waiting] == ["a", "b"]


def test_many_actors_enqueue_admit_and_release_at_once_and_no_write_is_lost():
    c = cloud()
    c.cluster.conflict_next_writes(20)       # other writers keep getting there first, as in a burst

    def actor(i: int) -> None:
        queue = JobQueue(c.cluster, clock=c.clock)      # each its own client, as each worker has
        queue.enqueue(entry(f"job-{i}", c.clock()))
        if i % 3 == 0:
            queue.admit(f"job-{i}", "default", "Tesla-T4", 1)
        if i % 2 == 0:
            queue.drop(f"job-{i}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(actor, range(40)))
    state = JobQueue(c.cluster, clock=c.clock).snapshot()
    assert sorted(e.job_id for e in state.live(c.clock())) == sorted(
        f"job-{i}" for i in range(40) if i % 2 and i % 3)
    assert sorted(a.job_id for a in state.running) == sorted(f"job-{i}" for i in range(40) if i % 3 == 0 and i % 2)
    assert c.cluster.refused >= 20          # every refused write was retried


def test_a_newcomer_never_takes_the_place_an_older_waiter_is_owed():
    c = cloud({"gpu-run": ("Running", T4)})
    queue = JobQueue(c.cluster, clock=c.clock)

    def turn(name: str):
        booker = Booker(c.cluster, c.ecs, c.ledger(), LOG, clock=c.clock)
        return book_in_order(booker, queue, spec(name), name, QueueConfig(), lambda: booker.book(spec(name), name),
                             c.clock() + 3600)

    assert turn("first").plan.outcome is Outcome.FITS
    older = turn("older")
    assert older.plan.outcome is Outcome.BUSY and "queue position 1 of 1" in older.line()
    assert older.deadline == c.clock() + 3600 and older.line(c.clock()).endswith(
        f"queue deadline {utc(c.clock() + 3600)} (in 60 min)")
    c.clock.advance(10)
    newcomer = turn("newcomer")
    assert newcomer.plan.outcome is Outcome.BUSY
    assert "queue position 2 of 2; ahead: older; blocked by:" in newcomer.line()
    c.ledger().release("first")                         # the GPU frees: the newcomer polls first
    again = turn("newcomer")
    assert again.plan.outcome is Outcome.BUSY and "ahead: older" in again.line()
    assert again.deadline == newcomer.deadline          # its later polls keep the deadline of its first
    assert turn("older").plan.outcome is Outcome.FITS
    assert [e.job_id for e in queue.snapshot().live(c.clock())] == ["newcomer"]


def test_the_queue_configuration_is_read_from_the_environment_and_a_bad_one_is_named():
    config = queue_config({"GPUBOOT_QUEUE_CONFIG": '{"teams": {"vision": {"weight": 2, "nominal": {"T4": 4}}}}'})
    assert config.weight("vision") == 2 and queue_config({}) == QueueConfig()
    with pytest.raises(ValueError, match="GPUBOOT_QUEUE_CONFIG: not a valid queue configuration"):
        queue_config({"GPUBOOT_QUEUE_CONFIG": '{"teams": {"x": {"weight": 0}}}'})


def test_the_queue_view_shows_every_waiter_in_order_with_who_is_ahead_and_what_blocks_it():
    c = cloud({"gpu-run": ("Running", T4)})
    queue = JobQueue(c.cluster, clock=c.clock)
    booker = Booker(c.cluster, c.ecs, c.ledger(), LOG, clock=c.clock)
    booker.book(spec("hog"), "hog")
    queue.enqueue(entry("older", c.clock()), c.clock() + 3600)
    queue.enqueue(entry("big", c.clock() + 1, gpus=4))
    views = survey(c.cluster, c.ecs, c.ledger().live(), c.clock()).views
    rows = queue_view(queue.snapshot(), views, [], QueueConfig(), c.clock() + 5)
    assert [(r["position"], r["job_id"], r["ahead"], r["next"]) for r in rows] == [
        (1, "older", [], False), (2, "big", ["older"], False)]
    assert "capacity busy" in rows[0]["blocker"] and rows[0]["blocked_by"] == "capacity"
    assert rows[0]["deadline"] == c.clock() + 3600 and rows[1]["enqueued_at"] == c.clock() + 1
    assert "needs a node with 4 nvidia.com/gpu" in rows[1]["blocker"] and rows[1]["held_nodes"] == []
    assert (rows[1]["gpus"], rows[1]["tasks"], rows[1]["gpus_per_task"], rows[1]["team"]) == (4, 1, 4, "default")
    # a job that fits a stopped node but not its team's quota: blocked by the quota
    c = cloud({"gpu-stop": ("Stopped", T4)})
    queue = JobQueue(c.cluster, clock=c.clock)
    queue.enqueue(entry("capped", c.clock(), team="vision"))
    views = survey(c.cluster, c.ecs, c.ledger().live(), c.clock()).views
    config = QueueConfig.from_json({"teams": {"vision": {"nominal": {"T4": 0}}}})
    [row] = queue_view(queue.snapshot(), views, [], config, c.clock())
    assert row["blocked_by"] == "quota" and row["blocker"].startswith("quota: team vision"), row

"""The queue's rules, each on a fleet small enough to check by hand (gpuboot.core.queue)."""
import dataclasses

import pytest

from gpuboot.core.model import NodeState
from gpuboot.core.placement import JobRequest, Outcome, TaskRequest, place
from gpuboot.core.queue import (
    Attempt,
    Entry,
    Hold,
    QueueConfig,
    Running,
    Step,
    TeamQuota,
    choose_hold,
    choose_room,
    expected_end,
    never_fits_quota,
    ordered,
    owed,
    quota_blocker,
    reach,
    releases_of,
    run_pass,
    victims,
)
from gpuboot.core.resources import GPU, Resources
from tests.unit.gpuboot.core.test_placement import nv


def entry(job_id, gpus=1, tasks=1, at=0.0, **kw):
    return Entry(job_id, Resources.parse({"cpu": "1", "memory": "1Gi", GPU: gpus}), tasks=tasks, enqueued_at=at, **kw)


class Fleet:
    """NodeViews that take the pass's admissions, placed by the product's placement."""

    def __init__(self, *views):
        self.views = {v.name: v for v in views}
        self.admitted = []

    def nodes(self):
        return list(self.views.values())

    def attempt(self, e, marks):
        request = JobRequest(e.job_id, tuple(TaskRequest(f"{e.job_id}-{i}", e.requests, gpu_model=e.models)
                                             for i in range(e.tasks)), e.tasks)
        plan = place(request, self.nodes(), marks)
        self._plan = plan
        model = self.views[plan.assignments[0].node].gpu_model if plan.assignments else None
        return Attempt(plan.outcome is Outcome.FITS, model, plan.message, plan.outcome is Outcome.NEVER)

    def commit(self, e, _):
        for a in self._plan.assignments:
            v = self.views[a.node]
            self.views[a.node] = dataclasses.replace(v, allocated=v.allocated + a.requests)
        self.admitted.append(e.job_id)

    def run(self, entries, now=0.0, config=None, usage=None, holds=None, releases=None, capacity=None):
        return run_pass(entries, now=now, config=config or QueueConfig(), usage=usage or {}, capacity=capacity or {"T4": 8},
                        holds=holds or {}, nodes=self.nodes, attempt=self.attempt, commit=self.commit,
                        releases=releases or {})


def t4(name, gpus=8, used=0, state=NodeState.READY, busy_since=None):
    return nv(name, state=state, gpus=gpus, cpu="64", memory="256Gi", gpu_model="T4", busy_since=busy_since,
              used={GPU: used, "cpu": "0", "memory": "0"} if used else None)


# -- order ---------------------------------------------------------------------------------

def test_priority_class_goes_before_fair_share_and_age():
    old, high = entry("old", at=0, priority_class="low"), entry("high", at=50, priority_class="high")
    assert [e.job_id for e in ordered([old, entry("mid", at=10), high], {}, {"T4": 8}, QueueConfig())] == \
        ["high", "mid", "old"]


def test_the_team_furthest_below_its_weighted_share_goes_first_then_age():
    config = QueueConfig({"a": TeamQuota("a", weight=1), "b": TeamQuota("b", weight=3)})
    usage = {"a": {"T4": 2}, "b": {"T4": 4}}          # shares 2/8 for a, (4/8)/3 for b: b is further below
    jobs = [entry("a1", at=0, team="a"), entry("b1", at=5, team="b"), entry("b0", at=1, team="b")]
    assert [e.job_id for e in ordered(jobs, usage, {"T4": 8}, config)] == ["b0", "b1", "a1"]


def test_a_pass_recomputes_shares_so_one_teams_burst_alternates_with_another():
    fleet = Fleet(t4("n1", gpus=4))
    burst = [entry(f"a{i}", at=i, team="a") for i in range(3)] + [entry("b0", at=10, team="b")]
    result = fleet.run(burst, capacity={"T4": 4})
    assert fleet.admitted == ["a0", "b0", "a1", "a2"]
    assert [s.position for s in result.steps] == [0, 1, 2, 3]


# -- quotas --------------------------------------------------------------------------------

COHORT = QueueConfig({"a": TeamQuota("a", nominal={"T4": 4}, cohort="ml", borrowing_limit={"T4": 2}),
                      "b": TeamQuota("b", nominal={"T4": 4}, cohort="ml", lending_limit={"T4": 1}),
                      "solo": TeamQuota("solo", nominal={"A100": 2})})


def test_a_team_uses_its_nominal_quota_then_borrows_within_its_limit():
    assert quota_blocker(entry("j", 4, team="a"), "T4", {}, COHORT) is None
    assert quota_blocker(entry("j", 1, team="a"), "T4", {"a": {"T4": 4}}, COHORT) is None     # borrows 1 of b's 1
    blocked = quota_blocker(entry("j", 3, team="a"), "T4", {"a": {"T4": 4}}, COHORT)
    assert "borrowing limit 2" in blocked


def test_the_cohort_lends_only_what_its_lending_limits_allow():
    # a lends all its 4, b lends 1 of its 4 (keeps 3): a pool of 5, all of it used by a's 5
    usage = {"a": {"T4": 5}, "b": {"T4": 3}}
    assert "cohort ml has lent all it may of T4 GPUs (5)" in quota_blocker(entry("j", 1, team="a"), "T4", usage, COHORT)
    assert quota_blocker(entry("j", 1, team="b"), "T4", usage, COHORT) is None      # within b's nominal


def test_a_team_without_a_cohort_stops_at_its_nominal_and_at_models_it_has_no_quota_for():
    assert "over its nominal 2" in quota_blocker(entry("j", 3, team="solo"), "NVIDIA-A100-SXM4-80GB", {}, COHORT)
    assert "no quota for GPU model T4" in quota_blocker(entry("j", 1, team="solo"), "T4", {}, COHORT)
    assert quota_blocker(entry("j", 64, team="nobody"), "T4", {}, COHORT) is None   # no quota: unlimited


def test_a_job_that_can_never_fit_its_quota_is_named_at_trigger_time():
    # a: nominal 4 + borrowing limit 2, but the cohort's pool is only 5 (a lends 4, b lends 1)
    assert never_fits_quota(entry("j", 5, team="a", models=("T4",)), COHORT) is None
    message = never_fits_quota(entry("j", 3, tasks=2, team="a", models=("T4",)), COHORT)
    assert "at most 5 GPUs of T4" in message and "needs 6" in message
    assert never_fits_quota(entry("j", 1, team="solo", models=("T4",)), COHORT) is not None


def test_quota_blocks_admission_in_a_pass_and_says_so():
    config = QueueConfig({"a": TeamQuota("a", nominal={"T4": 1})})
    fleet = Fleet(t4("n1"))
    result = fleet.run([entry("a0", team="a"), entry("a1", at=1, team="a"), entry("b0", at=2, team="b")], config=config)
    assert fleet.admitted == ["a0", "b0"]
    assert result.step("a1").blocker.startswith("quota: team a would use 2 T4 GPUs")
    assert [result.step(j).blocked_by for j in ("a0", "a1", "b0")] == ["", "quota", ""]


def test_what_blocks_a_step_is_named_as_quota_hold_or_capacity():
    def kind(blocker):
        return Step(entry("j"), 0, False, blocker).blocked_by

    assert kind("quota: team a would use 2 T4 GPUs, over its nominal 1") == "quota"
    assert kind("capacity busy: every node that fits is in use; node(s) n2 held for job big") == "hold"
    assert kind("capacity busy: every node that fits is in use") == "capacity"
    assert kind("needs a node with 16 nvidia.com/gpu") == "capacity"


# -- holds and backfill ----------------------------------------------------------------------

def test_a_starving_big_job_holds_the_nodes_that_free_soonest_and_small_jobs_cannot_take_them():
    fleet = Fleet(t4("n1", used=7, busy_since=100), t4("n2", used=7, busy_since=0), t4("n3", used=7, busy_since=50))
    big, small = entry("big", gpus=8, at=0), entry("small", at=5)
    releases = {"n1": [(7, None)], "n2": [(7, 2000.0)], "n3": [(7, None)]}
    early = fleet.run([big, small], now=100, releases=releases)
    assert early.holds == {} and fleet.admitted == ["small"]            # not starving yet: best effort
    fleet = Fleet(t4("n1", used=7, busy_since=100), t4("n2", used=7, busy_since=0), t4("n3", used=7, busy_since=50))
    late = fleet.run([big, small], now=700, releases=releases)
    assert late.holds["big"].nodes == ("n2",) and late.holds["big"].due == 2000.0   # the known end, soonest
    assert fleet.admitted == ["small"] and fleet.views["n2"].allocated.gpus == 7     # small went elsewhere
    assert "held for job big" in late.step("small").blocker or late.step("small").admitted


def test_without_known_ends_the_hold_takes_the_node_with_least_to_drain_then_the_youngest_work():
    nodes = [t4("n1", used=6, busy_since=10), t4("n2", used=4, busy_since=10), t4("n3", used=4, busy_since=90)]
    hold = choose_hold(entry("big", gpus=8), nodes, taken=(), releases={}, now=100)
    assert hold.nodes == ("n3",) and hold.due is None


def test_backfill_onto_a_held_node_only_when_it_ends_before_the_hold_is_due():
    hold = {"big": Hold("big", ("n1",), due=1000.0, since=0)}
    for runtime, goes in ((800, True), (1200, False), (None, False)):
        fleet = Fleet(t4("n1", used=4))
        fleet.run([entry("big", gpus=8), entry("s", at=1, expected_runtime=runtime)], now=100, holds=hold)
        assert ("s" in fleet.admitted) is goes, runtime


def test_small_jobs_boot_stopped_nodes_the_held_job_would_not_use():
    fleet = Fleet(t4("n1", used=4), t4("n2", gpus=2, state=NodeState.STOPPED))
    result = fleet.run([entry("big", gpus=8), entry("s", at=1)], now=10_000)
    assert result.holds["big"].nodes == ("n1",)
    assert fleet.admitted == ["s"] and fleet.views["n2"].allocated.gpus == 1


def test_a_gang_is_held_as_a_whole_or_not_at_all():
    nodes = [t4("n1", used=4), t4("n2", used=4)]
    assert choose_hold(entry("g", gpus=8, tasks=2), nodes, (), {}, 0).nodes == ("n1", "n2")
    assert choose_hold(entry("g", gpus=8, tasks=3), nodes, (), {}, 0) is None
    assert choose_hold(entry("g", gpus=8, tasks=2), nodes, taken={"n2"}, releases={}, now=0) is None


def test_a_hold_is_kept_while_it_still_covers_the_job_and_dropped_once_the_job_is_admitted():
    kept = Hold("big", ("n2",), None, since=5)
    nodes = [t4("n1", used=1), t4("n2", used=6)]
    assert choose_hold(entry("big", gpus=8), nodes, (), {}, 100, keep=kept) is kept
    fleet = Fleet(t4("n1", used=1), t4("n2"))
    result = fleet.run([entry("big", gpus=8)], now=100, holds={"big": kept})
    assert fleet.admitted == ["big"] and result.holds == {}


def test_a_high_priority_job_gets_its_hold_at_once():
    fleet = Fleet(t4("n1", used=4))
    result = fleet.run([entry("vip", gpus=8, at=99, priority_class="high")], now=100)
    assert result.holds["vip"].nodes == ("n1",)


def test_a_refused_shape_skips_only_jobs_of_the_same_gpu_models():
    fleet = Fleet(nv("v", gpus=8, cpu="64", memory="256Gi", gpu_model="V100", used={GPU: 8}), t4("t"))
    result = fleet.run([entry("v100", models=("V100",)), entry("t4", at=1, models=("T4",)),
                        entry("v100b", at=2, models=("V100",))])
    assert fleet.admitted == ["t4"]
    assert result.step("v100b").blocker.startswith("as v100 ahead of it, of the same shape: ")


def test_only_stops_at_the_entry_asked_for_and_names_who_is_ahead():
    fleet = Fleet(t4("n1", used=8))
    result = run_pass([entry("a"), entry("b", at=1), entry("c", at=2)], now=0, config=QueueConfig(), usage={},
                      capacity={"T4": 8}, holds={}, nodes=fleet.nodes, attempt=fleet.attempt, commit=fleet.commit,
                      only="b")
    assert [s.entry.job_id for s in result.steps] == ["a", "b"] and result.step("b").ahead == ("a",)


def test_entries_and_holds_round_trip_through_json_and_bad_classes_are_refused():
    e = entry("j", gpus=2, tasks=3, team="t", priority_class="high", expected_runtime=60.0, preemptible=True)
    assert Entry.from_json(e.to_json()) == e
    h = Hold("j", ("a", "b"), 10.0, 1.0)
    assert Hold.from_json(h.to_json()) == h
    with pytest.raises(ValueError, match="priority_class"):
        entry("j", priority_class="urgent")
    config = QueueConfig.from_json({"starve_seconds": 60, "teams": {"a": {"weight": 2, "nominal": {"T4": 4}}}})
    assert config.weight("a") == 2 and config.teams["a"].nominal["T4"] == 4 and config.starve_seconds == 60


def test_while_ends_are_unknown_spare_nodes_are_held_and_the_first_to_drain_serves():
    nodes = [t4("n1", used=6, busy_since=10), t4("n2", used=4, busy_since=10), t4("n3", used=5, busy_since=10)]
    assert choose_hold(entry("big", gpus=8), nodes, (), {}, 100, spare=1).nodes == ("n2", "n3")
    known = {"n2": [(4, 500.0)], "n3": [(5, 400.0)], "n1": [(6, 300.0)]}
    assert choose_hold(entry("big", gpus=8), nodes, (), known, 100, spare=1).nodes == ("n1",)   # known: no spare


# -- preemption and the bounds on holds -----------------------------------------------------

def test_a_one_gpu_job_needs_no_hold_and_only_one_job_holds_nodes_at_a_time():
    fleet = Fleet(t4("n1", used=8), t4("n2", used=8), t4("n3", used=8))
    result = fleet.run([entry("one", gpus=1), entry("big", gpus=8, at=1), entry("big2", gpus=8, at=2)], now=10_000)
    assert set(result.holds) == {"big"}               # big2 waits for its turn to hold


def running_on(node, job_id, gpus, started, **kw):
    return Running(job_id, node, Resources.parse({"cpu": "1", "memory": "1Gi", GPU: gpus}), started_at=started,
                   enqueued_at=started, **kw)


def test_a_held_job_preempts_only_preemptible_jobs_youngest_first_once_it_has_waited_long_enough():
    config = QueueConfig(starve_seconds=600, preempt_after_seconds=1800)
    nodes = [t4("n1", used=6)]
    hold = Hold("big", ("n1",), None, since=0)
    jobs = [running_on("n1", "old", 2, 10, preemptible=True), running_on("n1", "young", 2, 50, preemptible=True),
            running_on("n1", "keep", 2, 30)]
    big = entry("big", gpus=6)
    assert victims(big, hold, nodes, jobs, now=2_000, config=config) == []          # not waited long enough
    assert victims(big, hold, nodes, jobs, now=2_400, config=config) == ["young", "old"]
    assert victims(entry("big", gpus=8), hold, nodes, jobs, now=2_400, config=config) == []   # "keep" stays
    assert victims(big, hold, nodes, jobs, 2_400, QueueConfig(preempt_after_seconds=None)) == []
    peers = [running_on("n1", "first", 6, 10, preemptible=True)]           # as big and enqueued earlier
    assert victims(dataclasses.replace(big, enqueued_at=40), hold, nodes, peers, now=2_500, config=config) == []
    assert victims(big, hold, nodes, peers, now=2_500, config=config) == ["first"]       # enqueued later


def test_a_higher_class_preempts_at_once_and_never_a_job_of_a_higher_class():
    config = QueueConfig()
    hold = Hold("vip", ("n1",), None, since=0)
    jobs = [running_on("n1", "low", 4, 10, preemptible=True, priority_class="low"),
            running_on("n1", "top", 4, 20, preemptible=True, priority_class="high")]
    nodes = [t4("n1", used=8)]
    assert victims(entry("vip", gpus=4, priority_class="normal"), hold, nodes, jobs, 1, config) == ["low"]
    assert victims(entry("vip", gpus=8, priority_class="normal"), hold, nodes, jobs, 1, config) == []


def test_the_pass_names_the_jobs_to_requeue_for_the_held_job():
    fleet = Fleet(t4("n1", used=8))
    result = run_pass([entry("big", gpus=8, priority_class="high")], now=0, config=QueueConfig(), usage={},
                      capacity={"T4": 8}, holds={}, nodes=fleet.nodes, attempt=fleet.attempt, commit=fleet.commit,
                      running=[running_on("n1", "p", 8, 0, preemptible=True, priority_class="low")])
    assert result.holds["big"].nodes == ("n1",) and result.preempt == {"big": ["p"]}


def preempting_pass(fleet, entries, holds=None, config=None, running=()):
    return run_pass(entries, now=0, config=config or QueueConfig(), usage={}, capacity={"T4": 16}, holds=holds or {},
                    nodes=fleet.nodes, attempt=fleet.attempt, commit=fleet.commit, running=list(running))


def test_only_the_queue_head_preempts_even_where_a_job_behind_it_could_too():
    """Two high jobs that do not fit, two nodes of preemptible work, holds for both: victims are named
    for the first in order only; the second waits (the room freed goes to the job that freed it)."""
    lows = [running_on(n, f"p{n}", 8, 0, preemptible=True, priority_class="low") for n in ("n1", "n2")]
    jobs = [entry("b", gpus=8, at=5, priority_class="high"), entry("a", gpus=8, at=0, priority_class="high")]
    result = preempting_pass(Fleet(t4("n1", used=8), t4("n2", used=8)), jobs, config=QueueConfig(max_holds=2, spare_holds=0),
                             running=lows)
    assert list(result.preempt) == ["a"] and len(result.preempt["a"]) == 1 and set(result.holds) == {"a", "b"}


def test_the_head_preemptor_takes_over_a_hold_behind_it_unless_jobs_were_preempted_for_that_one():
    lows = [running_on("n1", "p", 8, 0, preemptible=True, priority_class="low")]
    jobs = [entry("a", gpus=8, at=0, priority_class="high"), entry("b", gpus=8, at=5, priority_class="high")]
    behind = Hold("b", ("n1",), None, since=0)
    result = preempting_pass(Fleet(t4("n1", used=8)), jobs, {"b": behind}, running=lows)
    assert result.preempt == {"a": ["p"]} and list(result.holds) == ["a"] and result.holds["a"].nodes == ("n1",)
    firm = dataclasses.replace(behind, firm=True)           # b preempted there already: n1 stays b's
    result = preempting_pass(Fleet(t4("n1", used=8)), jobs, {"b": firm}, running=lows)
    assert result.preempt == {} and result.holds == {"b": firm}
    assert not firm.lets(entry("short", gpus=1, expected_runtime=1.0), 0) and Hold.from_json(firm.to_json()) == firm


def test_a_pass_for_another_jobs_step_keeps_the_firm_hold_of_a_job_that_would_fit():
    """Job a preempted on n1 (firm hold) and has not placed yet; b's step runs the pass: a fits there,
    but its hold stays (its own step admits it) and b gets none on n1; the replay's pass (no `only`)
    admits for real and lets it go."""
    firm = Hold("a", ("n1",), None, since=0, firm=True)
    jobs = [entry("a", gpus=8, at=0, priority_class="high"), entry("b", gpus=8, at=5, priority_class="high")]
    fleet = Fleet(t4("n1"))
    result = run_pass(jobs, now=0, config=QueueConfig(), usage={}, capacity={"T4": 8}, holds={"a": firm},
                      nodes=fleet.nodes, attempt=fleet.attempt, commit=fleet.commit, only="b")
    assert result.step("a").admitted and not result.step("b").admitted and result.holds == {"a": firm}
    assert "a" not in preempting_pass(Fleet(t4("n1")), jobs, {"a": firm}).holds


def test_only_nodes_of_young_work_are_held_and_a_hold_is_let_go_once_it_has_lasted_its_time():
    nodes = [t4("old", used=4, busy_since=0), t4("new", used=6, busy_since=9_000)]
    hold = choose_hold(entry("big", gpus=8), nodes, (), {}, now=10_000, young=3_600)
    assert hold.nodes == ("new",) and hold.since == 10_000
    later = choose_hold(entry("big", gpus=8), nodes, (), {}, now=13_700, keep=hold, young=3_600)
    assert later is None                      # held an hour and "new"'s work is old now too: nothing to gain


def test_a_job_waiting_past_the_threshold_goes_before_fresh_jobs_whatever_its_teams_share():
    usage = {"busy": {"T4": 6}}
    jobs = [entry("starving", at=0, team="busy"), entry("fresh", at=900, team="idle")]
    assert [e.job_id for e in ordered(jobs, usage, {"T4": 8}, QueueConfig(), now=1_000)] == ["starving", "fresh"]
    assert [e.job_id for e in ordered(jobs, usage, {"T4": 8}, QueueConfig(), now=500)] == ["fresh", "starving"]


def test_with_known_ends_old_work_may_be_held_and_the_hold_moves_only_to_nodes_that_free_sooner():
    nodes = [t4("old", used=4, busy_since=0), t4("new", used=6, busy_since=9_000)]
    known = {"old": [(4, 12_000.0)], "new": [(6, 50_000.0)]}
    hold = choose_hold(entry("big", gpus=8), nodes, (), known, now=10_000, young=3_600)
    assert hold.nodes == ("old",) and hold.due == 12_000.0       # old work, but it ends first
    sooner = {"old": [(4, 30_000.0)], "new": [(6, 20_000.0)]}    # "old" ran past its stated end
    moved = choose_hold(entry("big", gpus=8), nodes, (), sooner, now=13_700, keep=hold, young=3_600)
    assert moved.nodes == ("new",) and moved.due == 20_000.0 and moved.since == 10_000   # held since the first pass
    assert choose_hold(entry("big", gpus=8), nodes, (), {"old": [(4, None)], "new": [(6, 50_000.0)]},
                       now=10_000, young=3_600).nodes == ("new",)       # one unknown end: old work is not held


def test_a_stated_runtime_ends_at_its_start_plus_runtime_and_an_overrun_is_due_now_only_within_the_grace():
    job = Running("j", "n1", Resources.parse({GPU: 2}), started_at=1_000, expected_runtime=600)
    assert expected_end(job, now=1_200, grace=3_600) == 1_600
    assert expected_end(job, now=2_000, grace=3_600) == 2_000           # overrun: due now
    assert expected_end(job, now=1_600 + 3_601, grace=3_600) is None     # its stated runtime proved wrong
    assert expected_end(dataclasses.replace(job, expected_runtime=None), now=1_200, grace=3_600) is None


def test_releases_count_each_running_job_at_its_end_and_the_rest_of_a_node_as_unknown():
    nodes = [t4("n1", used=6), t4("n2", used=2), t4("n3")]
    running = [Running("a", "n1", Resources.parse({GPU: 4}), started_at=0, expected_runtime=500),
               Running("b", "n2", Resources.parse({GPU: 2}), started_at=0, expected_runtime=900)]
    # n1: 2 GPUs of a job placed but not started (or a pod that is not the queue's): end unknown
    assert releases_of(nodes, running, now=100, grace=3_600) == {"n1": [(4, 500), (2, None)], "n2": [(2, 900)],
                                                                 "n3": []}


def test_a_hold_due_at_a_stated_end_lets_a_short_job_backfill_and_one_that_stated_nothing_waits():
    fleet = Fleet(t4("n1", used=6, busy_since=0))
    running = [Running("long", "n1", Resources.parse({GPU: 6}), started_at=0, expected_runtime=1_000)]
    jobs = [entry("big", gpus=8, priority_class="high"), entry("short", gpus=2, at=1, expected_runtime=300),
            entry("unstated", gpus=2, at=2)]
    result = fleet.run(jobs, now=100, releases=releases_of(fleet.nodes(), running, 100, 3_600))
    assert result.holds["big"].due == 1_000 and fleet.admitted == ["short"]
    assert "held for job big" in result.step("unstated").blocker
    fleet = Fleet(t4("n1", used=6, busy_since=0))           # no stated runtime: the hold's due is not known
    result = fleet.run(jobs, now=100, releases=releases_of(fleet.nodes(), [dataclasses.replace(
        running[0], expected_runtime=None)], 100, 3_600))
    assert result.holds["big"].due is None and fleet.admitted == []


def test_a_job_that_may_preempt_does_not_wait_days_for_a_stated_end_when_preempting_makes_room():
    fleet = Fleet(t4("soon", used=8, busy_since=0), t4("small", used=8, busy_since=0))
    running = [running_on("soon", "other-big", 8, 0),                       # not preemptible, ends in days
               *[running_on("small", f"s{i}", 1, 100 + i, preemptible=True) for i in range(8)]]
    days = {"soon": [(8, 300_000.0)], "small": [(1, 400_000.0)] * 8}
    big = entry("big", gpus=8)
    result = run_pass([big], now=2_500, config=QueueConfig(), usage={}, capacity={"T4": 16}, holds={},
                      nodes=fleet.nodes, attempt=fleet.attempt, commit=fleet.commit, releases=days, running=running)
    assert result.holds["big"].nodes == ("small",) and sorted(result.preempt["big"]) == [f"s{i}" for i in range(8)]
    soon = {"soon": [(8, 3_000.0)], "small": [(1, 400_000.0)] * 8}         # due within preempt_after: wait for it
    result = run_pass([big], now=2_500, config=QueueConfig(), usage={}, capacity={"T4": 16}, holds={},
                      nodes=fleet.nodes, attempt=fleet.attempt, commit=fleet.commit, releases=soon, running=running)
    assert result.holds["big"].nodes == ("soon",) and result.preempt == {}


# -- preemption: scarce shapes and the work lost (issue 32) ------------------------------------

def big_node(name, used=0, cpu="128"):
    return nv(name, gpus=8, cpu=cpu, memory="768Gi", gpu_model="T4",
              used={GPU: used, "cpu": "0", "memory": "0"} if used else None)


def test_a_job_that_fits_few_nodes_may_requeue_an_older_job_of_as_many_gpus_that_fits_elsewhere():
    """The 120-CPU 8-GPU job fits only the one 128-CPU node, where an older 8-GPU job that would fit the
    small nodes too runs: by age alone it waited that job out (63,272 s on --fleet 10 --seed 0); ranked
    by the scarcity of its nodes it requeues it. The order stays strict: the job that fits everywhere
    never requeues the scarce one, however old, and GPUs per task still come first."""
    config = QueueConfig(starve_seconds=600, preempt_after_seconds=1800)
    nodes = [big_node("large", used=8), big_node("s1", cpu="96"), big_node("s2", cpu="96")]
    wide = Resources.parse({"cpu": "88", "memory": "320Gi", GPU: 8})
    scarce = Resources.parse({"cpu": "120", "memory": "640Gi", GPU: 8})
    assert reach(wide, nodes) == 3 and reach(scarce, nodes) == 1
    hold = Hold("new", ("large",), None, since=0)
    older_wide = [Running("old", "large", wide, preemptible=True, started_at=0, enqueued_at=0)]
    new_scarce = Entry("new", scarce, enqueued_at=100)
    assert victims(new_scarce, hold, nodes, older_wide, now=2_500, config=config) == ["old"]
    older_scarce = [Running("old", "large", scarce, preemptible=True, started_at=0, enqueued_at=0)]
    assert victims(Entry("new", wide, enqueued_at=100), hold, nodes, older_scarce, now=2_500, config=config) == []
    scarce_four = dataclasses.replace(new_scarce, requests=Resources.parse({"cpu": "120", "memory": "640Gi", GPU: 4}))
    assert victims(scarce_four, hold, nodes, older_wide, now=2_500, config=config) == []   # GPUs per task first
    four = [Running("four", "large", Resources.parse({"cpu": "8", "memory": "8Gi", GPU: 4}), preemptible=True,
                    started_at=0, enqueued_at=0)]
    half = [big_node("large", used=4), *nodes[1:]]
    assert victims(new_scarce, hold, half, four, now=2_500, config=config) == ["four"]


def test_room_is_made_where_the_victims_lose_the_least_work_not_where_the_fewest_gpus_drain():
    """n1 runs one 1-GPU job that has run for days (1 GPU to drain), n2 four 2-GPU jobs that have just
    started (8 to drain): the 8-GPU job requeues the four (before: the one, which then ran again from
    its start and waited days more); among equal losses the fewer GPUs to drain still go first."""
    config = QueueConfig()
    now = 1_000_000.0
    nodes = [t4("n1", used=1, busy_since=0), t4("n2", used=8, busy_since=now - 600)]
    running = [running_on("n1", "days", 1, 0, preemptible=True),
               *[running_on("n2", f"fresh{i}", 2, now - 600 + i, preemptible=True) for i in range(4)]]
    big = entry("big", gpus=8, at=now - 3_000)
    room = choose_room(big, nodes, (), running, now, config)
    assert room.nodes == ("n2",) and room.due is None and room.since == now
    assert sorted(victims(big, room, nodes, running, now, config)) == [f"fresh{i}" for i in range(4)]
    assert choose_room(big, nodes, ("n2",), running, now, config).nodes == ("n1",)   # n2 held for another job
    assert choose_room(big, nodes, (), running, now, QueueConfig(preempt_after_seconds=None)) is None
    assert choose_room(big, nodes, (), [], now, config) is None                       # nothing may go
    fleet = Fleet(*nodes)
    result = run_pass([big], now=now, config=config, usage={}, capacity={"T4": 16}, holds={}, nodes=fleet.nodes,
                      attempt=fleet.attempt, commit=fleet.commit, running=running)
    assert result.holds["big"].nodes == ("n2",) and sorted(result.preempt["big"]) == [f"fresh{i}" for i in range(4)]
    same = [running_on("n1", "a", 1, now - 600, preemptible=True), running_on("n2", "b", 1, now - 600, preemptible=True)]
    nodes = [t4("n1", used=1, busy_since=now - 600), t4("n2", used=4, busy_since=now - 600)]
    assert choose_room(big, nodes, (), same, now, config).nodes == ("n1",)   # n2's other 3 GPUs may not go
    nodes = [t4("n1", used=1, busy_since=now - 600), t4("n2", used=1, busy_since=now - 900)]
    assert choose_room(big, nodes, (), same, now, config).nodes == ("n1",)   # equal losses: the youngest work


def test_owed_sums_each_teams_waits_of_its_running_and_waiting_jobs():
    running = [dataclasses.replace(running_on("n1", "a1", 1, 500, team="a"), enqueued_at=100),      # waited 400
               dataclasses.replace(running_on("n1", "a2", 1, 900, team="a"), enqueued_at=900),      # waited 0
               dataclasses.replace(running_on("n2", "b1", 1, 50, team="b"), enqueued_at=0)]         # waited 50
    assert owed([entry("w", at=700, team="b"), entry("x", at=1_000, team="c")], running, 1_000) == \
        {"a": 400.0, "b": 350.0, "c": 0.0}


def test_among_rooms_losing_about_as_much_the_one_that_evens_the_teams_waits_goes_first():
    """n1's victim (team a) has run 10 h, n2's (team b) 15 h: within a factor of two, so the teams'
    waits decide: team a has waited days already, so b's job goes (before: a's, the least work, and the
    requeued runs of days fell on whichever team's job sat on that node). n3's victim (team c, 30 h) is
    beyond the factor: never for fairness. With one team, or without the waits, the least work goes."""
    config = QueueConfig()
    now = 1_000_000.0
    nodes = [t4(f"n{i}", used=1, busy_since=0) for i in (1, 2, 3)]
    running = [running_on("n1", "a-job", 1, now - 36_000, preemptible=True, team="a"),
               running_on("n2", "b-job", 1, now - 54_000, preemptible=True, team="b"),
               running_on("n3", "c-job", 1, now - 108_000, preemptible=True, team="c")]
    big = entry("big", gpus=8, at=now - 3_000, team="d")
    waits = {"a": 500_000.0, "b": 0.0, "c": 0.0, "d": 3_000.0}
    assert choose_room(big, nodes, (), running, now, config).nodes == ("n1",)
    assert choose_room(big, nodes, (), running, now, config, waits).nodes == ("n2",)
    assert choose_room(big, nodes, ("n2",), running, now, config, waits).nodes == ("n1",)   # n3: too much lost
    alike = [dataclasses.replace(r, team="default") for r in running]
    assert choose_room(entry("big", gpus=8, at=now - 3_000), nodes, (), alike, now, config,
                       {"default": 500_000.0}).nodes == ("n1",)
    short = [dataclasses.replace(running[0], started_at=now - 600), dataclasses.replace(running[1], started_at=now - 3_000)]
    assert choose_room(big, nodes[:2], (), short, now, config, waits).nodes == ("n2",)   # both under an hour: alike
    fleet = Fleet(*nodes)       # the pass counts the teams' waits itself (owed): team a's running job waited days
    waited = dataclasses.replace(running_on("n4", "a-old", 8, now - 100, team="a"), enqueued_at=now - 500_000)
    result = run_pass([big], now=now, config=config, usage={}, capacity={"T4": 32}, holds={},
                      nodes=lambda: [*fleet.nodes(), t4("n4", used=8, busy_since=0)],
                      attempt=fleet.attempt, commit=fleet.commit, running=[*running, waited])
    assert result.holds["big"].nodes == ("n2",) and result.preempt["big"] == ["b-job"]


def test_a_gang_takes_the_rooms_that_lose_least_until_all_its_tasks_are_covered():
    config = QueueConfig()
    now = 100_000.0
    nodes = [t4(f"n{i}", used=8, busy_since=0) for i in range(3)]
    running = [dataclasses.replace(running_on(f"n{i}", f"j{i}", 8, started, preemptible=True), enqueued_at=now - 100)
               for i, started in enumerate((0, now - 100, now - 200))]       # j0 has run for a day
    gang = entry("gang", gpus=8, tasks=2, at=now - 3_000)
    room = choose_room(gang, nodes, (), running, now, config)
    assert room.nodes == ("n1", "n2") and sorted(victims(gang, room, nodes, running, now, config)) == ["j1", "j2"]
    assert choose_room(gang, nodes, ("n1",), running, now, config).nodes == ("n0", "n2")

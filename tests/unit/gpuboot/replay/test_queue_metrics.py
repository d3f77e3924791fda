"""What the replay reports about the queue: waits per job size, timeouts, fairness across teams."""
from gpuboot.replay import sim
from gpuboot.replay.cli import size_rows
from gpuboot.replay.metrics import Recorder, bounded_slowdown, jain, overload, size_bucket, team_of
from gpuboot.replay.policies import AllocateTime, Gpuboot, GpubootNoQueue
from tests.unit.gpuboot.replay.test_sim import job, node, run


def test_sizes_fall_in_their_buckets():
    assert [size_bucket(g) for g in (0, 1, 2, 3, 4, 5, 8, 16)] == \
        ["1 GPU", "1 GPU", "2 GPUs", "3-4 GPUs", "3-4 GPUs", "5-8 GPUs", "5-8 GPUs", ">8 GPUs"]


def test_teams_come_from_the_job_name_alone():
    assert team_of("pod-123", 4) == team_of("pod-123", 4)
    assert {team_of(f"pod-{i}", 4) for i in range(200)} == {"team-0", "team-1", "team-2", "team-3"}


def test_jain_is_one_when_equal_and_one_over_n_when_one_has_all():
    assert jain([3.0, 3.0, 3.0]) == 1.0 and jain([0.0, 0.0]) == 1.0
    assert jain([5.0, 0.0, 0.0, 0.0]) == 0.25


def test_a_job_past_its_queue_timeout_fails_and_is_counted_by_size():
    fleet = [node("a", 2, 8)]
    jobs = [job("long", 0, 5_000, gpus=2), job("late", 10, 100, gpus=2), job("small", 20, 100, gpus=1)]
    summary = run(AllocateTime(), fleet, jobs, queue_timeout=1_000)
    assert summary["timeouts"] == 2 and summary["by_size"]["2 GPUs"]["timeouts"] == 1
    assert summary["by_size"]["1 GPU"]["timeouts"] == 1 and summary["by_size"]["2 GPUs"]["started"] == 1
    rows = size_rows([summary])
    assert [r["size"] for r in rows] == ["1 GPU", "2 GPUs"] and "jain_teams" in rows[0]


def test_a_job_still_waiting_at_the_end_is_never_started_in_its_bucket():
    summary = run(AllocateTime(), [node("a", 2, 8)], [job("long", 0, 50_000, gpus=2), job("late", 10, 100, gpus=2)])
    assert summary["by_size"]["2 GPUs"] | {"wait_p50_seconds": None} == {
        "started": 1, "never_started": 1, "timeouts": 0, "wait_p50_seconds": None, "wait_p95_seconds": 30.0,
        "wait_p99_seconds": 30.0, "wait_max_seconds": 30.0,
        # "late" arrives while "long" waits for the boot (30 s) and then runs 50,000 s on the only node
        "floor_p95_seconds": 50_030.0, "jain_teams_bucket": None}


def burst_around_a_big_job():
    """Two 8-GPU nodes kept ~13/16 busy by overlapping 1-GPU jobs; an 8-GPU job arrives among them."""
    small = [job(f"s{i:03d}", i * 100, 1_300, gpus=1) for i in range(200)]
    return [node("a", 8, 64), node("b", 8, 64)], [*small, job("big", 2_000, 500, gpus=8)]


def test_without_the_queue_a_big_job_starves_behind_small_ones_and_with_it_gets_a_hold():
    fleet, jobs = burst_around_a_big_job()
    before = run(GpubootNoQueue(spare_seconds=0), fleet, jobs, end=40_000)
    after = run(Gpuboot(spare_seconds=0), fleet, jobs, end=40_000)
    assert before["by_size"]["5-8 GPUs"]["wait_max_seconds"] > 18_000     # until the small jobs stop coming
    big = after["by_size"]["5-8 GPUs"]
    assert big["started"] == 1 and big["wait_max_seconds"] <= 600 + 1_300 + 30 + 30   # threshold, drain, polls
    assert after["hold_gpu_hours"] > 0 and after["by_size"]["1 GPU"]["never_started"] == 0


def test_a_job_of_another_gpu_model_is_not_skipped_behind_a_refused_one_of_the_same_size():
    fleet = [node("v", 1, 8, model="V100M16"), node("t", 1, 8, model="T4")]
    jobs = [job("v-long", 0, 50_000, gpus=1, models=("V100M16",)), job("t-short", 0, 500, gpus=1, models=("T4",)),
            job("v-wait", 100, 10, gpus=1, models=("V100M16",)), job("t-wait", 110, 10, gpus=1, models=("T4",))]
    for policy in (GpubootNoQueue(spare_seconds=0), Gpuboot(spare_seconds=0)):
        summary = run(policy, fleet, jobs, end=10_000, poll_seconds=0)
        assert summary["by_size"]["1 GPU"]["started"] == 3, policy.name      # t-wait ran when t-short ended
        assert summary["by_size"]["1 GPU"]["wait_max_seconds"] == 30 + 500 - 110, policy.name   # boot 30 s


def test_a_held_job_requeues_preemptible_jobs_once_it_has_waited_past_the_threshold():
    small = [job(f"s{i:03d}", i * 100, 20_000, gpus=1) for i in range(40)]     # long: no hold drains in time
    fleet, jobs = [node("a", 8, 64), node("b", 8, 64)], [*small, job("big", 2_000, 500, gpus=8)]
    kept = run(Gpuboot(spare_seconds=0), fleet, jobs, end=80_000)
    assert kept["preemptions"] == 0 and kept["by_size"]["5-8 GPUs"]["wait_max_seconds"] > 10_000
    preempting = run(Gpuboot(spare_seconds=0), fleet, jobs, end=80_000, preemptible=1.0)
    assert 0 < preempting["preemptions"] <= 8 and preempting["preempted_gpu_hours"] > 0
    assert preempting["by_size"]["5-8 GPUs"]["wait_max_seconds"] <= 600 + 1_800 + 3 * 30
    assert preempting["by_size"]["1 GPU"]["started"] == 40           # requeued, not failed: all ran again


def test_the_replay_gives_the_pass_each_placed_jobs_team_as_live_does(monkeypatch):
    """The rows `run_pass` sees carry each job's team (team_of, as its queue entry), so the room a
    preemption makes is chosen by the teams' waits in the replay as live (queue.choose_room)."""
    seen = []

    def spy(entries, **kw):
        seen.extend(kw["running"])
        return real(entries, **kw)
    real = sim.run_pass
    monkeypatch.setattr(sim, "run_pass", spy)
    small = [job(f"s{i:03d}", i * 100, 20_000, gpus=1) for i in range(12)]
    run(Gpuboot(spare_seconds=0), [node("a", 8, 64)], [*small, job("big", 2_000, 500, gpus=8)], end=30_000,
        preemptible=1.0)
    assert seen and {(r.job_id, r.team) for r in seen} == {(r.job_id, team_of(r.job_id, 4)) for r in seen}
    assert len({r.team for r in seen}) > 1


def test_a_job_placed_on_a_node_still_booting_is_preempted_first_as_live():
    """The node boots for 5,000 s with a long 1-GPU job placed on it; an 8-GPU job that fits only there
    waits past both thresholds: it takes the booting job's place (nothing run, nothing lost) and starts
    when the boot ends, not after the small job's 20,000 s; the small job runs after it."""
    fleet, jobs = [node("a", 8, 64)], [job("small", 0, 20_000, gpus=1), job("big", 10, 500, gpus=8)]
    slow = {"boot_seconds": 5_000, "end": 60_000, "preemptible": 1.0}
    summary = run(Gpuboot(spare_seconds=0), fleet, jobs, **slow)
    assert summary["preemptions"] == 1 and summary["preempted_gpu_hours"] == 0     # taken while booting
    assert summary["by_size"]["5-8 GPUs"]["wait_max_seconds"] <= 10 + 5_000 + 10 + 10
    assert summary["by_size"]["1 GPU"]["started"] == 1                               # requeued, then ran


def test_overload_is_the_work_the_fleet_cannot_have_done_yet_whatever_the_order():
    # 4 GPUs; from t=0 two 4-GPU jobs of 1 h each: 8 GPU-h demanded in the first hour, 4 available
    jobs = [job("a", 0, 3_600, gpus=4), job("b", 0, 3_600, gpus=4), job("c", 20_000, 100, gpus=1)]
    load = overload(jobs, 4, 0, 30_000)
    assert load["peak_backlog_gpu_hours"] == 4.0 and load["backlog_fleet_hours"] == 1.0
    assert load["demanded_gpu_hours"] - load["available_gpu_hours"] == 4.0
    assert load["drained_day"] == round(7_200 / 86_400, 2)          # the fleet catches up after a second hour
    assert overload(jobs, 8, 0, 30_000)["peak_backlog_gpu_hours"] == 0.0
    never = overload([job("long", 0, 50_000, gpus=8)], 4, 0, 30_000)
    assert never["drained_day"] is None and never["peak_backlog_gpu_hours"] == round(4 * 30_000 / 3_600, 1)


def test_fairness_beside_the_mean_waits_by_slowdown_and_per_size():
    recorder = Recorder("p", 0, 1)
    for name, gpus, team, wait, run_seconds in [("s0", 1, "x", 0, 100), ("s1", 1, "y", 0, 100),
                                                ("big", 8, "x", 86_400, 864_000), ("b2", 8, "y", 0, 864_000)]:
        recorder.job_started(0, wait, gpus, run_seconds, team, name)
    assert recorder.team_fairness() < 0.6                       # one big job's day sets team x's mean
    assert recorder.team_fairness(bucket="1 GPU") == 1.0        # the small jobs wait alike
    assert recorder.team_fairness(slowdown=True) > 0.99         # a day on a ten-day job is a 1.1x slowdown
    assert bounded_slowdown(150, 1) == (150 + 10) / 10          # short runs count as SLOWDOWN_FLOOR long


def test_the_no_preemption_floor_is_when_the_work_on_the_soonest_node_ends():
    fleet = [node("a", 8, 64), node("b", 8, 64)]
    jobs = [job("a1", 0, 5_000, gpus=4), job("b1", 0, 9_000, gpus=4), job("big", 1_000, 100, gpus=8)]
    summary = run(AllocateTime(), fleet, jobs, end=20_000)
    # a1 and b1 share node a (first fit); node b is stopped: one boot (30 s)
    assert summary["by_size"]["5-8 GPUs"]["floor_p95_seconds"] == 30.0
    jobs = [job("a1", 0, 5_000, gpus=8), job("b1", 0, 9_000, gpus=8), job("big", 1_000, 100, gpus=8)]
    summary = run(AllocateTime(), fleet, jobs, end=20_000)
    assert summary["by_size"]["5-8 GPUs"]["floor_p95_seconds"] == 30 + 5_000 - 1_000     # a1 ends first

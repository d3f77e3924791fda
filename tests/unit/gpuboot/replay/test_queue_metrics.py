"""What the replay reports about the queue: waits per job size, timeouts, fairness across teams."""
from gpuboot.replay.cli import size_rows
from gpuboot.replay.metrics import jain, size_bucket, team_of
from gpuboot.replay.policies import AllocateTime
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
        "wait_p99_seconds": 30.0, "wait_max_seconds": 30.0}

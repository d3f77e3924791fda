"""Replay simulation and policies on tiny synthetic fleets whose outcome can be checked by hand."""
import random

import pytest

import gpuboot.core.placement
from gpuboot.core.model import NodeState
from gpuboot.core.placement import JobRequest, TaskRequest
from gpuboot.core.resources import Resources
from gpuboot.replay import policies
from gpuboot.replay.metrics import lower_bound_gpu_seconds, percentile
from gpuboot.replay.policies import AllocateTime, AlwaysOn, Gpuboot, QueueTime
from gpuboot.replay.sim import SimConfig, Simulation
from gpuboot.replay.trace import FleetNode, TraceJob

GIB = 2**30


def node(name, gpus, cpus, mem_gib=64, model="T4"):
    return FleetNode(name, gpus, cpus * 1000, mem_gib * 1024, model)


def job(name, arrival, run, gpus, cpus=1, mem_gib=4, models=()):
    return TraceJob(name, float(arrival), float(run), Resources({"cpu": cpus * 1000, "memory": mem_gib * GIB,
                                                                 "nvidia.com/gpu": gpus}), gpu_models=models)


def run(policy, fleet, jobs, **config):
    settings = {"start": 0, "end": 10_000, "start_seconds": 10, "boot_seconds": 10, "device_plugin_seconds": 10,
                    "stop_seconds": 5, "idle_timeout": 600}
    settings.update(config)
    return Simulation(fleet, jobs, policy, SimConfig(**settings)).run().summary(
        lower_bound_gpu_seconds(jobs, settings["end"]), 0.0)


# The seed's bug: node a (2 GPUs) runs j1 and has 1 GPU free; b (1 GPU) and c (2 GPUs) are stopped.
# j2 asks for 2 GPUs. "Cluster free (1) + b (1) >= 2" boots b, which can never hold j2.
SEED_FLEET = [node("a", 2, 64), node("b", 1, 8), node("c", 2, 8)]
SEED_JOBS = [job("j1", 0, 1_000_000, gpus=1, cpus=32), job("j2", 1000, 500, gpus=2, cpus=4)]


def test_queue_time_rule_boots_a_node_too_small_for_the_job():
    result = run(QueueTime(), SEED_FLEET, SEED_JOBS)
    assert result["boots"] == 2                # a for j1, then b for j2
    assert result["wasted_boots"] == 1         # b: j2 never ran there
    assert result["jobs_never_placed"] == 1    # j2 waits forever: no single node holds 2 GPUs
    assert result["jobs_started"] == 1


@pytest.mark.parametrize("policy", [Gpuboot(), AllocateTime()], ids=lambda p: p.name)
def test_per_node_policies_boot_a_node_that_holds_the_job(policy):
    result = run(policy, SEED_FLEET, SEED_JOBS)
    assert result["boots"] == 2                # a for j1, c for j2
    assert result["wasted_boots"] == 0
    assert result["jobs_never_placed"] == 0
    assert result["wait_mean_seconds"] == 30   # each job waited one 30 s boot


@pytest.mark.parametrize("policy", [Gpuboot(), AllocateTime(), QueueTime(), AlwaysOn()], ids=lambda p: p.name)
def test_every_policy_runs_a_job_only_on_a_gpu_model_it_accepts(policy):
    """The trace's gpu_spec: a pod that accepts V100M32 or A10 runs on the V100 32 GB node, never on
    the larger T4 node (first by name) or the 16 GB V100; one no node can hold is never placed."""
    fleet = [node("a-t4", 4, 64, model="T4"), node("b-v16", 1, 8, model="V100M16"), node("c-v32", 1, 8, model="V100M32")]
    jobs = [job("picky", 0, 10**6, gpus=1, models=("V100M32", "A10")), job("none", 0, 10**6, gpus=1, models=("P100",))]
    sim = Simulation(fleet, jobs, policy, SimConfig(start=0, end=1000))
    result = sim.run().summary(lower_bound_gpu_seconds(jobs, 1000), 0.0)
    assert set(sim.nodes["c-v32"].running) == {"picky"} and not sim.nodes["a-t4"].running
    assert result["jobs_started"] == 1


def test_gpuboot_policy_picks_the_two_gpu_node_for_the_two_gpu_job():
    sim = Simulation(SEED_FLEET, SEED_JOBS, Gpuboot(), SimConfig(start=0, end=1500))
    sim.run()
    assert set(sim.nodes["c"].running) == {"j2"}
    assert sim.nodes["b"].state is NodeState.STOPPED


def test_always_on_never_boots_and_bills_the_whole_fleet_for_the_window():
    result = run(AlwaysOn(), SEED_FLEET, SEED_JOBS)
    assert result["boots"] == 0
    assert result["billed_node_hours"] == pytest.approx(3 * 10_000 / 3600, abs=1e-3)
    assert result["billed_gpu_hours"] == pytest.approx(5 * 10_000 / 3600, abs=1e-3)
    assert result["wait_mean_seconds"] == 0


def test_metrics_one_node_two_jobs_by_hand():
    # boot 10 s; j1 runs 10..110; j2 (arrived 50) waits for the GPU and runs 110..210;
    # idle from 210, stop requested at 230, stopped at 235: billed 0..235.
    fleet = [node("n", 1, 8)]
    jobs = [job("j1", 0, 100, gpus=1), job("j2", 50, 100, gpus=1)]
    result = run(Gpuboot(spare_seconds=0), fleet, jobs, end=1000, start_seconds=10, boot_seconds=0,
                 device_plugin_seconds=0, idle_timeout=20, stop_seconds=5, poll_seconds=0)
    assert result["billed_node_hours"] == pytest.approx(235 / 3600, abs=1e-3)
    assert result["billed_gpu_hours"] == pytest.approx(235 / 3600, abs=1e-3)
    assert result["used_gpu_hours"] == pytest.approx(200 / 3600, abs=1e-3)
    assert result["lower_bound_gpu_hours"] == pytest.approx(200 / 3600, abs=1e-3)
    assert result["wait_mean_seconds"] == 35          # (10 + 60) / 2
    assert result["wait_p95_seconds"] == 60
    assert (result["boots"], result["wasted_boots"], result["jobs_never_placed"]) == (1, 0, 0)


def test_a_waiting_job_sees_freed_capacity_at_its_next_poll():
    # as above, but j2 polls every 30 s: it finds j1's GPU free at 140, not at 110
    jobs = [job("j1", 0, 100, gpus=1), job("j2", 50, 100, gpus=1)]
    result = run(Gpuboot(spare_seconds=0), [node("n", 1, 8)], jobs, end=1000, start_seconds=10, boot_seconds=0,
                 device_plugin_seconds=0, idle_timeout=60, stop_seconds=5, poll_seconds=30)
    assert result["wait_p95_seconds"] == 90 and result["boots"] == 1


def test_idle_node_is_stopped_and_booted_again_for_later_work():
    fleet = [node("n", 1, 8)]
    jobs = [job("j1", 0, 100, gpus=1), job("j2", 5000, 100, gpus=1)]
    result = run(AllocateTime(), fleet, jobs, idle_timeout=60)
    assert result["boots"] == 2
    # two power-ons: each 30 s boot + 100 s run + 60 s idle + 5 s stopping
    assert result["billed_node_hours"] == pytest.approx(2 * 195 / 3600, abs=1e-3)


def test_a_job_bigger_than_any_node_is_never_placed_and_boots_nothing():
    result = run(Gpuboot(), [node("n", 2, 8)], [job("big", 0, 100, gpus=8)])
    assert result["jobs_never_fit"] == 1
    assert result["boots"] == 0
    assert "8 nvidia.com/gpu" in result["never_fit_examples"][0]


def test_replay_uses_the_products_place_function():
    assert policies.place is gpuboot.core.placement.place
    calls = []

    def counting_place(request, nodes, unavailable, cost):
        calls.append((request.job_id, cost.boot_seconds, cost.idle_seconds))
        return gpuboot.core.placement.place(request, nodes, unavailable, cost=cost)

    result = run(Gpuboot(place=counting_place), SEED_FLEET, SEED_JOBS)
    assert calls == [("j1", 30, 600), ("j2", 30, 600)]     # with the simulation's own delays
    assert result["placement_calls"] == 2


def test_one_node_per_class_of_twins_gives_place_the_same_plan_as_every_node():
    """The speed-up in Simulation.views(per_class) must not change any decision."""
    rng = random.Random(7)
    shapes = [(1, 8, 32, "V100M16"), (2, 16, 120, "P100"), (2, 64, 256, "P100"), (8, 96, 384, "G2")]
    fleet = [node(f"n{i:03d}", *rng.choice(shapes)) for i in range(80)]
    sim = Simulation(fleet, [], Gpuboot(), SimConfig(start=0, end=1))
    states = [NodeState.READY, NodeState.BOOTING, NodeState.STOPPED, NodeState.STOPPING]
    for sim_node in sim.nodes.values():
        sim_node.state = rng.choice(states)
        gpus = rng.randint(0, sim_node.capacity.gpus)
        sim_node.allocated = Resources({"nvidia.com/gpu": gpus, "cpu": 1000 * gpus}) if gpus else Resources()
        sim_node.changed()
    for trial in range(60):
        request = JobRequest(f"j{trial}", (TaskRequest("t", Resources({
            "nvidia.com/gpu": rng.choice([1, 1, 2, 4, 8, 16]), "cpu": 1000 * rng.choice([1, 4, 12, 40]),
            "memory": GIB * rng.choice([4, 64, 200])})),), 1)
        full = gpuboot.core.placement.place(request, sim.views())
        reduced = gpuboot.core.placement.place(request, sim.views(per_class=1))
        assert len(sim.views(per_class=1)) < len(sim.views())
        assert (reduced.outcome, reduced.assignments, reduced.nodes_to_start) == \
            (full.outcome, full.assignments, full.nodes_to_start)


def test_nearest_rank_percentile():
    assert percentile([], 95) is None
    assert percentile([5], 95) == 5
    assert percentile(list(range(1, 101)), 95) == 95
    assert percentile([10, 60], 95) == 60


def test_the_fleets_spare_is_kept_past_the_idle_time_then_stopped():
    """gpuboot's scale-down (gpuboot.core.idle.IdleRule): the lone node is the fleet's spare, looked at
    again every scale-down run (300 s) and stopped at idle + spare; the baselines stop it at idle."""
    fleet, jobs = [node("a", 2, 16)], [job("j", 0, 3600, gpus=1)]
    kept = run(Gpuboot(spare_seconds=1000), fleet, jobs, end=20_000)
    # boot 30 s, the job, then idle from 3630: looks at +600 (spare), +900, +1200, +1500, stops at +1600; stop 5 s
    assert kept["billed_node_hours"] == pytest.approx((30 + 3600 + 1600 + 5) / 3600, abs=1e-3)
    plain = run(AllocateTime(), fleet, jobs, end=20_000)
    assert plain["billed_node_hours"] == pytest.approx((30 + 3600 + 600 + 5) / 3600, abs=1e-3)


def test_of_two_idle_nodes_one_stops_at_the_idle_time_and_the_other_stays_the_spare():
    """Two 1-GPU nodes go idle together: the first looked at sees the other's free GPU and stops at
    the idle time; the other, then the only GPU left, is the spare until idle + spare."""
    fleet = [node("a", 1, 8), node("b", 1, 8)]
    jobs = [job("j1", 0, 1000, gpus=1), job("j2", 0, 1000, gpus=1)]
    sim = Simulation(fleet, jobs, Gpuboot(spare_seconds=3000),
                     SimConfig(start=0, end=20_000, start_seconds=10, boot_seconds=10, device_plugin_seconds=10,
                               stop_seconds=5, idle_timeout=600))
    stopped = []
    real = sim._node_stopped
    sim._node_stopped = lambda name: stopped.append((name, sim.clock.now)) or real(name)
    sim.run()
    # both boot (30 s) and run 1000 s: idle from 1030
    assert stopped == [("a", 1030 + 600 + 5), ("b", 1030 + 600 + 3000 + 5)]


@pytest.mark.parametrize("field", ["idle_timeout", "scaledown_every"])
def test_scale_down_times_must_be_positive(field):
    """A zero re-check interval would look at a spare again at the same instant, forever."""
    with pytest.raises(ValueError, match=f"{field}: must be > 0"):
        SimConfig(start=0, end=10, **{field: 0})

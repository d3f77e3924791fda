"""The replay's money: the price table, billed_cost, and the lower bound no policy can beat."""
import pytest

from gpuboot.replay import prices
from gpuboot.replay.metrics import lower_bound_cost, whole_node_floor
from gpuboot.replay.policies import POLICIES
from gpuboot.replay.sim import SimConfig, Simulation
from tests.unit.gpuboot.replay.test_sim import job, node, run


def test_a_node_is_priced_per_gpu_of_its_model_plus_cpu_and_memory():
    # 2 T4, 104 vCPU, 512 GiB
    assert prices.node_price("T4", 2, 104_000, 512 * 1024) == pytest.approx(2 * 1.0 + 104 * 0.035 + 512 * 0.004)
    # the fit reproduces the figures it was fitted to (simcloud/harness.py), e.g. gn6v-c8g1.8xlarge at 10.4
    assert prices.node_price("V100M16", 4, 32_000, 128 * 1024) == pytest.approx(10.4, abs=0.05)
    with pytest.raises(ValueError, match=r"no per-GPU price for model 'H100'.*PER_GPU"):
        prices.node_price("H100", 8, 1000, 1024)


def test_billed_cost_is_price_times_powered_seconds():
    fleet = [node("a", 2, 16, model="T4")]                 # 2 + 16 * 0.035 + 64 * 0.004 = 2.816 / h
    jobs = [job("j", 0, 3600, gpus=1)]
    result = run(POLICIES["gpuboot"](spare_seconds=0), fleet, jobs, end=20_000, start_seconds=10, boot_seconds=10,
                 device_plugin_seconds=10, stop_seconds=5, idle_timeout=600)
    powered = 30 + 3600 + 600 + 5                          # boot, the job, the idle timeout, the stop
    assert result["billed_node_hours"] == pytest.approx(powered / 3600, abs=1e-3)
    assert result["billed_cost"] == pytest.approx(2.816 * powered / 3600, abs=0.01)


def test_lower_bound_charges_each_job_its_largest_share_of_the_cheapest_node_it_fits():
    fleet = [node("small", 1, 8, model="T4"), node("big", 4, 64, model="T4")]
    small, big = fleet[0].price_per_hour, fleet[1].price_per_hour
    one = job("one", 0, 3600, gpus=1, cpus=4)              # small: max(1/1, 4/8) = 1 x small; big: 1/4 x big
    two = job("two", 0, 7200, gpus=2, cpus=8)              # only big holds it: 2/4 of big for 2 h
    assert lower_bound_cost([one, two], fleet, end=10**6) == pytest.approx(min(small, big / 4) + big / 2 * 2)
    assert lower_bound_cost([two], fleet, end=3600) == pytest.approx(big / 2)      # clipped to the window


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_policy_beats_the_money_lower_bound(policy):
    fleet = [node("a", 2, 16), node("b", 4, 64, model="V100M16"), node("c", 1, 8, model="P100")]
    jobs = [job(f"j{i}", 100 * i, 500 + 300 * (i % 4), gpus=1 + i % 2, cpus=2) for i in range(20)]
    result = run(POLICIES[policy](), fleet, jobs, end=20_000)
    bound = lower_bound_cost(jobs, fleet, 20_000)
    assert result["jobs_never_placed"] == 0
    assert result["billed_cost"] >= bound > 0


def test_the_gap_to_the_bound_is_split_by_cause_and_adds_up():
    """One 2-GPU node, two 1-GPU jobs nearly one after the other, then idle: boots (booting +
    stopping), fragmentation (the empty GPU while one job runs), idle (the idle time), nothing else."""
    fleet = [node("a", 2, 2, mem_gib=8, model="T4")]     # 2 GPUs, 2 vCPU: a 1-GPU 1-vCPU job holds half
    price = fleet[0].price_per_hour
    jobs = [job("one", 0, 3600, gpus=1, mem_gib=1), job("two", 3600, 3600, gpus=1, mem_gib=1)]
    bound = lower_bound_cost(jobs, fleet, 20_000)
    sim = Simulation(fleet, jobs, POLICIES["gpuboot"](spare_seconds=0),
                     SimConfig(start=0, end=20_000, start_seconds=10, boot_seconds=10, device_plugin_seconds=10,
                               stop_seconds=5, idle_timeout=600))
    result = sim.run().summary(0.0, 0.0, bound)
    gap = result["gap_to_bound"]
    assert sum(gap.values()) == pytest.approx(result["billed_cost"] - bound, abs=0.02)
    assert gap["boots"] == pytest.approx(price * 35 / 3600, abs=0.01)               # 30 s boot + 5 s stop
    assert gap["idle"] == pytest.approx(price * 600 / 3600, abs=0.01)
    # busy from 30 s (the boot) to 7,200 s, the two jobs overlapping for 30 s: half the node unused but 30 s
    assert gap["fragmentation"] == pytest.approx(price * (7170 - 3600) / 3600, abs=0.01)
    assert gap["spare"] == gap["placement"] == 0
    assert gap["shift"] == 0            # both ran their whole run inside the window, as the bound counts them
    assert result["cost_ratio"] == pytest.approx(result["billed_cost"] / bound, rel=1e-3)


def test_the_whole_node_floor_powers_whole_nodes_for_the_summed_demand():
    fleet = [node("big", 8, 96, model="G2"), node("small", 2, 16, model="P100"), node("small2", 2, 16, model="P100")]
    big, small = fleet[0].price_per_hour, fleet[1].price_per_hour
    one = job("one", 0, 3600, gpus=1, cpus=4)
    assert whole_node_floor([one], fleet, 10**6) == pytest.approx(small)        # one small node for the hour
    three = [job(f"j{i}", 0, 3600, gpus=1, cpus=4) for i in range(3)]
    assert whole_node_floor(three, fleet, 10**6) == pytest.approx(min(2 * small, big))
    # jobs split across nodes in the relaxation: 9 GPUs need the big node and a small one
    nine = [job(f"k{i}", 0, 7200, gpus=1, cpus=1) for i in range(9)]
    assert whole_node_floor(nine, fleet, 10**6) == pytest.approx((big + small) * 2)
    assert whole_node_floor(nine, fleet, 3600) == pytest.approx(big + small)      # clipped to the window
    assert lower_bound_cost(nine, fleet, 10**6) <= whole_node_floor(nine, fleet, 10**6)


def test_an_empty_node_kept_as_the_spare_past_the_idle_time_is_billed_as_spare():
    fleet = [node("a", 2, 2, mem_gib=8, model="T4")]
    price = fleet[0].price_per_hour
    jobs = [job("one", 0, 3600, gpus=2, cpus=2, mem_gib=1)]                # fills the node: no fragmentation
    sim = Simulation(fleet, jobs, POLICIES["gpuboot"](spare_seconds=1200),
                     SimConfig(start=0, end=20_000, start_seconds=10, boot_seconds=10, device_plugin_seconds=10,
                               stop_seconds=5, idle_timeout=600))
    result = sim.run().summary(0.0, 0.0, lower_bound_cost(jobs, fleet, 20_000))
    gap = result["gap_to_bound"]
    assert gap["idle"] == pytest.approx(price * 600 / 3600, abs=0.01)       # the idle time, then
    assert gap["spare"] == pytest.approx(price * 1200 / 3600, abs=0.01)     # kept as the fleet's spare
    assert gap["fragmentation"] == pytest.approx(0, abs=0.01)
    assert sum(gap.values()) == pytest.approx(result["billed_cost"] - result["lower_bound_cost"], abs=0.02)


def test_boot_fill_from_load_boots_the_small_node_when_little_runs():
    """The gpu_job field, as the replay's jobs set it: one 1-GPU job on an idle fleet boots the
    cheapest node outright instead of the cheapest slot (placement.CostModel)."""
    fleet = [node("big", 8, 96, mem_gib=384, model="G2"), node("small", 2, 16, mem_gib=120, model="P100")]
    jobs = [job("one", 0, 3600, gpus=1, cpus=4)]
    today = run(POLICIES["gpuboot"](spare_seconds=0), fleet, jobs, end=20_000)
    filled = run(POLICIES["gpuboot"](spare_seconds=0, boot_fill_from_load=4), fleet, jobs, end=20_000)
    assert filled["billed_cost"] < today["billed_cost"]
    assert filled["billed_cost"] == pytest.approx(fleet[1].price_per_hour * (30 + 3600 + 600 + 5) / 3600, abs=0.01)

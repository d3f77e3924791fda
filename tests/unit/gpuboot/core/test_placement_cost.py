"""The cost ranking (pure): what one task on a node costs, and that the order stays state first."""
import pytest

from gpuboot.core.placement import DEFAULT_COST, CostModel, JobRequest, place
from gpuboot.core.resources import GPU
from tests.unit.gpuboot.core.test_placement import BOOTING, READY, STOPPED, STOPPING, chosen, job, nv, task

COST = CostModel(boot_seconds=180, stop_seconds=36, idle_seconds=540, run_hours=2.0, wait_usd_per_hour=20.0)


def test_cost_of_one_task_counts_the_hours_the_node_is_up_and_the_wait():
    need = task().requests                      # 1 GPU, 1 cpu: a 4-GPU node holds 4 copies
    up = nv("up", READY, gpus=4, price_per_hour=8.0)
    assert COST.per_task(up, need) == (True, pytest.approx(8.0 * 2.0 / 4))               # its share, no wait
    booting = nv("b", BOOTING, gpus=4, price_per_hour=8.0)
    assert COST.per_task(booting, need)[1] == pytest.approx(8.0 * 2.0 / 4 + 20.0 * 180 / 3600)
    stopped = nv("s", STOPPED, gpus=4, price_per_hour=8.0)
    hours = (180 + 540) / 3600 + 2.0            # the boot's billed time and the idle tail, then the run
    assert COST.per_task(stopped, need)[1] == pytest.approx(8.0 * hours / 4 + 20.0 * 180 / 3600)
    stopping = nv("x", STOPPING, gpus=4, price_per_hour=8.0)
    assert COST.per_task(stopping, need)[1] == pytest.approx(8.0 * hours / 4 + 20.0 * 216 / 3600)
    # a known duration replaces the default
    assert COST.per_task(up, need, run_hours=0.5)[1] == pytest.approx(8.0 * 0.5 / 4)
    # no price: GPU-hours per slot, and no wait term (no common unit)
    assert COST.per_task(nv("u", STOPPED, gpus=4), need) == (False, pytest.approx(4 * hours / 4))


def test_stranded_gpus_count_against_the_node():
    hungry = task(cpu="6").requests
    tight = nv("tight", READY, gpus=2, cpu="8", price_per_hour=4.0)      # feeds 1 of its 2 GPUs
    roomy = nv("roomy", READY, gpus=2, cpu="16", price_per_hour=4.0)
    assert COST.per_task(tight, hungry)[1] == pytest.approx(2 * COST.per_task(roomy, hungry)[1])


def test_state_beats_money_running_then_booting_then_stopped():
    dear_up = nv("dear-up", READY, gpus=1, price_per_hour=50.0)
    cheap_booting = nv("cheap-booting", BOOTING, gpus=1, price_per_hour=2.0)
    cheapest_stopped = nv("cheapest-stopped", STOPPED, gpus=1, price_per_hour=0.5)
    nodes = [dear_up, cheap_booting, cheapest_stopped]
    assert chosen(place(job(task()), nodes, cost=COST)) == {"t": "dear-up"}
    assert chosen(place(job(task()), nodes[1:], cost=COST)) == {"t": "cheap-booting"}


def test_within_a_state_the_cheapest_slot_wins_whatever_the_hours():
    """Hours are shared per slot, so they scale every node of one state alike (module doc)."""
    nodes = [nv("g1", STOPPED, gpus=1, price_per_hour=1.0),
             nv("g4", STOPPED, gpus=4, cpu="64", memory="256Gi", price_per_hour=3.6)]
    for run_seconds in (None, 60, 30 * 86400):
        request = JobRequest("j", (task(),), 1, expected_run_seconds=run_seconds)
        for model in (DEFAULT_COST, COST, CostModel(idle_seconds=0, boot_seconds=0)):
            assert chosen(place(request, nodes, cost=model)) == {"t": "g4"}      # 0.9 per slot vs 1.0


def test_the_cost_is_in_the_plan_for_audits():
    plan = place(job(task()), [nv("s", STOPPED, gpus=4, price_per_hour=8.0)], cost=COST)
    row = next(c for c in plan.candidates if c.node == "s")
    assert row.score[2] == pytest.approx(COST.per_task(nv("s", STOPPED, gpus=4, price_per_hour=8.0),
                                                       task().requests)[1], rel=1e-5)


@pytest.mark.parametrize("field", ["boot_seconds", "stop_seconds", "idle_seconds", "run_hours", "wait_usd_per_hour"])
def test_a_negative_cost_setting_is_refused_by_name(field):
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: -1})


def test_a_negative_expected_duration_is_refused_by_name():
    with pytest.raises(ValueError, match="expected_run_seconds"):
        JobRequest("j", (task(),), 1, expected_run_seconds=-5)


def test_boot_fill_from_load_prices_a_start_by_how_full_the_load_says_it_gets():
    """A start's hours are shared by at most N x the GPUs in use now (in copies of the task), not by
    every slot: with little running, the small node wins; with enough running, the big node's slot
    again; and a running node still beats any start (module doc)."""
    big = nv("big", STOPPED, gpus=8, cpu="96", memory="384Gi", price_per_hour=12.9)     # 1.61 per slot
    small = nv("small", STOPPED, gpus=2, cpu="16", memory="64Gi", price_per_hour=4.04)  # 2.02 per slot

    def request(fill):
        return JobRequest("j", (task(),), 1, boot_fill_from_load=fill)

    def busy(gpus):        # a running node with `gpus` GPUs in use and none free
        return nv("busy", READY, gpus=gpus, cpu="64", memory="256Gi", used={"cpu": "8", GPU: gpus},
                  price_per_hour=1.0)

    assert chosen(place(request(0), [big, small])) == {"t": "big"}                 # off: today's per slot
    assert chosen(place(request(4), [big, small])) == {"t": "small"}               # nothing runs: fill 1
    assert chosen(place(request(4), [big, small, busy(1)])) == {"t": "small"}      # 4 copies: 3.2 > 2.02
    assert chosen(place(request(4), [big, small, busy(2)])) == {"t": "big"}        # 8 copies: 1.61 < 2.02
    assert chosen(place(request(1), [big, small, busy(2)])) == {"t": "small"}      # 2 copies: 6.45 > 2.02
    roomy = nv("roomy", READY, gpus=8, cpu="96", memory="384Gi", price_per_hour=50.0)
    assert chosen(place(request(4), [big, small, roomy])) == {"t": "roomy"}        # running first, still
    with pytest.raises(ValueError, match="boot_fill_from_load: must be >= 0"):
        request(-1)

"""Placement with an insufficient-capacity cache: offerings out of stock and nodes that failed to boot."""
import random

import pytest

from gpuboot.core.model import NodeState, Unavailable, blocked_nodes
from gpuboot.core.placement import Outcome, place
from tests.unit.gpuboot.core.test_placement import BOOTING, READY, STOPPED, STOPPING, chosen, job, nv, task

ZONE = "cn-hangzhou-h"


def offering(itype, reason="OperationDenied.NoStock"):
    return Unavailable(reason=reason, expires_at=4e9, instance_type=itype, zone=ZONE)


def test_out_of_stock_offering_sends_the_job_to_the_next_stopped_candidate():
    nodes = [nv("cheap", STOPPED, instance_type="small", zone=ZONE, price_per_hour=1.0),
             nv("dear", STOPPED, instance_type="big", zone=ZONE, price_per_hour=3.0)]
    assert chosen(place(job(task()), nodes)) == {"t": "cheap"}
    plan = place(job(task()), nodes, unavailable=[offering("small")])
    assert chosen(plan) == {"t": "dear"} and plan.nodes_to_start == ("dear",)
    row = next(c for c in plan.candidates if c.node == "cheap")
    assert row.verdict == "excluded" and "offering small in cn-hangzhou-h unavailable" in row.reason
    assert "NoStock" in row.reason


@pytest.mark.parametrize("state", [READY, BOOTING])
def test_an_offering_out_of_stock_does_not_block_nodes_already_up(state):
    nodes = [nv("up", state, instance_type="small", zone=ZONE)]
    assert chosen(place(job(task()), nodes, unavailable=[offering("small")])) == {"t": "up"}


def test_offering_is_per_zone():
    nodes = [nv("other-zone", STOPPING, instance_type="small", zone="cn-hangzhou-i")]
    assert chosen(place(job(task()), nodes, unavailable=[offering("small")])) == {"t": "other-zone"}


def test_a_failed_node_is_blocked_in_any_state():
    nodes = [nv("bad", READY), nv("good", STOPPED)]
    bad = Unavailable(reason="not GPU-ready within 900s", expires_at=4e9, node="bad")
    plan = place(job(task()), nodes, unavailable=[bad])
    assert chosen(plan) == {"t": "good"}
    assert next(c for c in plan.candidates if c.node == "bad").verdict == "excluded"


def test_when_only_unavailable_capacity_could_hold_the_job_it_is_busy_not_never():
    nodes = [nv("only", STOPPED, gpus=2, instance_type="big", zone=ZONE)]
    plan = place(job(task(gpus=2)), nodes, unavailable=[offering("big")])
    assert plan.outcome is Outcome.BUSY
    assert "Unavailable for now: offering big in cn-hangzhou-h: OperationDenied.NoStock" in plan.message


def test_unavailable_needs_a_node_or_an_offering():
    with pytest.raises(ValueError, match="either node, or instance_type and zone"):
        Unavailable(reason="x", expires_at=1, instance_type="small")
    with pytest.raises(ValueError):
        Unavailable(reason="x", expires_at=1, instance_type="small", zone=ZONE, node="n")


def test_json_round_trip():
    for u in (offering("small"), Unavailable(reason="r", expires_at=5.0, node="n")):
        assert Unavailable.from_json(u.to_json()) == u


def test_blocked_nodes_finds_in_one_pass_what_each_mark_blocks():
    """model.blocked_nodes, the one-pass filter placement uses, against Unavailable.blocks node by node."""
    rng = random.Random(7)
    for _ in range(300):
        nodes = [nv(f"n{i}", rng.choice(list(NodeState)), instance_type=rng.choice(["a", "b", "c"]),
                    zone=rng.choice([ZONE, "cn-hangzhou-i"])) for i in range(rng.randint(0, 30))]
        marks = [Unavailable("NoStock", 4e9, instance_type=rng.choice(["a", "b", "x"]),
                             zone=rng.choice([ZONE, "cn-hangzhou-i"])) if rng.random() < 0.6 else
                 Unavailable("failed boot", 4e9, node=f"n{rng.randint(0, 40)}") for _ in range(rng.randint(0, 4))]
        assert blocked_nodes(marks, nodes) == [i for i, n in enumerate(nodes) if any(u.blocks(n) for u in marks)]

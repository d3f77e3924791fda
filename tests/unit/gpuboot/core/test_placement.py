"""Placement: per-node fit, running first, bin-packing, cheapest slot to boot, gangs, never vs busy."""
import json
import random

import pytest

from gpuboot.core.inventory import build_inventory
from gpuboot.core.model import NodeState, NodeView, Reservation
from gpuboot.core.placement import JobRequest, Outcome, Plan, TaskRequest, Verdict, place
from gpuboot.core.resources import GPU, Resources
from tests.builders import TYPES, instance, node, pod

READY, BOOTING, STOPPED, STOPPING, UNAVAILABLE = (NodeState.READY, NodeState.BOOTING, NodeState.STOPPED,
                                                  NodeState.STOPPING, NodeState.UNAVAILABLE)


def nv(name, state=READY, gpus=1, cpu="8", memory="32Gi", used=None, **kw):
    alloc = {"cpu": cpu, "memory": memory, **({GPU: gpus} if gpus else {})}
    return NodeView(name=name, hostname=f"host-{name}", state=state, reason=state.value,
                    allocatable=Resources.parse(alloc), allocated=Resources.parse(used or {}),
                    instance_id=f"i-{name}", instance_type=kw.pop("instance_type", f"type-{gpus}gpu"), **kw)


def task(name="t", gpus=1, cpu="1", memory="1Gi", **kw):
    return TaskRequest(name=name, requests=Resources.parse({"cpu": cpu, "memory": memory, GPU: gpus}), **kw)


def job(*tasks, min_available=None):
    return JobRequest(job_id="job-1", tasks=tuple(tasks), min_available=min_available or len(tasks))


def chosen(plan):
    return {a.task: a.node for a in plan.assignments}


def test_seed_regression_per_node_fit_never_cluster_free_plus_new_node():
    # 1 GPU free on a running node + a stopped 1-GPU node = 2 "cluster" GPUs; neither node holds 2 alone
    nodes = [nv("running", gpus=2, used={GPU: 1}), nv("stopped-1", STOPPED, gpus=1)]
    plan = place(job(task(gpus=2)), nodes)
    assert plan.outcome is Outcome.BUSY and not plan.assignments and not plan.nodes_to_start
    verdicts = {c.node: c.verdict for c in plan.candidates}
    assert verdicts == {"running": "busy", "stopped-1": "too small"}
    # a stopped 2-GPU node is the one to start
    plan = place(job(task(gpus=2)), [*nodes, nv("stopped-2", STOPPED, gpus=2)])
    assert plan.outcome is Outcome.FITS
    assert chosen(plan) == {"t": "stopped-2"} and plan.nodes_to_start == ("stopped-2",)
    assert plan.assignments[0].instance_id == "i-stopped-2" and plan.assignments[0].hostname == "host-stopped-2"


def test_running_node_beats_booting_beats_stopped_beats_stopping():
    nodes = [nv("d-stopping", STOPPING), nv("c-stopped", STOPPED), nv("b-booting", BOOTING), nv("a-ready", READY)]
    for _ in range(4):
        plan = place(job(task()), nodes)
        assert plan.outcome is Outcome.FITS
        winner = chosen(plan)["t"]
        assert winner == min(nodes, key=lambda n: ["ready", "booting", "stopped", "stopping"]
                             .index(n.state.value)).name
        nodes = [n for n in nodes if n.name != winner]
    # a bigger, emptier running node still beats a perfect-fit stopped one
    plan = place(job(task()), [nv("big", gpus=8), nv("exact", STOPPED, gpus=1)])
    assert chosen(plan) == {"t": "big"} and plan.nodes_to_start == ()


def test_stopping_node_is_started_when_chosen():
    plan = place(job(task()), [nv("s", STOPPING)])
    assert plan.outcome is Outcome.FITS and plan.nodes_to_start == ("s",)


def test_running_nodes_by_cost_per_slot_then_a_stable_order_not_fullest_first():
    """A running node is already paid for: the task's share is price (else GPUs) / slots, and
    twins keep a stable order (the name), so the same nodes absorb the arrivals and the others drain."""
    nodes = [nv("c-empty", gpus=4), nv("b-half", gpus=4, used={GPU: 2}), nv("a-almost", gpus=4, used={GPU: 3})]
    assert chosen(place(job(task()), nodes)) == {"t": "a-almost"}
    assert chosen(place(job(task(gpus=2)), nodes)) == {"t": "b-half"}      # a-almost has no room
    emptier_first = [nv("a-empty", gpus=4), nv("b-almost", gpus=4, used={GPU: 3})]
    assert chosen(place(job(task()), emptier_first)) == {"t": "a-empty"}   # load does not reorder twins
    # the cheaper slot wins over the name; a node whose CPU strands GPUs pays for them
    priced = [nv("a-dear", gpus=2, price_per_hour=4.0), nv("b-cheap", gpus=2, price_per_hour=3.0)]
    assert chosen(place(job(task()), priced)) == {"t": "b-cheap"}
    hungry = task(cpu="6")
    strands = [nv("a-tight", gpus=2, cpu="8"), nv("b-roomy", gpus=2, cpu="16")]   # a-tight feeds 1 of its 2 GPUs
    assert chosen(place(job(hungry), strands)) == {"t": "b-roomy"}
    # a gang's tasks go together where more of them fit
    gang = job(task("x"), task("y"))
    assert chosen(place(gang, [nv("a-one", gpus=4, used={GPU: 3}), nv("b-two", gpus=4, used={GPU: 2})])) == \
        {"x": "b-two", "y": "b-two"}


def test_stopped_nodes_by_cost_per_slot_then_size_then_headroom_then_name():
    """A slot = one copy of the task on the empty node; its cost = price (else GPUs) / slots."""
    # every node feeds all its GPUs (2 GPUs per slot): the smallest wins
    nodes = [nv("eight", STOPPED, gpus=8), nv("two", STOPPED, gpus=2), nv("four", STOPPED, gpus=4)]
    assert chosen(place(job(task(gpus=2)), nodes)) == {"t": "two"}
    # same size: the most CPU and memory per GPU (relative to the task) wins
    twins = [nv("lean", STOPPED, gpus=2, cpu="8"), nv("rich", STOPPED, gpus=2, cpu="48", memory="186Gi")]
    assert chosen(place(job(task()), twins)) == {"t": "rich"}
    # with prices, the cheapest slot wins, whatever the size; a priced node beats an unpriced one
    same = [nv("pricey", STOPPED, price_per_hour=9.0), nv("cheap", STOPPED, price_per_hour=1.5),
            nv("unknown", STOPPED)]
    assert chosen(place(job(task()), same)) == {"t": "cheap"}
    priced = [nv("g1", STOPPED, gpus=1, price_per_hour=1.0), nv("g4", STOPPED, gpus=4, price_per_hour=3.6,
                                                             cpu="64", memory="256Gi")]
    assert chosen(place(job(task()), priced)) == {"t": "g4"}          # 0.9 per slot vs 1.0
    assert chosen(place(job(task()), [nv("b", STOPPED), nv("a", STOPPED)])) == {"t": "a"}  # ties by name


def test_a_booted_node_never_strands_gpus_its_cpu_cannot_feed():
    """The old rule (least GPU left) booted `tight`: the task takes 12 of its 16 cpus, its 2nd GPU is dead.

    `roomy` holds two such tasks (1 GPU per slot, not 2), so the next task runs there without a boot."""
    hungry = {"gpus": 1, "cpu": "12", "memory": "48Gi"}
    nodes = [nv("tight", STOPPED, gpus=2, cpu="16", memory="64Gi"),
             nv("roomy", STOPPED, gpus=4, cpu="48", memory="192Gi"),
             nv("one", STOPPED, gpus=1, cpu="8", memory="32Gi")]          # too small: 8 cpu
    plan = place(job(task("a", **hungry)), nodes)
    assert chosen(plan) == {"a": "roomy"} and plan.nodes_to_start == ("roomy",)
    rows = {c.node: c for c in plan.candidates}
    assert rows["one"].verdict == "too small" and rows["tight"].score[2] == pytest.approx(2 * rows["roomy"].score[2], rel=1e-5)
    # roomy is up now, with the first task on it: the second task bin-packs there, no second boot
    up = [n if n.name != "roomy" else nv("roomy", READY, gpus=4, cpu="48", memory="192Gi",
                                          used={GPU: 1, "cpu": "12", "memory": "48Gi"}) for n in nodes]
    plan = place(job(task("b", **hungry)), up)
    assert chosen(plan) == {"b": "roomy"} and plan.nodes_to_start == ()


def test_gang_is_placed_only_when_min_available_fits():
    nodes = [nv("r1", gpus=1), nv("s1", STOPPED, gpus=1)]
    gang = job(task("w0"), task("w1"), task("w2"))
    plan = place(gang, nodes)
    assert plan.outcome is Outcome.NEVER and plan.nodes_to_start == () and plan.assignments == ()
    assert "needs 3 of 3 tasks" in plan.message
    plan = place(job(task("w0"), task("w1"), task("w2"), min_available=2), nodes)
    assert plan.outcome is Outcome.FITS and chosen(plan) == {"w0": "r1", "w1": "s1"}
    assert plan.nodes_to_start == ("s1",)
    # busy: the fleet holds the gang, but one node is in use now: nothing is started
    nodes = [nv("r1", gpus=1, used={GPU: 1}), nv("s1", STOPPED, gpus=1), nv("s2", STOPPED, gpus=1)]
    plan = place(job(task("w0"), task("w1"), task("w2")), nodes)
    assert plan.outcome is Outcome.BUSY and plan.nodes_to_start == () and plan.assignments == ()


def test_gang_tasks_share_a_node_by_capacity_not_by_count():
    plan = place(job(*(task(f"w{i}", gpus=2) for i in range(4))), [nv("s8", STOPPED, gpus=8), nv("s4", STOPPED, gpus=4)])
    assert plan.outcome is Outcome.FITS
    assert sorted(chosen(plan).values()) == ["s8"] * 4 and plan.nodes_to_start == ("s8",)
    plan = place(job(*(task(f"w{i}", gpus=4) for i in range(3))), [nv("s8", STOPPED, gpus=8), nv("s4", STOPPED, gpus=4)])
    assert sorted(chosen(plan).values()) == ["s4", "s8", "s8"] and plan.nodes_to_start == ("s4", "s8")


def test_heterogeneous_gang_places_the_biggest_first():
    plan = place(job(task("small", gpus=1), task("large", gpus=2)), [nv("a", gpus=2), nv("b", gpus=1)])
    assert chosen(plan) == {"large": "a", "small": "b"}


def test_never_fits_names_the_node_type_needed():
    nodes = [nv("a", STOPPED, gpus=4, instance_type="ecs.gn6v-c8g1.8xlarge", gpu_model="NVIDIA V100"),
             nv("b", READY, gpus=8, instance_type="ecs.gn7-c13g1.26xlarge", gpu_model="Tesla-T4")]
    plan = place(job(task(gpus=8, gpu_model="V100")), nodes)
    assert plan.outcome is Outcome.NEVER and not plan.nodes_to_start
    assert plan.message == ("task t: needs a node with 8 nvidia.com/gpu (model V100); the largest matching node "
                            "in this fleet has 4 (ecs.gn6v-c8g1.8xlarge)")
    plan = place(job(task(gpus=1, cpu="64")), nodes)
    assert plan.outcome is Outcome.NEVER and "needs a node with 64 cpu" in plan.message and "has 8" in plan.message
    plan = place(job(task(gpu_model="H100")), nodes)
    assert plan.outcome is Outcome.NEVER and "no node in this fleet matches" in plan.message


def test_busy_when_the_fleet_could_hold_it_once_free():
    nodes = [nv("a", gpus=2, used={GPU: 2}), nv("b", UNAVAILABLE, gpus=2)]
    plan = place(job(task(gpus=2)), nodes)
    assert plan.outcome is Outcome.BUSY and "a" in plan.message
    verdicts = {c.node: c.verdict for c in plan.candidates}
    assert verdicts == {"a": "busy", "b": "excluded"}


def test_busy_reason_names_the_jobs_holding_the_nodes_that_would_fit():
    now = 1_700_000_400.0
    nodes = [node("a", gpus=2, heartbeat=now), node("b", gpus=2, heartbeat=now)]
    instances = [instance(n, start=now - 600, gpus=2, itype="ecs.gn6i-c24g1.12xlarge") for n in ("a", "b")]
    pods = [pod("train-x", "a", requests={GPU: 2}, labels={"gpuboot.io/job": "gb-x", "gpuboot.io/task": "train-x"}),
            pod("notebook", "b", requests={GPU: 1}, namespace="lab")]
    held = [Reservation("gb-y", "sweep-3", "b", Resources({GPU: 1}), now + 60)]
    plan = place(job(task(gpus=2)), build_inventory(nodes, pods, instances, TYPES, held, now))
    assert plan.outcome is Outcome.BUSY
    assert plan.message.count("capacity busy") == 1
    reasons = {c.node: c.reason for c in plan.candidates}
    assert reasons["a"].endswith("; held by job gb-x (train-x)")
    assert reasons["b"].endswith("; held by pod lab/notebook, job gb-y (sweep-3, reserved)")
    assert plan.message.endswith("2 big-enough node(s) busy, e.g. a (free now: nvidia.com/gpu needs 2, has 0; held "
                                 "by job gb-x (train-x)); all 2 are held by job gb-x (train-x), pod lab/notebook, "
                                 "job gb-y (sweep-3, reserved)"), plan.message


def test_cpu_only_work_stays_off_gpu_nodes_unless_allowed():
    """Issue 9: a gpus: 0, cpu: 40 job booted a stopped GPU node."""
    nodes = [nv("cpu-small", gpus=0, cpu="8", gpu_model=None), nv("gpu-big", STOPPED, gpus=2, cpu="48",
                                                                 gpu_model="Tesla-T4")]
    cpu_job = job(task(gpus=0, cpu="40", avoid_gpu_nodes=True))
    plan = place(cpu_job, nodes)
    assert plan.outcome is Outcome.NEVER and plan.nodes_to_start == ()
    assert plan.message.endswith("has 8 (type-0gpu); 1 GPU node(s) left out: CPU-only work stays off GPU nodes, "
                                 "allow_gpu_nodes: true lets it on"), plan.message
    rows = {c.node: (c.verdict, c.reason) for c in plan.candidates}
    assert rows["gpu-big"] == ("excluded", ("CPU-only work stays off GPU nodes, allow_gpu_nodes: true lets it on "
                                           "(GPU node: Tesla-T4 x2)"))
    allowed = place(job(task(gpus=0, cpu="40")), nodes)
    assert chosen(allowed) == {"t": "gpu-big"} and allowed.nodes_to_start == ("gpu-big",)
    # a CPU node that fits is used either way; a GPU node stays available to GPU work
    assert chosen(place(job(task(gpus=0, cpu="4", avoid_gpu_nodes=True)), nodes)) == {"t": "cpu-small"}


def test_any_of_several_gpu_models_fits_a_node_of_any_of_them():
    """Issue 13: a job that accepts V100 16 GB or A10 (a list, or the trace's 'V100M16|A10') fits
    either; with the first absent it lands on the second; other models, and a V100 whose memory
    is unknown or 32 GB, are excluded, the reason naming every model the job accepts."""
    nodes = [nv("t4", gpus=1, gpu_model="Tesla-T4"),
             nv("v100-32", gpus=1, gpu_model="Tesla-V100-SXM2-32GB"),
             nv("v100-bare", gpus=1, gpu_model="NVIDIA V100"),
             nv("a10-stopped", STOPPED, gpus=1, gpu_model="NVIDIA-A10")]
    for models in (("V100M16", "A10"), "V100M16|A10", ["V100-16GB", "NVIDIA A10"]):
        plan = place(job(task(gpu_model=models)), nodes)
        assert chosen(plan) == {"t": "a10-stopped"} and plan.nodes_to_start == ("a10-stopped",)
    rows = {c.node: (c.verdict, c.reason) for c in plan.candidates}
    assert rows["t4"] == ("excluded", "GPU model Tesla-T4 is not V100-16GB or NVIDIA A10")
    assert rows["v100-32"][0] == rows["v100-bare"][0] == "excluded"
    # with a node of the first model running, it wins (running beats stopped), whatever the list's order
    nodes.append(nv("v100-16", gpus=1, gpu_model="Tesla-V100-SXM2-16GB"))
    assert chosen(place(job(task(gpu_model=("A10", "V100M16"))), nodes)) == {"t": "v100-16"}
    plan = place(job(task(gpus=2, gpu_model=("V100M16", "A10"))), nodes)
    assert plan.outcome is Outcome.NEVER and "(model V100M16 or A10)" in plan.message, plan.message
    plan = place(job(task(gpu_model="H100|H800")), nodes)
    assert plan.outcome is Outcome.NEVER and "matches its constraints (model H100 or H800)" in plan.message


def test_node_selector_taints_and_gpu_model_are_honoured():
    nodes = [nv("plain", gpus=1, gpu_model="NVIDIA-A10"),
             nv("pool", gpus=1, labels={"pool": "train"}, gpu_model="Tesla-T4"),
             nv("tainted", gpus=1, gpu_model="Tesla-T4", labels={"pool": "train"},
                taints=({"key": "dedicated", "value": "ml", "effect": "NoSchedule"},))]
    assert chosen(place(job(task(node_selector={"pool": "train"})), nodes))["t"] == "pool"
    assert chosen(place(job(task(gpu_model="A10")), nodes))["t"] == "plain"
    assert chosen(place(job(task(gpu_model="NVIDIA T4")), nodes))["t"] == "pool"
    only_tainted = [nodes[2]]
    plan = place(job(task()), only_tainted)
    assert plan.outcome is Outcome.NEVER and "dedicated=ml:NoSchedule not tolerated" in plan.message
    for toleration in ({"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
                       {"key": "dedicated", "operator": "Exists"}, {"operator": "Exists"}):
        assert place(job(task(tolerations=(toleration,))), only_tainted).outcome is Outcome.FITS
    assert place(job(task(tolerations=({"key": "dedicated", "value": "other"},))), only_tainted).outcome \
        is Outcome.NEVER
    # PreferNoSchedule never excludes
    soft = [nv("soft", taints=({"key": "x", "effect": "PreferNoSchedule"},))]
    assert place(job(task()), soft).outcome is Outcome.FITS


def test_down_node_taints_are_ignored_on_stopped_and_booting_nodes_only():
    down = ({"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"})
    assert place(job(task()), [nv("s", STOPPED, taints=down)]).outcome is Outcome.FITS
    assert place(job(task()), [nv("b", BOOTING, taints=down)]).outcome is Outcome.FITS
    plan = place(job(task()), [nv("r", READY, taints=down)])
    assert plan.outcome is not Outcome.FITS


def test_reservations_are_counted_through_the_inventory():
    now = 1_700_000_400.0
    nodes = [node("a", gpus=2, heartbeat=now), node("b", gpus=2, ready="Unknown")]
    instances = [instance("a", start=now - 600, gpus=2, itype="ecs.gn6i-c24g1.12xlarge"),
                 instance("b", "Stopped", gpus=2, itype="ecs.gn6i-c24g1.12xlarge")]
    held = [Reservation("other-job", "x", "a", Resources({GPU: 2}), now + 60)]
    views = build_inventory(nodes, [], instances, TYPES, held, now)
    plan = place(job(task(gpus=2)), views)
    assert chosen(plan) == {"t": "b"} and plan.nodes_to_start == ("b",)
    # two runs never get the same GPU: the first plan's reservation blocks the second
    first = [Reservation("j1", a.task, a.node, a.requests, now + 60) for a in plan.assignments]
    views = build_inventory(nodes, [], instances, TYPES, held + first, now)
    assert place(job(task(gpus=2)), views).outcome is Outcome.BUSY
    # the reservation expires: capacity returns
    views = build_inventory(nodes, [], instances, TYPES, held + first, now + 61)
    assert place(job(task(gpus=2)), views).outcome is Outcome.FITS


def test_pods_fill_nodes_through_the_inventory():
    now = 1_700_000_400.0
    nodes = [node("a", heartbeat=now)]
    views = build_inventory(nodes, [pod("p", "a", requests={GPU: 1})], [instance("a", start=now - 600)], TYPES, [], now)
    assert place(job(task()), views).outcome is Outcome.BUSY


def test_deterministic_regardless_of_input_order():
    nodes = [nv(f"n{i:02d}", random.Random(i).choice([READY, STOPPED, BOOTING]), gpus=random.Random(i).choice([1, 2, 4]))
             for i in range(30)]
    gang = job(*(task(f"w{i}", gpus=2) for i in range(5)))
    first = place(gang, nodes)
    for seed in range(5):
        shuffled = nodes[:]
        random.Random(seed).shuffle(shuffled)
        assert place(gang, shuffled) == first


def test_plan_json_round_trip_and_table():
    nodes = [nv("r", gpus=2, used={GPU: 1}), nv("s1", STOPPED), nv("s2", STOPPED, gpus=2),
             nv("x", UNAVAILABLE)]
    plan = place(job(task("w0", gpus=2), task("w1")), nodes)
    data = json.loads(json.dumps(plan.to_json(), allow_nan=False))
    assert Plan.from_json(data) == plan
    table = plan.table().splitlines()
    assert table[0].split()[:4] == ["TASK", "NODE", "PREFER", "VERDICT"]
    assert "GPU LEFT" in table[0] and "COST PER SLOT" in table[0] and "SCORE" not in table[0]
    assert len(table) == 1 + len(plan.candidates)
    assert any("w0" in row and "s2" in row and "chosen" in row and "stopped" in row for row in table)
    assert any("x" in row.split() and "excluded" in row for row in table)
    # words, not the raw sort key: the running node left with 0 GPUs after w1, the stopped 2-GPU
    # node's slot costs 2 GPUs (no price), memory in Kubernetes quantities
    r_row = next(row for row in table if row.split()[:2] == ["w1", "r"])
    assert r_row.split()[2:6] == ["running", "chosen", "1", "0"]
    s2_row = next(row for row in table if row.split()[:2] == ["w0", "s2"])
    assert "2 GPU (no price)" in s2_row and "Gi" in s2_row
    assert all(isinstance(c.verdict, Verdict) for c in plan.candidates)
    assert plan.assignment_for("w1").node == "r"


def test_invalid_job_requests_are_refused():
    with pytest.raises(ValueError, match="min_available"):
        JobRequest("j", (task(),), 2)
    with pytest.raises(ValueError, match="unique"):
        JobRequest("j", (task("a"), task("a")), 1)
    with pytest.raises(ValueError, match="at least one task"):
        JobRequest("j", (), 1)


def big_fleet(n):
    states = [READY, READY, STOPPED, BOOTING]
    return [nv(f"node-{i:05d}", states[i % 4], gpus=[1, 2, 4, 8][i % 4], cpu="32", memory="128Gi",
               used={GPU: 1 if states[i % 4] is READY and i % 3 == 0 else 0, "cpu": "10"})
            for i in range(n)]


def test_large_fleet_plans_keep_the_candidate_table_bounded():
    """Timing lives in `make bench`; here only what a 10,000-node plan must contain."""
    nodes = big_fleet(10_000)
    plan = place(job(task(gpus=2)), nodes)
    assert plan.outcome is Outcome.FITS and len(plan.candidates) <= 500 and plan.candidates_omitted > 0
    plan = place(job(*(task(f"w{i}", gpus=2) for i in range(64))), nodes)
    assert plan.outcome is Outcome.FITS and len(plan.assignments) == 64


def test_plans_and_views_survive_deepcopy_and_pickle():
    import copy
    import pickle
    nodes = [nv("r", labels={"pool": "a"}), nv("s", STOPPED, gpus=2)]
    plan = place(job(task(gpus=2)), nodes)
    assert pickle.loads(pickle.dumps(plan)) == plan and copy.deepcopy(plan) == plan
    assert pickle.loads(pickle.dumps(nodes)) == nodes


def test_among_equal_running_nodes_the_oldest_work_takes_the_task_and_an_empty_node_comes_last():
    """The node whose work has run longest most likely stays up anyway (module doc): new work goes
    there, so the nodes of young work can drain; a node with nothing on it is the last choice."""
    nodes = [nv("a-empty", gpus=4), nv("b-young", gpus=4, used={GPU: 1}, busy_since=9_000.0),
             nv("c-old", gpus=4, used={GPU: 3}, busy_since=1_000.0), nv("d-mid", gpus=4, used={GPU: 1},
                                                                       busy_since=5_000.0)]
    plan = place(job(task()), nodes)
    assert chosen(plan) == {"t": "c-old"}
    # a gang: more of its tasks on one node comes first, then the oldest work: d-mid holds all three
    assert set(chosen(place(job(*(task(f"t{i}") for i in range(3))), nodes)).values()) == {"d-mid"}
    fits = [c.node for c in plan.candidates if c.verdict in (Verdict.CHOSEN, Verdict.FITS)]
    assert fits == ["c-old", "d-mid", "b-young", "a-empty"]       # the table in the order of the decision
    assert plan.candidates[0].reason.endswith("; work since 1970-01-01 00:16:40 UTC")
    assert json.loads(json.dumps(plan.to_json()))["candidates"][0]["score"][-2:] == [0, 1000.0]


def test_the_oldest_work_never_beats_a_cheaper_slot_or_the_state():
    nodes = [nv("dear-old", gpus=1, price_per_hour=9.0, busy_since=1.0, used={"cpu": "1"}),
             nv("cheap-young", gpus=1, price_per_hour=1.0, busy_since=9.0, used={"cpu": "1"}),
             nv("booting", BOOTING, gpus=1, price_per_hour=0.5)]
    assert chosen(place(job(task()), nodes)) == {"t": "cheap-young"}


def test_twins_that_differ_only_in_their_work_are_judged_once_and_taken_oldest_first(monkeypatch):
    from gpuboot.core import placement as P
    calls = []
    real = P._score
    monkeypatch.setattr(P, "_score", lambda *args: calls.append(1) or real(*args))
    nodes = [nv(f"n{i:04d}", gpus=2, used={GPU: 1}, busy_since=float(10_000 - i)) for i in range(1000)]
    for n in nodes[1:]:
        object.__setattr__(n, "twin", nodes[0].twin)     # one twin token, as build_inventory gives them
    plan = place(job(task(), task("u")), nodes)
    assert chosen(plan) == {"t": "n0999", "u": "n0998"} and len(calls) <= 4


def test_a_job_only_nodes_that_failed_for_it_could_hold_can_never_run_rather_than_wait():
    """Issue 35 #2: the only 2-GPU node failed this job's boot: BUSY would wait out the queue timeout."""
    from gpuboot.core.model import Unavailable
    fleet = [nv("big", STOPPED, gpus=2), nv("small", READY, gpus=1)]
    failed = Unavailable(reason="failed for this job: not GPU-ready within 900 s", expires_at=float("inf"), node="big",
                         failed_for_job=True)
    plan = place(job(task(gpus=2)), fleet, [failed])
    assert plan.outcome is Outcome.NEVER
    assert plan.message.startswith("it fits this fleet only with node(s) that already failed for it: big (failed "
                                   "for this job: not GPU-ready within 900 s)")
    # a mark that expires (the node unavailable to everyone for a while), or a queue's hold for another
    # job (no expiry, but not this job's failure), leaves the job waiting
    marked = Unavailable(reason="not GPU-ready within 900 s", expires_at=1e12, node="big")
    held = Unavailable(reason="held for job other", expires_at=float("inf"), node="big")
    assert place(job(task(gpus=2)), fleet, [marked]).outcome is Outcome.BUSY
    assert place(job(task(gpus=2)), fleet, [held]).outcome is Outcome.BUSY
    # another node it fits: still only busy while that one is taken
    fleet.append(nv("big2", READY, gpus=2, used={GPU: 2}))
    assert place(job(task(gpus=2)), fleet, [failed]).outcome is Outcome.BUSY


def test_a_plan_asked_for_few_rows_words_only_those_and_the_same_choice():
    """A batch's answer keeps a few rows: the plan puts only those into words (the chosen one first) and
    counts the rest, and the choice is the one the full table would show."""
    nodes = big_fleet(2_000)
    full, few = place(job(task(gpus=2)), nodes), place(job(task(gpus=2)), nodes, table_rows=3)
    assert few.assignments == full.assignments
    assert len(few.candidates) == 3 and few.candidates[0].verdict is Verdict.CHOSEN
    assert len(few.candidates) + few.candidates_omitted == len(full.candidates) + full.candidates_omitted
    assert len(place(job(task(gpus=2)), nodes, table_rows=0).candidates) == 1     # the chosen row always

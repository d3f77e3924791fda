"""place() against a straightforward reference placer on seeded random fleets.

place() judges each class of twin nodes once, keeps a lazy heap of classes and puts into words
only the candidate rows it keeps. The reference here does none of that: it filters, scores and
describes every node for every step with the same policy functions (_node_exclusion and
_twin_exclusion, _score and the row wording), picks the minimum by a linear scan, sorts every row
and cuts the table. The plans
must be identical, field for field, including the candidate table and its omitted count.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from gpuboot.core import placement as P
from gpuboot.core.model import FrozenDict, NodeState, NodeView, Unavailable
from gpuboot.core.placement import Candidate, JobRequest, Outcome, TaskRequest, Verdict, place
from gpuboot.core.resources import CPU, GPU, MEMORY, Resources
from gpuboot.core.timefmt import utc

GI = 2**30
MODELS = ["Tesla-T4", "NVIDIA-A10", "Tesla-V100-SXM2-16GB", "Tesla-V100-SXM2-32GB", "NVIDIA V100", None]
TAINTS = [{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
          {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
          {"key": "gpu", "value": "only", "effect": "NoSchedule"},
          {"key": "noisy", "effect": "PreferNoSchedule"}]


# --- the reference -------------------------------------------------------------

def reference_place(job: JobRequest, nodes, unavailable=()) -> dict:
    nodes = sorted(nodes, key=lambda n: n.name)
    groups = shape_groups(job, nodes, whole_fleet=False, unavailable=unavailable)
    placed = greedy(groups, nodes)
    rows = every_row(groups, nodes, placed)
    chosen = [c for c in rows if c.verdict is Verdict.CHOSEN]
    others = [c for c in rows if c.verdict is not Verdict.CHOSEN][:max(0, P._TABLE_LIMIT - len(chosen))]
    kept = sorted(chosen + others, key=P._row_order)
    out = {"placed": {t: nodes[i].name for t, i in placed.items()}, "candidates": tuple(kept),
           "omitted": len(rows) - len(kept), "rows": rows}
    if len(placed) >= job.min_available:
        out["outcome"] = Outcome.FITS
    else:
        empty = [replace(n, state=NodeState.READY, reason="empty", allocated=Resources()) for n in nodes]
        fleet = greedy(shape_groups(job, empty, whole_fleet=True), empty)
        out["outcome"] = Outcome.NEVER if len(fleet) < job.min_available else Outcome.BUSY
    return out


def exclusion(task, node, whole_fleet, unavailable):
    """Why `task` may never run on `node` (None = it may): the node's own reasons first, as place() asks."""
    return P._node_exclusion(task, node, whole_fleet, unavailable) or P._twin_exclusion(task, node, whole_fleet)


def shape_groups(job, nodes, whole_fleet, unavailable=()):
    """[(tasks, {node index: exclusion reason or None})], biggest shape first, as place() orders them."""
    by_shape: dict[tuple, tuple[list, dict]] = {}
    for task in sorted(job.tasks, key=lambda t: (-t.requests.gpus, -t.requests.get(CPU), -t.requests.get(MEMORY),
                                                 t.name)):
        if task.shape() not in by_shape:
            by_shape[task.shape()] = ([], {i: exclusion(task, n, whole_fleet, unavailable)
                                           for i, n in enumerate(nodes)})
        by_shape[task.shape()][0].append(task)
    return list(by_shape.values())


def greedy(groups, nodes) -> dict[str, int]:
    """Each step: score every eligible node on what is free now, the lowest (score, work order,
    name) takes as many of the remaining tasks as it holds."""
    free = [n.free for n in nodes]
    placed = {}
    for tasks, why in groups:
        need, pending = tasks[0].requests, list(tasks)
        while pending:
            scored = [(s[0], P._work_order([nodes[i]]), nodes[i].name, i, s[1]) for i in why if why[i] is None
                      if (s := P._score(nodes[i], free[i], need, len(pending)))]
            if not scored:
                break
            _, _, _, i, k = min(scored)
            for task in pending[:k]:
                placed[task.name] = i
            free[i] = free[i] - Resources({name: amount * k for name, amount in need.items()})
            del pending[:k]
    return placed


def every_row(groups, nodes, placed) -> list[Candidate]:
    rows = []
    for tasks, why in groups:
        first, need = tasks[0], tasks[0].requests
        for i, node in enumerate(nodes):
            if why[i] is not None:
                rows.append(Candidate(first.name, node.name, node.state, Verdict.EXCLUDED, why[i], None))
            elif not need.fits_in(node.allocatable):
                rows.append(Candidate(first.name, node.name, node.state, Verdict.TOO_SMALL,
                                      f"capacity: {P._short(need, node.allocatable)}", None))
            elif not need.fits_in(node.free):
                rows.append(Candidate(first.name, node.name, node.state, Verdict.BUSY,
                                      f"free now: {P._short(need, node.free)}{P._held_by(node)}", None))
            else:
                score, k = P._score(node, node.free, need, len(tasks))
                verdict = Verdict.CHOSEN if placed.get(first.name) == i else Verdict.FITS
                since = "" if node.busy_since is None else f"; work since {utc(node.busy_since)}"
                rows.append(Candidate(first.name, node.name, node.state, verdict,
                                      f"{node.reason}; free {node.free}{since}", P._ranked(score, node),
                                      P._facts(node, need, k)))
        for task in tasks[1:]:
            if task.name in placed:
                node = nodes[placed[task.name]]
                rows.append(Candidate(task.name, node.name, node.state, Verdict.CHOSEN,
                                      f"same shape as {first.name}", None))
    return sorted(rows, key=P._row_order)


# --- random fleets and jobs ----------------------------------------------------

def random_fleet(rng: random.Random, size: int) -> list[NodeView]:
    """Nodes drawn from a few templates, so that many are twins (equal in all but name), some sharing
    their vectors (as build_inventory makes them), some only equal; every field varies somewhere.
    In half the fleets a template's twins also share a twin token, as build_inventory gives them: a
    node keeps it when only what is its own (name, labels, offering, reason) differs."""
    def draw(field, gpus=None):
        gpus = rng.choice([0, 1, 2, 4, 8]) if gpus is None else gpus
        return {
            "state": lambda: rng.choice(list(NodeState)),
            "allocatable": lambda: Resources({CPU: rng.choice([4000, 8000, 32000, 64000]),
                                              MEMORY: rng.choice([16, 32, 128, 256]) * GI, GPU: gpus,
                                              **({"example.com/fpga": 1} if rng.random() < 0.1 else {})}),
            "allocated": lambda: Resources({CPU: rng.choice([0, 1000, 4000, 40000]), MEMORY: rng.choice([0, 8, 64]) * GI,
                                            GPU: rng.randint(0, gpus)}),
            "gpu_model": lambda: rng.choice(MODELS) if gpus else None,
            "price_per_hour": lambda: rng.choice([None, 1.2, 2.5, 2.5, 9.0]),
            "labels": lambda: rng.choice([{}, {"pool": "a"}, {"pool": "b"}]),
            "taints": lambda: tuple(rng.sample(TAINTS, rng.choice([0, 0, 1, 2]))),
            "instance_type": lambda: rng.choice(["ecs.a", "ecs.b"]),
            "zone": lambda: rng.choice(["z1", "z2"]),
            "managed": lambda: rng.random() < 0.5,
            "busy_since": lambda: rng.choice([None, None, 1000.0, 2000.0, 3000.0]),
        }[field]()

    fields = ["state", "allocatable", "allocated", "gpu_model", "price_per_hour", "labels", "taints", "instance_type",
              "zone", "managed", "busy_since"]
    own = {"labels", "instance_type", "zone", "managed", "busy_since"}     # not read by _twin_inputs
    templates, tokens, share_tokens = [], {}, rng.random() < 0.5
    for _ in range(rng.randint(1, 6)):
        gpus = rng.choice([0, 1, 2, 4, 8])
        templates.append({f: draw(f, gpus) for f in fields})
    nodes = []
    for n in range(size):
        which = rng.randrange(len(templates))
        t, token = dict(templates[which]), which
        if rng.random() < 0.5:    # equal, not shared
            t["allocatable"], t["allocated"] = Resources(dict(t["allocatable"])), Resources(dict(t["allocated"]))
        if rng.random() < 0.3:    # a twin but for one field
            field = rng.choice(fields)
            t[field] = draw(field, t["allocatable"].gpus)
            token = token if field in own else None
        name = f"n{rng.randint(0, 10**6):07d}-{n}"
        nodes.append(NodeView(name=name, hostname=f"h-{name}", reason=f"{t['state'].value} {n}",
                              labels=FrozenDict(t.pop("labels")), instance_id=f"i-{n}",
                              holders=tuple(f"pod ns/p{n}-{k}" for k in range(rng.randint(0, 5))), **t))
        if share_tokens and token is not None:
            object.__setattr__(nodes[-1], "twin", tokens.setdefault(token, nodes[-1].twin))
    rng.shuffle(nodes)
    return nodes


def random_job(rng: random.Random) -> JobRequest:
    tasks = []
    for s in range(rng.randint(1, 3)):
        requests = Resources({CPU: rng.choice([500, 1000, 4000, 16000]), MEMORY: rng.choice([1, 4, 16, 64]) * GI,
                              GPU: rng.choice([0, 1, 1, 2, 4])})
        shape = {"requests": requests, "node_selector": rng.choice([{}, {}, {"pool": "a"}]),
                     "tolerations": rng.choice([(), ({"key": "gpu", "operator": "Exists"},)]),
                     "gpu_model": rng.choice([(), (), ("T4",), ("V100M16", "A10"), ("V100",), "V100M32|T4"]),
                     "avoid_gpu_nodes": not requests.gpus and rng.random() < 0.5}
        tasks += [TaskRequest(f"s{s}-t{k}", **shape) for k in range(rng.choice([1, 1, 2, 5, 12]))]
    rng.shuffle(tasks)
    return JobRequest("job", tuple(tasks), rng.randint(1, len(tasks)))


def random_unavailable(rng: random.Random, nodes) -> list[Unavailable]:
    marks = []
    for node in rng.sample(nodes, min(len(nodes), rng.choice([0, 0, 1, 3]))):
        marks.append(Unavailable("failed boot", 1e12, node=node.name) if rng.random() < 0.5 else
                     Unavailable("NoStock", 1e12, instance_type=node.instance_type, zone=node.zone))
    return marks


@pytest.mark.parametrize("limit", [P._TABLE_LIMIT, 7])
def test_place_matches_the_reference_on_random_fleets(monkeypatch, limit):
    """The default table limit, and a small one that cuts the table inside every kind of row."""
    monkeypatch.setattr(P, "_TABLE_LIMIT", limit)
    rng = random.Random(20261201 + limit)
    outcomes, examples = set(), 0
    for case in range(400):
        nodes = random_fleet(rng, rng.choice([0, 1, 3, 10, 40]))
        job, unavailable = random_job(rng), random_unavailable(rng, nodes)
        plan, want = place(job, nodes, unavailable), reference_place(job, nodes, unavailable)
        where = f"case {case}: {job}\n{nodes}\n{unavailable}"
        assert plan.outcome is want["outcome"], where
        assert plan.candidates == want["candidates"], where
        assert plan.candidates_omitted == want["omitted"], where
        outcomes.add(plan.outcome)
        if plan.outcome is Outcome.FITS:
            assert {a.task: a.node for a in plan.assignments} == want["placed"], where
        elif plan.outcome is Outcome.BUSY:
            assert not plan.assignments
            busy: dict[str, list[Candidate]] = {}
            for c in want["rows"]:      # in table order: the first busy node of a shape is its example
                if c.verdict is Verdict.BUSY:
                    busy.setdefault(c.task, []).append(c)
            for task, rows in busy.items():
                if f". {task}: " in plan.message:
                    examples += 1
                    assert (f". {task}: {len(rows)} big-enough node(s) busy, e.g. {rows[0].node} ({rows[0].reason})"
                            in plan.message), where
    assert examples > 10
    assert outcomes == set(Outcome)


def test_twins_are_judged_once_not_once_per_node(monkeypatch):
    """The memo the speed rests on: 2,000 twins cost one score for the table, not 2,000."""
    calls = []
    real = P._score
    monkeypatch.setattr(P, "_score", lambda *args: calls.append(1) or real(*args))
    alloc, used = Resources({CPU: 8000, MEMORY: 32 * GI, GPU: 2}), Resources({GPU: 1})
    nodes = [NodeView(name=f"n{i:05d}", hostname=f"n{i}", state=NodeState.READY, reason="up", allocatable=alloc,
                      allocated=used) for i in range(2000)]
    plan = place(JobRequest("j", (TaskRequest("t", Resources({CPU: 1000, GPU: 1})),), 1), nodes)
    assert plan.assignment_for("t").node == "n00000" and len(calls) <= 3


def test_the_never_check_on_the_first_emptied_twins_agrees_with_the_whole_fleet():
    """BUSY or NEVER is decided on the first k of each class of emptied twins (k = the job's tasks):
    the same answer as on every node, on fleets where that list is much shorter."""
    rng = random.Random(20261202)
    shrunk = 0
    for case in range(400):
        nodes = sorted(random_fleet(rng, rng.choice([3, 10, 40, 120])), key=lambda n: n.name)
        job = random_job(rng)
        job = replace(job, tasks=tuple(replace(t, node_selector={}) for t in job.tasks))
        firsts = P._first_empty_twins(nodes, len(job.tasks))
        holds = [len(P._emptied(job, fleet)[2]) >= job.min_available for fleet in (firsts, nodes)]
        assert holds[0] == holds[1], f"case {case}: {job}\n{nodes}"
        shrunk += len(firsts) * 2 <= len(nodes)
    assert shrunk > 50


def test_a_busy_job_does_not_copy_every_node(monkeypatch):
    """2,000 busy twins: the never-fits check empties one of them, not 2,000; NEVER still counts all."""
    copies = []
    real = P._empty
    monkeypatch.setattr(P, "_empty", lambda node: copies.append(1) or real(node))
    alloc = Resources({CPU: 8000, MEMORY: 32 * GI, GPU: 2})
    nodes = [NodeView(name=f"n{i:05d}", hostname=f"n{i}", state=NodeState.READY, reason="up", allocatable=alloc,
                      allocated=Resources({GPU: 2})) for i in range(2000)]
    busy = place(JobRequest("j", (TaskRequest("t", Resources({CPU: 1000, GPU: 1})),), 1), nodes)
    assert busy.outcome is Outcome.BUSY and len(copies) <= 2
    copies.clear()
    never = place(JobRequest("j", (TaskRequest("t", Resources({CPU: 1000, GPU: 4})),), 1), nodes)
    assert never.outcome is Outcome.NEVER and "has 2 " in never.message and len(copies) >= 2000


def test_a_fleet_updated_view_by_view_plans_as_the_views_it_holds_would():
    """`Fleet` (a batch's views prepared once): after any run of updates (a view changed, so a new twin
    token; a view turned into another's twin, sharing its token; a token's first node leaving it) it holds
    what a fleet prepared afresh from its views holds, and every plan on it is the plan on those views."""
    rng = random.Random(20261207)
    for case in range(150):
        nodes = random_fleet(rng, rng.choice([1, 3, 10, 40]))
        fleet = P.Fleet(nodes)
        for step in range(12):
            changed = []
            for view in rng.sample(fleet.nodes, rng.randint(1, min(4, len(fleet.nodes)))):
                if rng.random() < 0.5:
                    changed.append(replace(view, allocated=view.allocatable if rng.random() < 0.3 else Resources(),
                                           busy_since=rng.choice([None, 500.0, 4000.0])))
                else:           # now the twin of another node: equal in all it is judged by, its token shared
                    other = rng.choice(fleet.nodes)
                    twin = replace(other, name=view.name, hostname=view.hostname, instance_id=view.instance_id)
                    object.__setattr__(twin, "twin", other.twin)
                    changed.append(twin)
            fleet.update(changed)
            fresh = P.Fleet(fleet.nodes, in_name_order=True)
            where = f"case {case} step {step}"
            assert fleet.nodes == fresh.nodes and fleet.order == fresh.order, where
            assert fleet.tokens == fresh.tokens and fleet.firsts == fresh.firsts, where
            job = random_job(rng)
            unavailable = random_unavailable(rng, fleet.nodes)
            assert place(job, fleet, unavailable) == place(job, list(fleet.nodes), unavailable), where

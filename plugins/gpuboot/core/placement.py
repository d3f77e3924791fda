"""Where each task of a job goes: per-node fit, running nodes first, then what the decision costs.

Pure and deterministic, so that the DAGs and the trace replay share it unchanged.
A task fits a node only when that node's own free capacity covers every resource it
asks for, never because "cluster free + new node" covers it: free capacity spread over
other nodes cannot run the task, so that sum boots nodes too small for it. Cost is
O(nodes) per distinct task shape plus O(log nodes) per task, so a 64-task gang over
10,000 nodes stays fast: nodes alike in all a verdict reads (twins: same state, capacity,
usage, price, GPU model, taints; the inventory gives them one twin token) are judged once
per shape, the per-node steps run in C, and of the candidate table only the rows kept
(_TABLE_LIMIT) are put into words; the rest are counted.

Cost model (`CostModel`, per task, USD). Putting a task on a node pays for the node for as
long as the decision keeps it up, and makes the job wait:

    cost = price * (overhead_h + run_h) / slots  +  wait_usd_per_hour * wait_h

* `price`: the node's hourly price (ECS DescribePrice, or the gpuboot.io/price-per-hour
  override; unpriced nodes use their GPU count instead and rank after every priced one);
* `overhead_h`: what a start adds whatever the job does: the boot's billed time before the
  job runs plus the idle tail before scale-down stops the node (0 for a node already up);
* `run_h`: the job's expected duration when the spec gives it, else `run_hours`;
* `slots`: copies of the task the empty node holds. The hours are shared by the tasks the
  node carries while it is up, so a task pays its slot's share, and a node whose CPU or
  memory cannot feed all its GPUs pays for the GPUs it strands. A job may say how full a node
  it starts will get instead (`JobRequest.boot_fill_from_load` = N, the gpu_job field of that
  name): at most N times the GPUs in use now on the running and booting nodes, in copies of the
  task (at least one), so on a fleet whose demand seldom fills a large node a start goes to a
  small one (docs/performance.md, How far from the bound: N = 4 is 27 % cheaper on the trace's
  shared-GPU variant, 6-12 % dearer on the default trace and its other variants, where long
  jobs then stay on small nodes; so it is off unless a job asks);
* `wait_h`: the job's wait, the boot delay for a node that needs a start (plus the stop
  for one still stopping), at `wait_usd_per_hour` (default 10 USD per job-hour, an
  operator's value of a job's time; see the sweep in docs/performance.md to choose it from data).

Order: the state first (running beats booting beats stopped beats stopping: a start is
never traded for money), then the cost, then more of the job's tasks on one node, then
(nodes needing a start) the smaller node and the most CPU and memory per GPU, then the
oldest work first (a node without work last), then the name. Because the hours are shared
per slot, the cost ranks nodes of one state by price per slot whatever the hours; the hours
and the wait make the figure a decision's real cost (shown in the table and kept in the
score for audits).

Among running nodes of equal cost, the one whose oldest work started earliest
(`NodeView.busy_since`) takes the task, and an empty node comes last. What a task costs
there is how much longer it keeps the node up, and a job's duration is unknown at arrival
but heavy-tailed (on the openb trace the few jobs longer than a day hold most of the
GPU-hours, and a job that has run a day most likely runs another): a node whose work has
run longest will most likely stay up anyway, so a task that turns out long costs least
there, and the nodes of younger work drain and stop. On the replay it is cheaper than a
stable name order, but keeps less slack up, so on its own it boots about twice as often;
the scale-down's spare rule (gpuboot.core.idle.IdleRule) buys that back (docs/performance.md,
Trace replay). The order is not part of a node's verdict or twin token: _judge sorts each
class's nodes by it, so twins are still judged once. Fullest-first is not used: it drains
the node that has just lost a job instead, and on the replay it costs more than even a
stable name order (CHANGELOG.md, Trace replay and the idle rules). The score only grows as
the remaining task count drops, which keeps the lazy heap in _assign exact.
"""
from __future__ import annotations

import collections
import functools
import heapq
import itertools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from gpuboot.core.inventory import gpu_model_alternatives, gpu_model_matches
from gpuboot.core.model import NOT_READY_TAINTS, STATE_RANK, FrozenDict, NodeState, NodeView, Unavailable, blocked_nodes
from gpuboot.core.resources import CPU, GPU, MEMORY, Resources, format_quantity
from gpuboot.core.timefmt import utc

# taints a stopped or booting node carries only because it is down; they go away at boot
_CORDON_TAINT = "node.kubernetes.io/unschedulable"
_OFF_GPU_NODES = "CPU-only work stays off GPU nodes, allow_gpu_nodes: true lets it on"
_TABLE_LIMIT = 500   # candidate rows kept in XCom / the task log; the rest are counted
_NO_LIMIT = 1 << 30


HOUR = 3600.0


@dataclass(frozen=True)
class CostModel:
    """What placement counts as a decision's cost (module doc). The replay passes its own delays."""

    boot_seconds: float = 150.0        # billed before the job runs: ECS start + kubelet + device plugin
    stop_seconds: float = 30.0         # a Stopping node finishes stopping before it can start again
    idle_seconds: float = 600.0        # the idle tail before scale-down stops the node
    run_hours: float = 1.0             # a job's duration when its spec does not say
    wait_usd_per_hour: float = 10.0    # what one hour of a job's wait is worth
    start_fill: float | None = None    # copies of a task a started node is expected to carry (None: all it holds)

    def __post_init__(self):
        for name in ("boot_seconds", "stop_seconds", "idle_seconds", "run_hours", "wait_usd_per_hour"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost model: {name} must be >= 0, got {getattr(self, name)}")

    def per_task(self, node: NodeView, need: Resources, run_hours: float | None = None) -> tuple[bool, float]:
        """(priced, cost of one task on `node`) in USD, or in GPU-hours when the node has no price."""
        slots: float = max(1, _fit_count(node.allocatable, need, _NO_LIMIT))
        rank = STATE_RANK[node.state]
        start = rank >= 2
        if start and self.start_fill is not None:
            slots = min(slots, max(1.0, self.start_fill))
        wait = (self.boot_seconds + (self.stop_seconds if rank == 3 else 0.0)) if rank >= 1 else 0.0
        hours = (self.boot_seconds + self.idle_seconds) / HOUR if start else 0.0
        hours += self.run_hours if run_hours is None else run_hours
        priced = node.price_per_hour is not None
        rate = node.price_per_hour if node.price_per_hour is not None else float(node.allocatable.gpus)
        return priced, rate * hours / slots + (self.wait_usd_per_hour * wait / HOUR if priced else 0.0)


DEFAULT_COST = CostModel()


@dataclass(frozen=True)
class TaskRequest:
    name: str
    requests: Resources
    node_selector: Mapping[str, str] = field(default_factory=FrozenDict)
    tolerations: tuple[dict, ...] = ()
    gpu_model: tuple[str, ...] = ()   # the models it accepts, any one will do ('A|B' or one name: normalized)
    avoid_gpu_nodes: bool = False     # CPU-only work kept off GPU nodes (never boots or holds one)

    def __post_init__(self):
        object.__setattr__(self, "node_selector", FrozenDict(self.node_selector or {}))
        object.__setattr__(self, "gpu_model", gpu_model_alternatives(self.gpu_model))
        object.__setattr__(self, "tolerations", tuple(dict(t) for t in self.tolerations))

    def to_json(self) -> dict:
        return {"name": self.name, "requests": self.requests.to_json(), "node_selector": dict(self.node_selector),
                "tolerations": list(self.tolerations), "gpu_model": self.gpu_model,
                "avoid_gpu_nodes": self.avoid_gpu_nodes}

    @classmethod
    def from_json(cls, d: Mapping) -> TaskRequest:
        return cls(d["name"], Resources.from_json(d["requests"]), d.get("node_selector") or {},
                   tuple(d.get("tolerations") or ()), tuple(gpu_model_alternatives(d.get("gpu_model"))),
                   bool(d.get("avoid_gpu_nodes")))

    def shape(self) -> tuple:
        """Tasks with equal shapes are interchangeable for placement."""
        return (self.requests, tuple(sorted(self.node_selector.items())),
                tuple(tuple(sorted(t.items())) for t in self.tolerations), self.gpu_model, self.avoid_gpu_nodes)


@dataclass(frozen=True)
class JobRequest:
    job_id: str
    tasks: tuple[TaskRequest, ...]
    min_available: int
    expected_run_seconds: float | None = None   # how long the job runs, when its spec says
    boot_fill_from_load: float = 0.0    # > 0: a start is shared by this times the GPUs in use (CostModel doc)

    def __post_init__(self):
        if self.expected_run_seconds is not None and self.expected_run_seconds < 0:
            raise ValueError(f"job {self.job_id}: expected_run_seconds: must be >= 0, got {self.expected_run_seconds}")
        if self.boot_fill_from_load < 0:
            raise ValueError(f"job {self.job_id}: boot_fill_from_load: must be >= 0 (0: off), "
                             f"got {self.boot_fill_from_load}")
        if not self.tasks:
            raise ValueError(f"job {self.job_id}: tasks: a job needs at least one task")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"job {self.job_id}: tasks: task names must be unique, got {names}")
        if not 1 <= self.min_available <= len(self.tasks):
            raise ValueError(f"job {self.job_id}: min_available: must be between 1 and "
                             f"{len(self.tasks)} (the number of tasks), got {self.min_available}")

    def to_json(self) -> dict:
        """What placement needs of the job, and nothing else (no command, env or image): the form a
        batch placer reads it in from the ledger (gpuboot.lifecycle.batching)."""
        return {"job_id": self.job_id, "tasks": [t.to_json() for t in self.tasks], "min_available": self.min_available,
                "expected_run_seconds": self.expected_run_seconds, "boot_fill_from_load": self.boot_fill_from_load}

    @classmethod
    def from_json(cls, d: Mapping) -> JobRequest:
        return cls(d["job_id"], tuple(TaskRequest.from_json(t) for t in d["tasks"]), int(d["min_available"]),
                   d.get("expected_run_seconds"), float(d.get("boot_fill_from_load") or 0.0))


class Outcome(str, Enum):
    FITS = "fits"
    BUSY = "busy"
    NEVER = "never"


class Verdict(str, Enum):
    """What placement made of one node for one task (a str, so plans stay plain JSON)."""

    CHOSEN = "chosen"
    FITS = "fits"
    BUSY = "busy"              # would fit the empty node, not what is free now
    TOO_SMALL = "too small"    # would not fit even the empty node
    EXCLUDED = "excluded"      # a filter (state, selector, taint, GPU model, mark) rules it out


# What the PREFER column calls each state: running beats booting beats stopped.
_PREFER = {NodeState.READY: "running", NodeState.BOOTING: "booting", NodeState.STOPPED: "stopped",
           NodeState.STOPPING: "stopping", NodeState.UNAVAILABLE: "unavailable"}


@dataclass(frozen=True)
class Candidate:
    """One row of the decision. `score` is the raw sort key (kept in the XCom JSON for audits);
    `facts` says the same in words for the table: tasks placed here, what is left, the cost."""

    task: str
    node: str
    state: NodeState
    verdict: Verdict
    reason: str
    score: tuple | None
    facts: Mapping[str, str] = field(default_factory=FrozenDict)


@dataclass(frozen=True)
class Assignment:
    task: str
    node: str
    hostname: str
    instance_id: str | None
    state: NodeState
    requests: Resources


@dataclass(frozen=True)
class Plan:
    job_id: str
    outcome: Outcome
    message: str
    assignments: tuple[Assignment, ...] = ()
    nodes_to_start: tuple[str, ...] = ()
    candidates: tuple[Candidate, ...] = ()
    candidates_omitted: int = 0     # rows left out of `candidates` to keep XCom and logs small

    def assignment_for(self, task: str) -> Assignment | None:
        return next((a for a in self.assignments if a.task == task), None)

    def table(self) -> str:
        """Every candidate as a fixed-width table a person can read: the state preference, the
        verdict, how many of the job's tasks go there, what the node has left after them
        (running/booting nodes are bin-packed), the cost of a slot (stopped nodes: the node's
        price, or its GPUs when unpriced, per copy of the task it can hold), and why."""
        header = ("TASK", "NODE", "PREFER", "VERDICT", "TASKS", "GPU LEFT", "CPU LEFT", "MEM LEFT", "COST PER SLOT",
                  "REASON")
        keys = ("tasks", "gpu_left", "cpu_left", "mem_left", "cost_per_slot")
        rows = [(c.task, c.node, _PREFER[c.state], Verdict(c.verdict).value,
                 *(c.facts.get(k, "-") for k in keys), c.reason) for c in self.candidates]
        n = len(header) - 1
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(n)]
        lines = ["  ".join(str(v).ljust(w) for v, w in zip(r[:n], widths)) + "  " + r[n]
                 for r in [header, *rows]]
        if self.candidates_omitted:
            lines.append(f"... {self.candidates_omitted} more candidate rows omitted")
        return "\n".join(line.rstrip() for line in lines)

    def to_json(self) -> dict:
        return {
            "job_id": self.job_id,
            "outcome": self.outcome.value,
            "message": self.message,
            "assignments": [{"task": a.task, "node": a.node, "hostname": a.hostname,
                             "instance_id": a.instance_id, "state": a.state.value,
                             "requests": a.requests.to_json()} for a in self.assignments],
            "nodes_to_start": list(self.nodes_to_start),
            "candidates": [{"task": c.task, "node": c.node, "state": c.state.value,
                            "verdict": Verdict(c.verdict).value, "reason": c.reason,
                            "score": None if c.score is None else list(c.score), "facts": dict(c.facts)}
                           for c in self.candidates],
            "candidates_omitted": self.candidates_omitted,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> Plan:
        return cls(
            job_id=d["job_id"],
            outcome=Outcome(d["outcome"]),
            message=d["message"],
            assignments=tuple(Assignment(task=a["task"], node=a["node"], hostname=a["hostname"],
                                         instance_id=a.get("instance_id"), state=NodeState(a["state"]),
                                         requests=Resources.from_json(a["requests"]))
                              for a in d.get("assignments", ())),
            nodes_to_start=tuple(d.get("nodes_to_start", ())),
            candidates=tuple(Candidate(task=c["task"], node=c["node"], state=NodeState(c["state"]),
                                       verdict=Verdict(c["verdict"]), reason=c["reason"],
                                       score=None if c["score"] is None else tuple(c["score"]),
                                       facts=FrozenDict(c.get("facts") or {}))
                             for c in d.get("candidates", ())),
            candidates_omitted=int(d.get("candidates_omitted", 0)),
        )


def _facts(node: NodeView, need: Resources, k: int) -> FrozenDict:
    """The table's words for a node that fits: k tasks here, what is left after them, a slot's cost."""
    return _facts_of(node.free, node.allocatable, node.price_per_hour, STATE_RANK[node.state] >= 2, need, k)


@functools.lru_cache(maxsize=1024)
def _facts_of(free: Resources, allocatable: Resources, price: float | None, needs_start: bool, need: Resources,
              k: int) -> FrozenDict:
    """_facts, remembered: the table repeats the same few words across twin nodes."""
    gpu, cpu, memory = (free.get(name) - k * need.get(name) for name in (GPU, CPU, MEMORY))
    facts = {"tasks": str(k), "gpu_left": str(gpu), "cpu_left": format_quantity(CPU, cpu),
             "mem_left": format_quantity(MEMORY, memory)}
    if price is not None:   # the node's USD per hour: the run page prices the hours the run kept it
        facts["price_per_hour"] = f"{price:g}"
    if needs_start:     # what one slot of the task costs
        slots = _fit_count(allocatable, need, _NO_LIMIT)
        facts["cost_per_slot"] = (f"{price / slots:.4g}/h" if price is not None
                                  else f"{allocatable.gpus / slots:g} GPU (no price)")
    return FrozenDict(facts)


# --- filters -------------------------------------------------------------------

def _tolerates(tolerations: Sequence[Mapping], taint: Mapping) -> bool:
    """k8s Toleration.ToleratesTaint, true when any of `tolerations` matches."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("key") and t["key"] != taint.get("key"):
            continue
        if t.get("operator") == "Exists" or (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _node_exclusion(task: TaskRequest, node: NodeView, whole_fleet: bool,
                    unavailable: Sequence[Unavailable]) -> str | None:
    """Why `task` may never run on `node`, regardless of load, for what is the node's own: its
    condition, name and labels (None = nothing here; `_twin_exclusion` checks the rest, after this).
    `whole_fleet` ignores the node's condition and unavailability, both temporary (the "never fits"
    check)."""
    if not whole_fleet and node.state not in STATE_RANK:
        return f"node {node.state.value}: {node.reason}"
    if not whole_fleet:
        for u in unavailable:
            if u.blocks(node):
                return f"{u.what} unavailable: {u.reason}"
    for key, value in task.node_selector.items():
        if node.labels.get(key) != value:
            return f"nodeSelector {key}={value} (node has {node.labels.get(key, 'no such label')})"
    return None


def _twin_exclusion(task: TaskRequest, node: NodeView, whole_fleet: bool, models: dict | None = None) -> str | None:
    """Why `task` may never run on `node` for what twins share (`_twin_inputs`): GPU model and count,
    taints, state. `models` caches the GPU model verdicts across the nodes of one task."""
    if task.gpu_model and not _accepts(task, node.gpu_model, {} if models is None else models):
        return f"GPU model {node.gpu_model or 'none'} is not {_models(task)}"
    if task.avoid_gpu_nodes and (node.allocatable.gpus or node.gpu_model):
        return f"{_OFF_GPU_NODES} (GPU node: {node.gpu_model or 'GPU'} x{node.allocatable.gpus})"
    down = whole_fleet or node.state is not NodeState.READY
    for taint in node.taints:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if (down and taint.get("key") in NOT_READY_TAINTS) or (whole_fleet and taint.get("key") == _CORDON_TAINT):
            continue
        if not _tolerates(task.tolerations, taint):
            return f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} not tolerated"
    return None


def _accepts(task: TaskRequest, model: str | None, seen: dict) -> bool:
    if model not in seen:
        seen[model] = gpu_model_matches(task.gpu_model, model)
    return seen[model]


def _models(task: TaskRequest) -> str:
    """'T4', or 'V100M16 or V100M32' for a task that accepts several models."""
    return " or ".join(task.gpu_model)


@functools.lru_cache(maxsize=1024)
def _words(resources: Resources) -> str:
    """str(resources), remembered: the table repeats the same few vectors across twin nodes."""
    return str(resources)


@functools.lru_cache(maxsize=1024)
def _short(need: Resources, have: Resources) -> str:
    return ", ".join(f"{name} needs {format_quantity(name, need[name])}, has {format_quantity(name, have.get(name, 0))}"
                     for name in need.shortfall(have))


def _fit_count(free: Mapping[str, int], need: Resources, limit: int) -> int:
    """How many copies of `need` fit in `free` (at most `limit`)."""
    return need.copies_in(free, limit)


def _headroom(node: NodeView, need: Resources) -> float:
    """The node's CPU and memory per GPU as a multiple of the task's own (the scarcer of the two)."""
    if not need.gpus or not node.allocatable.gpus:
        return 0.0
    per_gpu = need.gpus / node.allocatable.gpus
    ratios = [node.allocatable.get(name) * per_gpu / need.get(name) for name in (CPU, MEMORY) if need.get(name) > 0]
    return min(ratios, default=0.0)


def _score(node: NodeView, free: Resources, need: Resources, remaining: int,
           cost: CostModel = DEFAULT_COST, run_hours: float | None = None) -> tuple[tuple, int] | None:
    """(score, k): k = how many of the `remaining` same-shape tasks go on this node; None if none fits.

    Lower wins (module doc): the state, a priced node before an unpriced one, the task's cost
    (rounded to 1e-9, so that equal costs tie and fall to the name), more tasks on
    this node; for a node needing a start, then the smaller node (least waste if no other task
    comes) and the most CPU and memory per GPU relative to the task (the next, hungrier
    tasks still find CPU next to each free GPU)."""
    k = _fit_count(free, need, remaining)
    if k == 0:
        return None
    rank = STATE_RANK[node.state]
    priced, each = cost.per_task(node, need, run_hours)
    key = (rank, 0 if priced else 1, round(each, 9), -k)
    if rank <= 1:
        return key, k
    return (*key, node.allocatable.gpus, -_headroom(node, need)), k


_busy_since = operator.attrgetter("busy_since")


def _work_order(nodes: Sequence[NodeView]) -> list[float]:
    """Per node, what ranks nodes of equal score: the start of its oldest work, earliest first, and
    a node without work (busy_since None: empty, or not running) last (module doc)."""
    return [math.inf if t is None else t for t in map(_busy_since, nodes)]


def _ranked(score: tuple, node: NodeView) -> tuple:
    """A candidate row's score with the node's work order, which ranks twins: (0, start) or (1, 0.0)
    for none (JSON has no infinity)."""
    return (*score, 1, 0.0) if node.busy_since is None else (*score, 0, node.busy_since)


# All that `_score` and `_twin_exclusion` read of a node, by value: nodes with equal inputs (twins)
# get equal verdicts and scores, so placement judges each class of twins once. Keep it in step with
# both (tests/unit/gpuboot/core/test_placement_reference.py checks plans against a placer that judges
# every node) and with the key of inventory._share_twin.
def _twin_inputs(node: NodeView) -> tuple:
    return (node.state, node.allocatable, node.allocated, *_fixed_inputs(node))


def _fixed_inputs(node: NodeView) -> tuple:
    """The twin inputs that emptying a node (`_empty`) leaves as they are."""
    return (node.price_per_hour, node.gpu_model, tuple(tuple(sorted(t.items())) for t in node.taints))


_twin_token = operator.attrgetter("twin")


def _tokens(nodes: Sequence[NodeView]) -> tuple[list, dict]:
    """Each node's twin token, and each token's first node (its index)."""
    tokens = list(map(_twin_token, nodes))
    return tokens, dict(zip(reversed(tokens), range(len(nodes) - 1, -1, -1)))


class Fleet:
    """Node views prepared for many plans on them: in name order, with each one's work order and twin
    token (`_work_order`, `_tokens`). A batch places hundreds of jobs on the same 10,000 views, each plan
    changing a few (gpuboot.lifecycle.batching), and preparing the views anew took half of every plan.
    `place` takes one where it takes a sequence; `update` swaps changed views in, by name."""

    def __init__(self, nodes: Iterable[NodeView], in_name_order: bool = False) -> None:
        self.nodes = list(nodes) if in_name_order else sorted(nodes, key=operator.attrgetter("name"))
        self.order = _work_order(self.nodes)
        self.tokens, self.firsts = _tokens(self.nodes)
        self.at = {n.name: i for i, n in enumerate(self.nodes)}

    def update(self, views: Iterable[NodeView]) -> None:
        """Each view in place of the fleet's view of that name; the work order and twin tokens kept in
        step (a token's first node moves on when its first node changes token)."""
        for view in views:
            i = self.at[view.name]
            old, new = self.tokens[i], view.twin
            self.nodes[i], self.tokens[i] = view, new
            self.order[i] = math.inf if view.busy_since is None else view.busy_since
            if old is new:
                continue
            if self.firsts.get(old) == i:
                try:
                    self.firsts[old] = self.tokens.index(old, i + 1)
                except ValueError:      # its last node
                    del self.firsts[old]
            if self.firsts.get(new, i + 1) > i:
                self.firsts[new] = i


# --- the greedy placer -----------------------------------------------------------

@dataclass
class _Group:
    """Interchangeable tasks, the nodes they may never use (and why: static filters done once), and
    what the first task makes of each other node on its free capacity (`_judge`)."""

    tasks: list[TaskRequest]
    excluded: dict[int, str] = field(default_factory=dict)     # node -> why, in node order
    too_small: list[int] = field(default_factory=list)     # would not fit even the empty node
    busy: list[int] = field(default_factory=list)          # would fit the empty node, not its free capacity
    # the fitting nodes by class of twins: (_score on the free capacity, k), its nodes in name order
    classes: list[tuple[tuple[tuple, int], list[int]]] = field(default_factory=list)
    verdicts: list[int] = field(default_factory=list)      # per node: its index into classes, if it fits
    order: list[float] = field(default_factory=list)       # per node: _work_order, among equal scores

    def fits(self, i: int) -> tuple[tuple, int]:
        """(score, k) of a node that fits."""
        return self.classes[self.verdicts[i]][0]

    def eligible(self, nodes: Sequence[NodeView]) -> list[int]:
        """The nodes the group may use, now or once capacity frees up."""
        return [i for i in range(len(nodes)) if i not in self.excluded]


def _groups(job: JobRequest, fleet: Fleet, whole_fleet: bool, unavailable: Sequence[Unavailable] = (),
            cost: CostModel = DEFAULT_COST, run_hours: float | None = None, blocked: Sequence[int] = ()
            ) -> list[_Group]:
    """The job's tasks by shape, each group judged against every node (`_judge`); `blocked`: the
    nodes `unavailable` blocks (model.blocked_nodes)."""
    by_shape: dict[tuple, list[TaskRequest]] = {}
    # biggest tasks first (first-fit decreasing), stable by name for determinism
    ordered = sorted(job.tasks, key=lambda t: (-t.requests.gpus, -t.requests.get(CPU),
                                                -t.requests.get(MEMORY), t.name))
    for task in ordered:
        by_shape.setdefault(task.shape(), []).append(task)
    nodes, tokens, firsts = fleet.nodes, fleet.tokens, fleet.firsts
    groups = [_Group(tasks, order=fleet.order) for tasks in by_shape.values()]
    for group in groups:
        _judge(group, nodes, tokens, firsts, whole_fleet, unavailable, blocked, cost, run_hours)
    return groups


# _judge's verdicts besides a fitting class's index (>= 0): too small, busy, excluded by the node's
# own state, and excluded for a reason twins share (_EXCLUDED - the reason's index)
_TOO_SMALL, _BUSY, _DOWN, _EXCLUDED = -1, -2, -3, -4


def _judge(group: _Group, nodes: Sequence[NodeView], tokens: list, firsts: dict, whole_fleet: bool,
           unavailable: Sequence[Unavailable], blocked: Sequence[int], cost: CostModel,
           run_hours: float | None) -> None:
    """The group's first task against every node: excluded (and why), else too small, busy, or fits
    with its score on the node's free capacity: the candidate table's verdicts, and the first heap
    of _assign.

    Twins are judged once, on the first node of a twin token, whose verdict its twins take. A token
    not met yet is matched by value (`_twin_inputs`) with the tokens judged so far, so nodes that do
    not share a token are still scored once per class. The per-node steps run in C (map, dict,
    sort), but `_node_exclusion` for every node when the task has a nodeSelector, else for the nodes
    whose reason is their own: their state rules them out, or an unavailable mark blocks them
    (`blocked`, found by model.blocked_nodes in one pass)."""
    task = group.tasks[0]
    need, count = task.requests, len(group.tasks)
    models: dict[str | None, bool] = {}     # node model -> accepted: a fleet has few models
    by_value: dict[tuple, int] = {}
    reasons: list[str] = []
    verdict_of: dict[object, int] = {}     # twin token -> verdict
    for token, i in sorted(firsts.items(), key=operator.itemgetter(1)):
        node = nodes[i]
        c = by_value.get(inputs := _twin_inputs(node))
        if c is None:
            if not whole_fleet and node.state not in STATE_RANK:
                c = _DOWN
            elif (why := _twin_exclusion(task, node, whole_fleet, models)) is not None:
                c = _EXCLUDED - len(reasons)
                reasons.append(why)
            elif not need.fits_in(node.allocatable):
                c = _TOO_SMALL
            elif not need.fits_in(node.free):
                c = _BUSY
            else:
                c = len(group.classes)
                score = _score(node, node.free, need, count, cost, run_hours)
                assert score is not None, "need fits in node.free: one copy at least"
                group.classes.append((score, []))
            by_value[inputs] = c
        verdict_of[token] = c
    verdicts = group.verdicts = list(map(verdict_of.__getitem__, tokens))
    # the nodes by verdict, each verdict's in node order (a stable sort)
    order = sorted(range(len(nodes)), key=verdicts.__getitem__)
    by_verdict, at = {}, 0
    for c, n in sorted(collections.Counter(verdicts).items()):
        by_verdict[c], at = order[at:at + n], at + n
    # exclusions of the node's own, in node order: then the shared ones, merged in node order
    own: Sequence[int]
    if task.node_selector:
        own = range(len(nodes))
    else:
        own = sorted({*by_verdict.get(_DOWN, ()), *blocked}) if blocked else by_verdict.get(_DOWN, ())
    excluded = {i: why for i in own if (why := _node_exclusion(task, nodes[i], whole_fleet, unavailable))}
    shared = [(i, reasons[_EXCLUDED - c]) for c in by_verdict if c <= _EXCLUDED
              for i in by_verdict[c] if i not in excluded]     # a node's own reason comes first (_node_exclusion)
    if shared:
        excluded = dict(sorted(itertools.chain(excluded.items(), shared)))
    group.excluded = excluded

    def kept(c: int) -> list[int]:     # the nodes of verdict c not excluded by their own reason
        members = by_verdict.get(c, [])
        return [i for i in members if i not in excluded] if excluded else members

    group.too_small, group.busy = kept(_TOO_SMALL), kept(_BUSY)
    for c, (_, members) in enumerate(group.classes):
        members.extend(kept(c))
        if len(members) > 1:      # oldest work first; a stable sort keeps names in order
            members.sort(key=group.order.__getitem__)


def _assign(groups: list[_Group], nodes: Sequence[NodeView], cost: CostModel = DEFAULT_COST,
            run_hours: float | None = None) -> dict[str, int]:
    """Greedy per shape: the best node takes as many of the remaining tasks as it holds, and so on.

    Lazy heap: a popped node is re-scored with the current remaining count; since scores
    only grow, an unchanged score is the true best. The heap starts with the first node of each
    class of twins `_judge` found (the next one enters when it pops: twins tie, and ties go by
    _work_order, then name) and each node an earlier shape took capacity from, so work is
    O(nodes) per shape to find the classes plus O(log nodes) per task.
    """
    placed: dict[str, int] = {}
    changed: dict[int, Resources] = {}     # what is left on the nodes tasks were placed on
    for group in groups:
        need, pending = group.tasks[0].requests, list(group.tasks)
        queues = [(scored[0], [i for i in members if i not in changed] if changed else members)
                  for scored, members in group.classes]
        order = group.order
        heap = [(score, order[members[0]], nodes[members[0]].name, members[0], q, 0)
                for q, (score, members) in enumerate(queues) if members]
        for i in [j for j in changed if j not in group.excluded]:     # the eligible ones
            scored = _score(nodes[i], changed[i], need, len(pending), cost, run_hours)
            if scored:
                heap.append((scored[0], order[i], nodes[i].name, i, -1, 0))
        heapq.heapify(heap)
        while pending and heap:
            score, rank, name, i, q, at = heapq.heappop(heap)
            if q >= 0 and at + 1 < len(queues[q][1]):     # its twin next in its class's order takes its place
                j = queues[q][1][at + 1]
                heapq.heappush(heap, (score, order[j], nodes[j].name, j, q, at + 1))
            free = changed[i] if i in changed else nodes[i].free
            rescored = _score(nodes[i], free, need, len(pending), cost, run_hours)
            if rescored is None:
                continue
            current, k = rescored
            if current != score:
                heapq.heappush(heap, (current, rank, name, i, -1, 0))
                continue
            for task in pending[:k]:
                placed[task.name] = i
            changed[i] = free - Resources({n: a * k for n, a in need.items()})
            del pending[:k]
    return placed


_VERDICT_ORDER = {Verdict.CHOSEN: 0, Verdict.FITS: 1, Verdict.BUSY: 2, Verdict.TOO_SMALL: 3, Verdict.EXCLUDED: 4}


def _row_order(c: Candidate) -> tuple:
    return (c.task, _VERDICT_ORDER[c.verdict], c.score or (), c.node)


def _held_by(node: NodeView, limit: int = 3) -> str:
    """'; held by job X (task), pod ns/name': who would have to finish for the node to fit."""
    if not node.holders:
        return ""
    more = f" and {len(node.holders) - limit} more" if len(node.holders) > limit else ""
    return f"; held by {', '.join(node.holders[:limit])}{more}"


def _row(group: _Group, nodes: Sequence[NodeView], i: int, verdict: Verdict) -> Candidate:
    """The candidate row of node `i` for the group's first task, in words."""
    first, node = group.tasks[0], nodes[i]
    need = first.requests
    if verdict is Verdict.EXCLUDED:
        return Candidate(first.name, node.name, node.state, verdict, group.excluded[i], None)
    if verdict is Verdict.TOO_SMALL:
        return Candidate(first.name, node.name, node.state, verdict, f"capacity: {_short(need, node.allocatable)}",
                         None)
    if verdict is Verdict.BUSY:
        return Candidate(first.name, node.name, node.state, verdict,
                         f"free now: {_short(need, node.free)}{_held_by(node)}", None)
    score, k = group.fits(i)
    since = "" if node.busy_since is None else f"; work since {utc(node.busy_since)}"     # what ranks twins
    return Candidate(first.name, node.name, node.state, verdict, f"{node.reason}; free {_words(node.free)}{since}",
                     _ranked(score, node), _facts(node, need, k))


def _best_fits(group: _Group, pick: int | None, take: int) -> list[int]:
    """The first `take` fitting nodes but `pick` in table order (score, work order, then name), from
    the classes: sorted by score, twins already in that order, classes of equal score merged by it."""
    out: list[int] = []
    by_score = sorted(group.classes, key=lambda c: c[0][0])
    order = group.order
    for _, level in itertools.groupby(by_score, key=lambda c: c[0][0]):
        lists = [members for _, members in level]
        merged = lists[0] if len(lists) == 1 else heapq.merge(*lists, key=lambda i: (order[i], i))  # index = name
        for i in merged:
            if len(out) >= take:
                return out
            if i != pick:
                out.append(i)
    return out


def _candidates(groups: list[_Group], nodes: Sequence[NodeView],
                placed: dict[str, int], limit: int | None = None) -> tuple[list[Candidate], int]:
    """The candidate table and how many rows it leaves out: one row per node for the first task of
    each shape, plus a row per further chosen task; every chosen row, then the best-ranked others
    up to `limit` rows, in `_row_order`. Only the rows kept are put into words: nodes are in name
    order, so a verdict's rows are already in table order, and only the fits need sorting (by score)."""
    chosen: list[Candidate] = []
    buckets: list[tuple[str, int, Verdict, Sequence[int], _Group]] = []    # (task, verdict order, ...)
    total = 0                                                             # rows, kept or not
    for group in groups:
        first = group.tasks[0].name
        pick = placed.get(first)
        if pick is not None:
            chosen.append(_row(group, nodes, pick, Verdict.CHOSEN))
        for task in group.tasks[1:]:
            if task.name in placed:
                node = nodes[placed[task.name]]
                chosen.append(Candidate(task.name, node.name, node.state, Verdict.CHOSEN,
                                        f"same shape as {first}", None))
                total += 1
        fits = range(sum(len(m) for _, m in group.classes) - (pick is not None))   # counted: _best_fits lists them
        for verdict, members in ((Verdict.FITS, fits), (Verdict.BUSY, group.busy),
                                 (Verdict.TOO_SMALL, group.too_small), (Verdict.EXCLUDED, list(group.excluded))):
            buckets.append((first, _VERDICT_ORDER[verdict], verdict, members, group))
        total += len(nodes)
    room = max(0, (_TABLE_LIMIT if limit is None else limit) - len(chosen))
    others: list[Candidate] = []
    for _, _, verdict, bucket, group in sorted(buckets, key=lambda b: b[:2]):
        take = room - len(others)
        if take <= 0:
            break
        shown = _best_fits(group, placed.get(group.tasks[0].name), take) if verdict is Verdict.FITS else bucket
        others.extend(_row(group, nodes, i, verdict) for i in shown[:take])
    rows = sorted(chosen + others, key=_row_order)
    return rows, total - len(rows)


def _never_message(job: JobRequest, nodes: Sequence[NodeView], groups: list[_Group],
                   placed: dict[str, int]) -> str:
    """Explain why the job cannot fit even an empty fleet, naming the node type it would need."""
    for group in groups:
        task = group.tasks[0]
        if task.name in placed:
            continue
        need = task.requests
        model = f" (model {_models(task)})" if task.gpu_model else ""
        eligible = group.eligible(nodes)
        if not eligible:
            reasons = sorted({why.split(" (")[0] for why in group.excluded.values()})
            detail = "; ".join(reasons[:3]) or "the fleet has no nodes"
            return f"task {task.name}: no node in this fleet matches its constraints{model}: {detail}"
        gpu_nodes = sum(why.startswith(_OFF_GPU_NODES) for why in group.excluded.values())
        left_out = f"; {gpu_nodes} GPU node(s) left out: {_OFF_GPU_NODES}" if gpu_nodes else ""
        for name in sorted(need, key=lambda n: (n != GPU, n)):
            best = max(eligible, key=lambda i: (nodes[i].allocatable.get(name), nodes[i].name))
            have = nodes[best].allocatable.get(name)
            if need[name] > have:
                kind = nodes[best].instance_type or f"node {nodes[best].name}"
                return (f"task {task.name}: needs a node with {format_quantity(name, need[name])} {name}{model}; "
                        f"the largest matching node in this fleet has {format_quantity(name, have)} ({kind})"
                        f"{left_out}")
        return (f"task {task.name}: needs {need}{model} on one node; no matching node in this fleet "
                f"has all of it at once{left_out}")
    return (f"job {job.job_id}: needs {job.min_available} of {len(job.tasks)} tasks placed at once; "
            f"even the whole fleet, empty, holds only {len(placed)}")


def _with_start_fill(job: JobRequest, nodes: Sequence[NodeView], cost: CostModel) -> CostModel:
    """`cost` with the job's forecast of how full a node it starts will get (CostModel doc): its
    `boot_fill_from_load` times the GPUs in use on the running and booting nodes, in copies of its
    largest task. The load is read from `nodes`, the same snapshot the plan is made on."""
    if not job.boot_fill_from_load:
        return cost
    in_use = sum(n.allocated.gpus for n in nodes if n.state in (NodeState.READY, NodeState.BOOTING))
    per_task = max((t.requests.gpus for t in job.tasks), default=0) or 1
    return replace(cost, start_fill=job.boot_fill_from_load * in_use / per_task)


def place(job: JobRequest, nodes: Sequence[NodeView] | Fleet, unavailable: Sequence[Unavailable] = (),
          cost: CostModel = DEFAULT_COST, table_rows: int | None = None) -> Plan:
    """Plan `job` on `nodes`: FITS with assignments, or BUSY / NEVER with a message that says why.

    `unavailable` (the caller passes only unexpired entries) keeps offerings that ran out of
    stock, and nodes that failed to boot, out of this plan; being temporary, they make a job
    that only they could hold BUSY, never NEVER. A node that failed for this very job (a mark with
    `failed_for_job`) does make it NEVER when only such nodes could hold it: waiting for
    capacity would wait out the queue timeout for nothing. `cost` prices the decision (module doc).
    `table_rows`: candidate rows put into words, the chosen ones first (default _TABLE_LIMIT; a burst's
    answers keep few). A mark holding a node for this very job (`Unavailable.held_for`) does not block it.
    `nodes` may come prepared as a `Fleet` (many plans on the same views), which `place` only reads."""
    unavailable = [u for u in unavailable if u.held_for != job.job_id]
    prepared = nodes if isinstance(nodes, Fleet) else Fleet(nodes)
    nodes = prepared.nodes
    run_hours = None if job.expected_run_seconds is None else job.expected_run_seconds / HOUR
    cost = _with_start_fill(job, nodes, cost)
    blocked = blocked_nodes(unavailable, nodes)
    groups = _groups(job, prepared, whole_fleet=False, unavailable=unavailable, cost=cost, run_hours=run_hours,
                     blocked=blocked)
    placed = _assign(groups, nodes, cost, run_hours)
    kept, omitted = _candidates(groups, nodes, placed, table_rows)

    if len(placed) >= job.min_available:
        by_task = {t.name: t for t in job.tasks}
        assignments = tuple(
            Assignment(task=name, node=nodes[i].name, hostname=nodes[i].hostname, instance_id=nodes[i].instance_id,
                       state=nodes[i].state, requests=by_task[name].requests)
            for name, i in sorted(placed.items()))
        to_start = sorted({a.node for a in assignments if a.state in (NodeState.STOPPED, NodeState.STOPPING)})
        where = ", ".join(f"{a.task}->{a.node} ({a.state.value})" for a in assignments)
        message = f"{len(assignments)} of {len(job.tasks)} tasks placed: {where}"
        if to_start:
            message += f"; start {', '.join(to_start)}"
        return Plan(job.job_id, Outcome.FITS, message, assignments, tuple(to_start), tuple(kept), omitted)

    labels_matter = any(t.node_selector for t in job.tasks)
    fleet = nodes if labels_matter else _first_empty_twins(nodes, len(job.tasks))
    empty, fleet_groups, fleet_placed = _emptied(job, fleet)
    if len(fleet_placed) < job.min_available:
        if len(fleet) < len(nodes):     # NEVER is rare: its message counts every node
            empty, fleet_groups, fleet_placed = _emptied(job, nodes)
        return Plan(job.job_id, Outcome.NEVER, _never_message(job, empty, fleet_groups, fleet_placed),
                    candidates=tuple(kept), candidates_omitted=omitted)
    if (never := _never_without_failed_nodes(job, nodes, unavailable)) is not None:
        return Plan(job.job_id, Outcome.NEVER, never, candidates=tuple(kept), candidates_omitted=omitted)
    message = (f"capacity busy: {len(placed)} of {len(job.tasks)} tasks fit now, {job.min_available} needed at "
               f"once; the fleet can hold the job once capacity frees up")
    for group in groups:
        if all(t.name in placed for t in group.tasks):
            continue
        first = group.tasks[0].name
        busy = group.busy       # in name order, as in the table
        if busy:
            example = _row(group, nodes, busy[0], Verdict.BUSY)
            message += f". {first}: {len(busy)} big-enough node(s) busy, e.g. {example.node} ({example.reason})"
            holders = list(dict.fromkeys(itertools.chain.from_iterable(nodes[i].holders for i in busy)))
            if len(holders) > len(nodes[busy[0]].holders):
                message += f"; all {len(busy)} are held by {', '.join(holders[:5])}" + \
                    (f" and {len(holders) - 5} more" if len(holders) > 5 else "")
    hit = [nodes[i] for i in blocked]
    marks = sorted({u.what + ": " + u.reason for u in unavailable if any(map(u.blocks, hit))})
    if marks:
        message += ". Unavailable for now: " + "; ".join(marks)
    return Plan(job.job_id, Outcome.BUSY, message, candidates=tuple(kept), candidates_omitted=omitted)


_NOTHING = Resources()
_READY = NodeState.READY


def _never_without_failed_nodes(job: JobRequest, nodes: Sequence[NodeView],
                                unavailable: Sequence[Unavailable]) -> str | None:
    """Why the job can never run when it fits the whole fleet only with nodes that already failed for
    it (`failed_for_job` marks; a hold for another job is not one): waiting would wait out the queue
    timeout for nothing.
    None when the rest of the fleet could hold it (then it is only busy)."""
    failed = {u.node: u.reason for u in unavailable if u.node and u.failed_for_job}
    if not failed:
        return None
    _, _, placed = _emptied(job, [n for n in nodes if n.name not in failed])
    if len(placed) >= job.min_available:
        return None
    return ("it fits this fleet only with node(s) that already failed for it: "
            + "; ".join(f"{node} ({why})" for node, why in sorted(failed.items()))
            + ". Waiting would not help: fix what failed there (the step's log says what it saw) and run the "
              "job again, or add capacity it fits")


def _emptied(job: JobRequest, nodes: Sequence[NodeView]) -> tuple[list[NodeView], list[_Group], dict[str, int]]:
    """The job on `nodes` were they empty and up (the "never fits" check): the emptied nodes, the
    groups judged on them and the tasks placed. Placed >= min_available: BUSY, else NEVER."""
    empty = [_empty(n) for n in nodes]
    groups = _groups(job, Fleet(empty, in_name_order=True), whole_fleet=True)
    return empty, groups, _assign(groups, empty)


def _first_empty_twins(nodes: Sequence[NodeView], k: int) -> list[NodeView]:
    """The first `k` (in name order) of each class of nodes that are twins once emptied.

    Enough for the "never fits" check of a job of k tasks and no nodeSelector, and a fraction of
    the fleet to copy: emptied twins get one verdict and score (`_twin_inputs`; the check ignores
    state and unavailability, and without a nodeSelector no node has a reason of its own), the
    greedy takes each class's nodes in name order, and every node it takes holds at least one
    of the k tasks, so it never reaches a class's (k+1)th node."""
    tokens, firsts = _tokens(nodes)
    by_value: dict[tuple, int] = {}     # _twin_inputs of the emptied node: up, nothing allocated
    class_of = {token: by_value.setdefault((nodes[i].allocatable, *_fixed_inputs(nodes[i])), len(by_value))
                for token, i in firsts.items()}
    if len(by_value) * k >= len(nodes):
        return list(nodes)
    taken = [0] * len(by_value)
    kept = []
    for node, c in zip(nodes, map(class_of.__getitem__, tokens)):
        if taken[c] < k:
            taken[c] += 1
            kept.append(node)
    return kept


def _empty(node: NodeView) -> NodeView:
    """The node as if nothing ran or was reserved on it and it were up (for the "never fits" check).
    A copy of its fields, not dataclasses.replace (much slower, and this runs for every node of the
    fleet), sharing one empty usage and the allocatable as the free capacity, so twins stay twins;
    the copied dict is set whole and written item by item, faster than update() with keywords."""
    fields = node.__dict__.copy()
    fields["state"], fields["reason"], fields["allocated"], fields["free"] = _READY, "empty", _NOTHING, node.allocatable
    empty = object.__new__(NodeView)
    object.__setattr__(empty, "__dict__", fields)
    return empty

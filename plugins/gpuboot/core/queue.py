"""The job queue's decisions: who goes first, what a team may use, and holds against starvation.

Pure and deterministic, so the place step (gpuboot.lifecycle.queue) and the trace replay
(gpuboot.replay) make the same decision over the same waiting set.

Order (`next_in_order`): priority class first; then jobs waiting past `starve_seconds`, oldest
first; then the team's fair-share deficit (its dominant share of the GPUs, per model, in use
divided by its weight: the team furthest below its share goes first), then age (enqueue time),
then the job id. Shares are recomputed as the
pass admits jobs, so one team's burst does not take a whole pass.

Quotas (`TeamQuota`, as Kueue's ClusterQueue): GPUs per model, nominal, a borrowing limit and
a lending limit, teams sharing unused nominal quota inside a cohort. `never_fits_quota` says at
trigger time that a job can never fit its team's quota; `quota_blocker` says what stops it now.

No starvation (`run_pass`): a job that does not fit and has waited `starve_seconds` (or is of
the high class) gets a `Hold` on the running nodes that will free soonest for it; other jobs may
not place there, except a job whose expected runtime ends before the hold is due. A gang is
held as a whole: the hold covers every task it needs at once, or there is no hold.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuboot.core.inventory import gpu_model_matches
from gpuboot.core.model import HOLD_REASON, FrozenDict, NodeState, NodeView, Unavailable
from gpuboot.core.resources import Resources

PRIORITY_CLASSES = FrozenDict({"low": 0, "normal": 100, "high": 1000})
DEFAULT_PRIORITY_CLASS = "normal"
DEFAULT_TEAM = "default"
ANY_MODEL = "*"                  # a quota key that covers every GPU model
DEFAULT_STARVE_SECONDS = 600.0   # a job waiting this long gets holds (measured: docs/performance.md)
DEFAULT_SPARE_HOLDS = 1          # nodes held beyond what the job needs, when their ends are not known
DEFAULT_MAX_HOLDS = 1              # jobs holding nodes at once: the first starving ones in line (Slurm's top job)
DEFAULT_HOLD_SECONDS = 3600.0     # hold only nodes whose work is younger, and for at most this long
DEFAULT_PREEMPT_AFTER_SECONDS = 1800.0   # a held job still waiting this long may preempt preemptible jobs
ROOM_LOSS_FACTOR = 2.0            # rooms losing up to this times the least loss (`choose_room`) rank by the teams' waits
ROOM_LOSS_FLOOR = 3600.0          # losses under this count as this (a few minutes' run is no reason to pick a team)
_UP = (NodeState.READY, NodeState.BOOTING)


@dataclass(frozen=True)
class Entry:
    """One waiting job: who, its team, class, shape (per-task requests, tasks needed at once,
    accepted models), when it was enqueued (fixed for the life of the run) and its hints."""

    job_id: str
    requests: Resources
    tasks: int = 1
    models: tuple[str, ...] = ()
    team: str = DEFAULT_TEAM
    priority_class: str = DEFAULT_PRIORITY_CLASS
    enqueued_at: float = 0.0
    expected_runtime: float | None = None
    preemptible: bool = False
    name: str = ""                  # the job's own name (the spec's), for people: the id is a hash

    def __post_init__(self):
        if self.priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"job {self.job_id}: priority_class: {self.priority_class!r} is not one of "
                             f"{', '.join(PRIORITY_CLASSES)}")
        if self.tasks < 1:
            raise ValueError(f"job {self.job_id}: tasks: must be >= 1, got {self.tasks}")

    @property
    def priority(self) -> int:
        return PRIORITY_CLASSES[self.priority_class]

    @property
    def gpus(self) -> int:
        """GPUs the whole job needs at once."""
        return self.requests.gpus * self.tasks

    @property
    def shape(self) -> tuple:
        """Jobs of one shape are refused alike by a placement (the GPU models included)."""
        return self.requests, self.tasks, self.models

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "requests": self.requests.to_json(), "tasks": self.tasks,
                "models": list(self.models), "team": self.team, "priority_class": self.priority_class,
                "enqueued_at": self.enqueued_at, "expected_runtime": self.expected_runtime,
                "preemptible": self.preemptible, "name": self.name}

    @classmethod
    def from_json(cls, d: Mapping) -> Entry:
        return cls(d["job_id"], Resources.from_json(d["requests"]), int(d.get("tasks", 1)), tuple(d.get("models") or ()),
                   d.get("team", DEFAULT_TEAM), d.get("priority_class", DEFAULT_PRIORITY_CLASS),
                   float(d.get("enqueued_at", 0.0)), d.get("expected_runtime"), bool(d.get("preemptible")),
                   str(d.get("name") or ""))


@dataclass(frozen=True)
class TeamQuota:
    """A team's queue: its fair-share weight and, per GPU model (or ANY_MODEL), its nominal quota,
    how much above it it may borrow from its cohort (None: no limit) and how much of its nominal
    it lends (None: all of it). No entry for a model: the team may not use that model (when the
    team has any quota at all)."""

    team: str
    weight: float = 1.0
    nominal: Mapping[str, int] = field(default_factory=FrozenDict)
    borrowing_limit: Mapping[str, int] | None = None
    lending_limit: Mapping[str, int] | None = None
    cohort: str | None = None

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(f"team {self.team}: weight: must be > 0, got {self.weight}")
        for name in ("nominal", "borrowing_limit", "lending_limit"):
            value = getattr(self, name)
            if value is not None:
                if any(int(v) < 0 for v in value.values()):
                    raise ValueError(f"team {self.team}: {name}: GPU counts must be >= 0, got {dict(value)}")
                object.__setattr__(self, name, FrozenDict({k: int(v) for k, v in value.items()}))

    def key_for(self, model: str | None) -> str | None:
        """The quota key that counts GPUs of `model` (None: the team may not use it)."""
        for key in self.nominal:
            if key != ANY_MODEL and model and gpu_model_matches(key, model):
                return key
        return ANY_MODEL if ANY_MODEL in self.nominal else None

    def lendable(self, key: str) -> int:
        nominal = self.nominal.get(key, 0)
        return nominal if self.lending_limit is None else min(nominal, self.lending_limit.get(key, 0))

    def borrowable(self, key: str) -> float:
        return math.inf if self.borrowing_limit is None else self.borrowing_limit.get(key, 0)


@dataclass(frozen=True)
class QueueConfig:
    """The teams (absent team: weight 1, no quota) and the starvation threshold."""

    teams: Mapping[str, TeamQuota] = field(default_factory=FrozenDict)
    starve_seconds: float = DEFAULT_STARVE_SECONDS
    spare_holds: int = DEFAULT_SPARE_HOLDS
    max_holds: int = DEFAULT_MAX_HOLDS
    hold_seconds: float = DEFAULT_HOLD_SECONDS
    preempt_after_seconds: float | None = DEFAULT_PREEMPT_AFTER_SECONDS   # None: never preempt

    def weight(self, team: str) -> float:
        quota = self.teams.get(team)
        return quota.weight if quota else 1.0

    def cohort_of(self, quota: TeamQuota) -> list[TeamQuota]:
        if quota.cohort is None:
            return [quota]
        return [q for q in self.teams.values() if q.cohort == quota.cohort]

    @classmethod
    def from_json(cls, d: Mapping) -> QueueConfig:
        """{"starve_seconds": 600, "teams": {"vision": {"weight": 2, "nominal": {"A100": 16}, "cohort": "ml"}}}"""
        teams = {}
        for name, t in (d.get("teams") or {}).items():
            teams[name] = TeamQuota(name, float(t.get("weight", 1.0)), t.get("nominal") or {},
                                    t.get("borrowing_limit"), t.get("lending_limit"), t.get("cohort"))
        preempt = d.get("preempt_after_seconds", DEFAULT_PREEMPT_AFTER_SECONDS)
        return cls(FrozenDict(teams), float(d.get("starve_seconds", DEFAULT_STARVE_SECONDS)),
                   int(d.get("spare_holds", DEFAULT_SPARE_HOLDS)), int(d.get("max_holds", DEFAULT_MAX_HOLDS)),
                   float(d.get("hold_seconds", DEFAULT_HOLD_SECONDS)),
                   None if preempt is None else float(preempt))


Usage = Mapping[str, Mapping[str, int]]     # team -> node GPU model -> GPUs in use


def _used(quota: TeamQuota, usage: Usage, key: str) -> int:
    return sum(n for model, n in (usage.get(quota.team) or {}).items() if quota.key_for(model) == key)


def quota_blocker(entry: Entry, model: str | None, usage: Usage, config: QueueConfig) -> str | None:
    """Why the team's quota stops `entry` running on GPUs of `model` now (None: it may).

    Kueue's rule: a team uses its nominal quota first, then borrows up to its borrowing limit,
    and the cohort's total use beyond what each member keeps for itself (nominal - lendable)
    stays within what its members lend."""
    quota = config.teams.get(entry.team)
    if quota is None or entry.gpus == 0:
        return None
    key = quota.key_for(model)
    if key is None:
        return f"quota: team {entry.team} has no quota for GPU model {model}"
    need = _used(quota, usage, key) + entry.gpus
    nominal = quota.nominal.get(key, 0)
    if need <= nominal:
        return None
    if quota.cohort is None:
        return f"quota: team {entry.team} would use {need} {key} GPUs, over its nominal {nominal} (no cohort to borrow from)"
    if need - nominal > quota.borrowable(key):
        return (f"quota: team {entry.team} would borrow {need - nominal} {key} GPUs, over its borrowing limit "
                f"{quota.borrowable(key):g}")
    members = config.cohort_of(quota)
    pool = sum(m.lendable(key) for m in members)
    beyond = sum(max(0, _used(m, usage, key) + (entry.gpus if m is quota else 0) - (m.nominal.get(key, 0) - m.lendable(key)))
                 for m in members)
    if beyond > pool:
        return f"quota: cohort {quota.cohort} has lent all it may of {key} GPUs ({pool})"
    return None


def never_fits_quota(entry: Entry, config: QueueConfig) -> str | None:
    """Why `entry` can never fit its team's quota, whatever else runs (None: it can); for the
    refusal at trigger time."""
    quota = config.teams.get(entry.team)
    if quota is None or entry.gpus == 0:
        return None
    keys = [quota.key_for(m) for m in entry.models] if entry.models else list(quota.nominal)
    best = 0.0
    for key in filter(None, keys):
        own = quota.nominal.get(key, 0) - quota.lendable(key)     # what the team keeps for itself
        pool = sum(m.lendable(key) for m in config.cohort_of(quota))
        best = max(best, min(quota.nominal.get(key, 0) + quota.borrowable(key), own + pool))
    if entry.gpus <= best:
        return None
    models = " or ".join(entry.models) or "any model"
    return (f"team {entry.team} may use at most {best:g} GPUs of {models} (nominal quota plus what it may borrow), "
            f"and this job needs {entry.gpus} at once")


def dominant_share(team: str, usage: Usage, capacity: Mapping[str, int], config: QueueConfig) -> float:
    """The team's largest share of any GPU model's capacity in use, over its weight (DRF)."""
    used = usage.get(team) or {}
    share = max((n / capacity[m] for m, n in used.items() if capacity.get(m)), default=0.0)
    return share / config.weight(team)


def order_key(entry: Entry, usage: Usage, capacity: Mapping[str, int], config: QueueConfig,
              now: float = -math.inf) -> tuple:
    """Class, then jobs waiting past `starve_seconds` oldest first, then the others by their team's
    share and age: fair share orders the fresh, and no share keeps a starving job behind fresh ones."""
    if now - entry.enqueued_at >= config.starve_seconds:
        return (-entry.priority, 0, 0.0, entry.enqueued_at, entry.job_id)
    return (-entry.priority, 1, dominant_share(entry.team, usage, capacity, config), entry.enqueued_at, entry.job_id)


def ordered(entries: Iterable[Entry], usage: Usage, capacity: Mapping[str, int], config: QueueConfig,
            now: float = -math.inf) -> list[Entry]:
    """The waiting set in order, shares frozen at `usage` (what a log line or the API shows)."""
    return sorted(entries, key=lambda e: order_key(e, usage, capacity, config, now))


@dataclass(frozen=True)
class Hold:
    """Nodes kept for a starving job: nobody else places there (but a backfill that ends before
    `due`, the time the held nodes are expected to hold the job; None: not known). `firm`: jobs were
    preempted for it there: the hold is kept as it is, lets no backfill in and is never taken over,
    so the room freed goes to the job that preempted for it."""

    job_id: str
    nodes: tuple[str, ...]
    due: float | None
    since: float
    firm: bool = False

    def marks(self) -> list[Unavailable]:
        return [Unavailable.holding(self.job_id, n, math.inf) for n in self.nodes]

    def lets(self, entry: Entry, now: float) -> bool:
        """May `entry` use the held nodes: it ends before the hold is due (never a firm hold's)."""
        return not self.firm and self.due is not None and entry.expected_runtime is not None and \
            now + entry.expected_runtime <= self.due

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "nodes": list(self.nodes), "due": self.due, "since": self.since,
                **({"firm": True} if self.firm else {})}

    @classmethod
    def from_json(cls, d: Mapping) -> Hold:
        return cls(d["job_id"], tuple(d["nodes"]), d.get("due"), float(d["since"]), bool(d.get("firm")))


@dataclass(frozen=True)
class Running:
    """A job running on a node (one row per pod: a gang has one per rank), as preemption and the
    holds (`releases_of`) see it."""

    job_id: str
    node: str
    requests: Resources
    priority_class: str = DEFAULT_PRIORITY_CLASS
    preemptible: bool = False
    started_at: float = 0.0
    enqueued_at: float = 0.0
    expected_runtime: float | None = None    # as the job stated it (None: not stated): `expected_end`
    team: str = DEFAULT_TEAM                 # whose waits a requeue adds to (`owed`, `choose_room`)


Releases = Mapping[str, Sequence[tuple[int, float | None]]]   # node -> (GPUs, expected end or None) per job on it


def expected_end(job: Running, now: float, grace: float) -> float | None:
    """When `job` should free its GPUs by its stated runtime (None: not known).

    An overrun job (past its stated end) is due now, for `grace` seconds past that end: the queue
    does not kill it as Slurm kills a job at its time limit, but a job that stated its runtime is
    expected to end about then, and a hold waiting on it is the hold that frees soonest. Past the
    grace its stated runtime has proven wrong and says nothing: its node counts as one of unknown
    end (held only while its work is young, `choose_hold`), so a hold does not idle the node's other
    GPUs behind a job that runs on for days."""
    if job.expected_runtime is None:
        return None
    end = job.started_at + job.expected_runtime
    if end >= now:
        return end
    return now if now - end <= grace else None


def releases_of(nodes: Iterable[NodeView], running: Iterable[Running], now: float, grace: float) -> Releases:
    """Per node, what frees when: each running job's GPUs at its expected end, and the rest of the
    node's allocated GPUs (jobs placed but not started yet, pods that are not the queue's) at an
    unknown end. The live place step and the replay both give the pass this, from their own
    `Running` rows."""
    out: dict[str, list[tuple[int, float | None]]] = {}
    for job in running:
        out.setdefault(job.node, []).append((job.requests.gpus, expected_end(job, now, grace)))
    for node in nodes:
        rows = out.setdefault(node.name, [])
        rest = node.allocated.gpus - sum(gpus for gpus, _ in rows)
        if rest > 0:
            rows.append((rest, None))
    return out


def _slots(capacity: Resources, need: Resources) -> int:
    counts = [capacity.get(name) // amount for name, amount in need.items() if amount > 0]
    return min(counts) if counts else 1


def _free_at(node: NodeView, need_gpus: int, releases: Releases, now: float) -> float:
    """When `need_gpus` more GPUs should be free on `node`: the known ends, soonest first (inf: unknown)."""
    short = need_gpus - node.free.gpus
    if short <= 0:
        return now
    for gpus, end in sorted(releases.get(node.name, ()), key=lambda r: math.inf if r[1] is None else r[1]):
        if end is None:
            return math.inf
        short -= gpus
        if short <= 0:
            return max(now, end)
    return math.inf


def _known(node: NodeView, releases: Releases) -> bool:
    """Every job on `node` stated its runtime (or nothing is on it): when it frees is known."""
    rows = releases.get(node.name)
    if not rows:
        return node.allocated.gpus == 0
    return all(end is not None for _, end in rows)


def choose_hold(entry: Entry, nodes: Sequence[NodeView], taken: Iterable[str], releases: Releases, now: float,
                keep: Hold | None = None, spare: int = 0, young: float = math.inf) -> Hold | None:
    """The running nodes that will hold the whole job soonest (none held for another job): those
    expected free first, then those with the fewest GPUs to drain, then the youngest work (durations
    are heavy-tailed: young work ends sooner). While the ends are not known, `spare` more nodes are
    held: the job takes whichever drains first (the others are let go when it is admitted).

    Where the ends are not known, a hold that still covers the job is kept as it is, for `young`
    seconds at most, and only nodes whose oldest work is younger than `young` are held (work that
    has run long runs on, and holding its node would idle the node's other GPUs for days). Where
    they are known (every job on the node stated its runtime), any node may be held, whatever its
    age: the hold is due when its work ends, and jobs that end before then backfill its free GPUs,
    so it idles nothing it could have used; such a hold is chosen afresh at each pass, so it moves
    only to nodes that free sooner."""
    taken = set(taken)
    fit = [n for n in nodes if n.state in _UP and n.name not in taken and gpu_model_matches(entry.models, n.gpu_model)
           and entry.requests.fits_in(n.allocatable)]
    by_name = {n.name: n for n in fit}
    if keep is not None and now - keep.since < young and all(name in by_name for name in keep.nodes) and \
            not all(_known(by_name[name], releases) for name in keep.nodes) and \
            sum(_slots(by_name[name].allocatable, entry.requests) for name in keep.nodes) >= entry.tasks:
        return keep
    ranked = []
    for n in fit:
        copies = min(entry.tasks, _slots(n.allocatable, entry.requests))
        need = entry.requests.gpus * copies
        if not _known(n, releases) and n.busy_since is not None and now - n.busy_since >= young:
            continue
        ranked.append((_free_at(n, need, releases, now), max(0, need - n.free.gpus), -(n.busy_since or now),
                       n.name, copies))
    ranked.sort()
    chosen, covered, due, extra = [], 0, now, 0
    for at, _, _, name, copies in ranked:
        if covered >= entry.tasks:
            if not math.isinf(due) or extra >= spare:
                break
            extra += 1
        chosen.append(name)
        covered += copies
        due = max(due, at) if covered - copies < entry.tasks else due
    if covered < entry.tasks:
        return None
    since = keep.since if keep is not None and all(_known(by_name[name], releases) for name in chosen) else now
    return Hold(entry.job_id, tuple(sorted(chosen)), None if math.isinf(due) else due, since)


def may_preempt(entry: Entry, now: float, config: QueueConfig) -> bool:
    """A job of the high class at once, any other once it has waited past both thresholds."""
    if config.preempt_after_seconds is None:
        return False
    return entry.priority >= PRIORITY_CLASSES["high"] or \
        now - entry.enqueued_at >= config.starve_seconds + config.preempt_after_seconds


def reach(requests: Resources, nodes: Sequence[NodeView]) -> int:
    """How many nodes of the fleet (whatever their state) one task of this shape fits on when empty: the
    scarcity of the room it can use. GPU models are not counted (a `Running` row does not carry them),
    so both sides of a comparison are counted alike."""
    return sum(1 for n in nodes if requests.fits_in(n.allocatable))


def _outranks(entry: Entry, job: Running, waited: bool, scarcity: Callable[[Resources], int]) -> bool:
    """May `entry` preempt `job`: a higher class, or the same class once `entry` has waited and it
    ranks first by (more GPUs per task, then fewer nodes its task fits on, then enqueued earlier). A
    strict order, so two jobs never requeue each other in turn. The scarcity rank lets a job that fits
    only a few nodes (a 120-CPU task that only the fleet's one large node takes) requeue an older job of
    as many GPUs that could run elsewhere: by age alone it would wait that job out, for days."""
    mine, theirs = entry.priority, PRIORITY_CLASSES[job.priority_class]
    if theirs != mine:
        return theirs < mine
    if not waited:
        return False
    if job.requests.gpus != entry.requests.gpus:
        return job.requests.gpus < entry.requests.gpus
    return (scarcity(job.requests), job.enqueued_at) > (scarcity(entry.requests), entry.enqueued_at)   # counted on a tie only


def _clearing(entry: Entry, node: NodeView, copies: int, jobs: Iterable[Running], waited: bool,
              scarcity: Callable[[Resources], int]) -> list[Running] | None:
    """The preemptible jobs on `node` whose going makes room for `copies` of the entry's task, the
    youngest first (the least work lost); None when that cannot make room."""
    need = Resources({k: v * copies for k, v in entry.requests.items()})
    free, chosen = node.free, []
    for job in sorted(jobs, key=lambda r: (-r.started_at, r.job_id)):
        if need.fits_in(free):
            break
        if job.preemptible and _outranks(entry, job, waited, scarcity):
            chosen.append(job)
            free = free + job.requests
    return chosen if need.fits_in(free) else None


def _scarcity(nodes: Sequence[NodeView]) -> Callable[[Resources], int]:
    return functools.lru_cache(maxsize=None)(lambda requests: reach(requests, nodes))


def _by_node(running: Iterable[Running]) -> dict[str, list[Running]]:
    out: dict[str, list[Running]] = {}
    for r in running:
        out.setdefault(r.node, []).append(r)
    return out


def _waited(entry: Entry, now: float, config: QueueConfig) -> bool:
    return now - entry.enqueued_at >= config.starve_seconds + (config.preempt_after_seconds or 0.0)


def victims(entry: Entry, hold: Hold, nodes: Sequence[NodeView], running: Sequence[Running], now: float,
            config: QueueConfig) -> list[str]:
    """The preemptible jobs on the held nodes whose going makes room for the whole held job now, the
    youngest first (the least work lost), or [] when that cannot make room or may not happen yet.

    Only jobs that said they are preemptible go, only for a job that outranks them (`_outranks`: a
    higher class, or the same class once it has waited `preempt_after_seconds` and ranks first by GPUs
    per task, scarcity of the nodes it fits, then age); a gang's room is made on all its nodes or none."""
    if config.preempt_after_seconds is None:
        return []
    waited, scarcity, on = _waited(entry, now, config), _scarcity(nodes), _by_node(running)
    by_name = {n.name: n for n in nodes}
    chosen: list[str] = []
    covered = 0
    for name in hold.nodes:
        node = by_name.get(name)
        if node is None or node.state not in _UP or covered >= entry.tasks:
            continue
        copies = min(entry.tasks - covered, _slots(node.allocatable, entry.requests))
        going = _clearing(entry, node, copies, on.get(name, ()), waited, scarcity)
        if going is None:
            return []
        chosen += [job.job_id for job in going]
        covered += copies
    return chosen if covered >= entry.tasks else []


def owed(entries: Iterable[Entry], running: Iterable[Running], now: float) -> dict[str, float]:
    """Per team, the waits the queue can see: its running jobs' (enqueue to start; a requeued job's
    counts from its first enqueue, its lost runs included) and its waiting jobs' so far. A requeue adds
    its victim's run so far to its team's (`choose_room`)."""
    out: dict[str, float] = {}
    for job in running:
        out[job.team] = out.get(job.team, 0.0) + max(0.0, job.started_at - job.enqueued_at)
    for e in entries:
        out[e.team] = out.get(e.team, 0.0) + max(0.0, now - e.enqueued_at)
    return out


def _fairness(waits: Mapping[str, float], going: Sequence[Running], now: float) -> float:
    """Jain's index over the teams' waits (`owed`) once `going` are requeued, each adding its run so far
    to its team's (1: every team alike; one team or none: 1)."""
    after = dict(waits)
    for job in going:
        after[job.team] = after.get(job.team, 0.0) + max(0.0, now - job.started_at)
    squares = sum(v * v for v in after.values())
    return sum(after.values()) ** 2 / (len(after) * squares) if squares else 1.0


def choose_room(entry: Entry, nodes: Sequence[NodeView], taken: Iterable[str], running: Sequence[Running],
                now: float, config: QueueConfig, waits: Mapping[str, float] | None = None) -> Hold | None:
    """The nodes (none held for another job) where preempting makes room for the whole job losing the
    least work: per node that fits, the longest any of its victims (`_clearing`) has run, then the
    GPU-seconds they have run in all, then the fewest GPUs to drain, then the youngest work; a gang takes
    nodes in that order until covered. None when no such room needs a preemption.

    `waits` (`owed`: the teams' waits so far): among the rooms whose longest loss is within
    ROOM_LOSS_FACTOR of the least (losses under ROOM_LOSS_FLOOR counted as that), those that leave the
    teams' waits the most even (`_fairness`, Jain's index) go first, as Kueue's fair-sharing preemption
    takes from the team ahead: a few requeued runs of days set the teams' mean waits, and on a node
    of one team's long jobs they fell on that team alone (docs/performance.md, The job queue).

    Why the work lost: a requeued job runs again from its start and its wait counts from its first
    arrival, so a victim that had run for days waits days more, and a few such waits set the tail and
    the fairness between teams. Ranked by GPUs to drain (before), one 18-day 1-GPU job went before
    seven that had just started (docs/performance.md, The job queue)."""
    if config.preempt_after_seconds is None:
        return None
    taken = set(taken)
    waited, scarcity, on = _waited(entry, now, config), _scarcity(nodes), _by_node(running)
    ranked = []
    for n in nodes:
        if n.state not in _UP or n.name in taken or not gpu_model_matches(entry.models, n.gpu_model) or \
                not entry.requests.fits_in(n.allocatable):
            continue
        copies = min(entry.tasks, _slots(n.allocatable, entry.requests))
        going = _clearing(entry, n, copies, on.get(n.name, ()), waited, scarcity)
        if going is None:
            continue
        ran = [max(0.0, now - job.started_at) for job in going]
        lost = (max(ran, default=0.0), sum(job.requests.gpus * r for job, r in zip(going, ran)))
        drain = max(0, entry.requests.gpus * copies - n.free.gpus)
        ranked.append((lost, drain, -(n.busy_since or now), n.name, copies, going))
    near = max(min((r[0][0] for r in ranked), default=0.0), ROOM_LOSS_FLOOR) * ROOM_LOSS_FACTOR
    ranked.sort(key=lambda r: ((0, -_fairness(waits, r[5], now)) if waits is not None and r[0][0] <= near
                               else (1, 0.0), *r[:4]))
    chosen, covered, any_going = [], 0, False
    for *_, name, copies, goes in ranked:
        if covered >= entry.tasks:
            break
        chosen.append(name)
        covered += copies
        any_going = any_going or bool(goes)
    if covered < entry.tasks or not any_going:
        return None
    return Hold(entry.job_id, tuple(sorted(chosen)), None, now)


@dataclass(frozen=True)
class Attempt:
    """What a placement of one entry said: fits (and on which GPU model), or why not."""

    fits: bool
    model: str | None = None
    message: str = ""
    never: bool = False


@dataclass(frozen=True)
class Step:
    """The pass's verdict on one entry: its position, admitted or not, what blocks it, and the jobs
    ahead of it in this pass (admitted ones included: they take their places first)."""

    entry: Entry
    position: int
    admitted: bool
    blocker: str = ""
    order: Sequence[str] = ()      # the pass's order, shared by its steps (copying it per step made a pass quadratic)

    @property
    def ahead(self) -> tuple[str, ...]:
        return tuple(self.order[:self.position])

    @property
    def blocked_by(self) -> str:
        """What kind of thing stops it: "quota", "hold" (nodes held for another job), "capacity"
        (busy, or no node of its shape), or "" (admitted); the queue table's column."""
        if self.admitted:
            return ""
        if self.blocker.startswith("quota:"):
            return "quota"
        return "hold" if HOLD_REASON in self.blocker else "capacity"


@dataclass
class PassResult:
    steps: list[Step]
    holds: dict[str, Hold]
    preempt: dict[str, list[str]] = field(default_factory=dict)    # held job -> the jobs to requeue for it

    def step(self, job_id: str) -> Step | None:
        return next((s for s in self.steps if s.entry.job_id == job_id), None)


def _far(hold: Hold, now: float, config: QueueConfig) -> bool:
    """The hold is due (by stated runtimes) later than a preempting job would still wait for it."""
    return hold.due is not None and hold.due - now > (config.preempt_after_seconds or 0.0)


def needs_hold(entry: Entry, now: float, config: QueueConfig) -> bool:
    """A job of the high class, or one of more than one GPU that has waited `starve_seconds`. A 1-GPU
    job needs none: the first GPU that frees goes to the first in line."""
    if entry.priority >= PRIORITY_CLASSES["high"]:
        return True
    return entry.gpus > 1 and now - entry.enqueued_at >= config.starve_seconds


def next_in_order(waiting: list[Entry], usage: Usage, capacity: Mapping[str, int], config: QueueConfig,
                  now: float = -math.inf) -> Entry:
    """The entry that goes next (order in the module doc), with shares as of `usage`."""
    return min(waiting, key=lambda e: order_key(e, usage, capacity, config, now))


def run_pass(entries: Sequence[Entry], *, now: float, config: QueueConfig, usage: Usage, capacity: Mapping[str, int],
             holds: Mapping[str, Hold], nodes: Callable[[], Sequence[NodeView]],
             attempt: Callable[[Entry, list[Unavailable]], Attempt], commit: Callable[[Entry, Attempt], None],
             releases: Releases | None = None, only: str | None = None,
             running: Sequence[Running] = ()) -> PassResult:
    """One decision over the waiting set, in order: each entry is placed (`attempt`, with the holds
    of other jobs it may not use as marks) and, when it fits and its quota lets it, admitted
    (`commit`, which the caller carries out so the next `nodes()` and `attempt` see it). A
    starving entry that does not fit gets a hold. `only`: the caller needs that entry's verdict
    alone (the live place step), so the pass stops once it is judged.

    Placing only takes capacity and a hold only adds marks, so a shape refused with a set of
    marks is refused again later in the pass: skipped without a placement. `running`: the jobs placed,
    for preemption (`victims`): the pass only names them; the caller requeues them.

    Only the queue's head preempts: victims are named for one job per pass, the first in order that
    does not fit (its quota allowing), may preempt (`may_preempt`) and finds victims; such a job may
    take over the holds of jobs behind it that are not firm (a job behind it would else keep the room
    it needs). The jobs after it wait: the room freed goes to the job that freed it (its hold turns
    firm when the preemption is written, and the ledger keeps the nodes for it:
    gpuboot.lifecycle.preemption). A pass for another job's step (`only`) that finds the job of a firm
    hold would fit keeps that hold: its admission is that job's own step's to make, and the pass's
    holds are written back (a hold dropped there went to the next starving job, and the two jobs'
    steps took the node from each other at every poll)."""
    used: dict[str, dict[str, int]] = {team: dict(models) for team, models in usage.items()}
    holds = {job: h for job, h in holds.items() if any(e.job_id == job for e in entries)}
    lines: dict[tuple, list[Entry]] = {}      # (class, team) -> its entries, oldest last: only heads compete
    for e in entries:
        lines.setdefault((e.priority, e.team), []).append(e)
    for line in lines.values():
        line.sort(key=lambda e: (e.enqueued_at, e.job_id), reverse=True)
    refused: dict[tuple, tuple[str, str]] = {}     # shape and marks -> the job refused so, and why
    steps: list[Step] = []
    ahead: list[str] = []
    passed: set[str] = set()        # the same ids, for lookups (a backlog of thousands: no list scans)
    preempt: dict[str, list[str]] = {}
    gone: set[str] = set()
    preemptor: str | None = None    # the queue's head preemptor: the one job victims are named for
    movable_any = any(r.preemptible for r in running)     # else nobody preempts and no hold is taken over
    while lines:
        head = next_in_order([line[-1] for line in lines.values()], used, capacity, config, now)
        line = lines[(head.priority, head.team)]
        entry = line.pop()
        if not line:
            del lines[(head.priority, head.team)]
        others = [h for job, h in holds.items() if job != entry.job_id and not h.lets(entry, now)]
        marks = [m for h in others for m in h.marks()]
        key = (entry.shape, frozenset(m.node for m in marks))
        result = Attempt(False, message=f"as {refused[key][0]} ahead of it, of the same shape: {refused[key][1]}") \
            if key in refused else attempt(entry, marks)
        blocker = result.message
        if result.fits:
            blocker = quota_blocker(entry, result.model, used, config) or ""
            if not blocker:
                commit(entry, result)
                if only in (None, entry.job_id) or not (entry.job_id in holds and holds[entry.job_id].firm):
                    holds.pop(entry.job_id, None)     # a firm hold goes with its own job's admission only
                team = used.setdefault(entry.team, {})
                team[result.model or ""] = team.get(result.model or "", 0) + entry.gpus
                steps.append(Step(entry, len(steps), True, "", ahead))
                ahead.append(entry.job_id)
                passed.add(entry.job_id)
                if only == entry.job_id:
                    break
                continue
        else:
            refused.setdefault(key, (entry.job_id, result.message))
            if marks and not result.never:
                blocker += "; " + "; ".join(f"node(s) {', '.join(h.nodes)} {HOLD_REASON} {h.job_id}" for h in others)
        judged = not result.never and not blocker.startswith("quota:")
        kept = holds.get(entry.job_id)
        may = movable_any and preemptor is None and judged and may_preempt(entry, now, config)
        behind = {job for job, h in holds.items() if not h.firm and job not in passed and job != entry.job_id} \
            if may else set()           # holds of jobs behind it, which a job that may preempt takes over
        if kept is not None and kept.firm and judged:
            pass                        # jobs went for it there: kept as it is until it is admitted or lapses
        elif needs_hold(entry, now, config) and judged and \
                (kept is not None or len(holds) - len(behind) < config.max_holds):
            taken = {n for job, h in holds.items() if job != entry.job_id and job not in behind for n in h.nodes}
            hold = choose_hold(entry, nodes(), taken, releases or {}, now, kept, config.spare_holds,
                               config.hold_seconds)
            movable = [r for r in running if r.job_id not in gone] if may else []
            if movable and (hold is None or _far(hold, now, config)):
                # no node drains soon: hold one where requeuing preemptible jobs makes room losing the
                # least work (`choose_room`), else keep what there is; a hold due within
                # preempt_after_seconds is waited for instead
                room = choose_room(entry, nodes(), taken, movable, now, config, owed(entries, running, now))
                hold = room if room and victims(entry, room, nodes(), movable, now, config) else hold
            if hold is None:
                holds.pop(entry.job_id, None)
            else:
                for job in sorted(behind):      # what it needs of the holds behind it, and their slots
                    if set(holds[job].nodes) & set(hold.nodes) or len(holds) + (kept is None) > config.max_holds:
                        holds.pop(job)
                holds[entry.job_id] = hold
                chosen = victims(entry, hold, nodes(), movable, now, config) if movable else []
                if chosen:
                    preemptor = entry.job_id
                    preempt[entry.job_id] = chosen
                    gone.update(chosen)
        steps.append(Step(entry, len(steps), False, blocker, ahead))
        ahead.append(entry.job_id)
        passed.add(entry.job_id)
        if only == entry.job_id:
            break
    return PassResult(steps, holds, preempt)

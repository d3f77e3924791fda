"""What a replay run cost and how long jobs waited: recorded as the run goes, summarised at the end."""
from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpuboot.core.inventory import gpu_model_matches

HOUR = 3600.0
SIZE_BUCKETS = ((1, 1, "1 GPU"), (2, 2, "2 GPUs"), (3, 4, "3-4 GPUs"), (5, 8, "5-8 GPUs"), (9, math.inf, ">8 GPUs"))
SLOWDOWN_FLOOR = 10.0    # bounded slowdown's runtime floor (s): a 1 s job waiting one boot is not 150x slowed


def size_bucket(gpus: int) -> str:
    """The job-size bucket waits are reported by (0-GPU jobs count with 1 GPU)."""
    return next(label for low, high, label in SIZE_BUCKETS if gpus <= high and (gpus >= low or low == 1))


def team_of(job_name: str, teams: int) -> str:
    """A team for a trace job, deterministic from its name (the trace has none): team-0 .. team-<teams-1>."""
    return f"team-{zlib.crc32(job_name.encode()) % teams}"


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has everything."""
    if not values:
        return None
    squares = sum(v * v for v in values)
    return 1.0 if squares == 0 else sum(values) ** 2 / (len(values) * squares)


def bounded_slowdown(wait: float, run_seconds: float) -> float:
    """(wait + run) / run, runs shorter than SLOWDOWN_FLOOR counted as that long (Feitelson's bounded
    slowdown): a wait measured against the job's own length, so a day's wait weighs less on a week's job."""
    run = max(run_seconds, SLOWDOWN_FLOOR)
    return (wait + run) / run


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class BootEpisode:
    """One power-on of one node: wasted unless a job it was booted for ran on it."""

    node: str
    requested_at: float
    booted_for: set[str] = field(default_factory=set)
    served: bool = False


@dataclass
class Recorder:
    """Collects one policy's run: power intervals, boots, job starts and waits."""

    policy: str
    start: float
    end: float
    node_seconds: float = 0.0
    gpu_seconds: float = 0.0
    cost: float = 0.0              # USD: each node's price for the seconds it was powered on
    used_gpu_seconds: float = 0.0
    boots: int = 0
    wasted_boots: int = 0
    # job -> (GPUs, team, wait, run): the wait until its last start (a preempted job waits again, from arrival)
    started_jobs: dict[str, tuple[int, str, float, float]] = field(default_factory=dict)
    # (GPUs, seconds) per arrival: the soonest it could start without preemption (sim.Simulation._floor)
    floors: list[tuple[int, float]] = field(default_factory=list)
    preemptions: int = 0
    preempted_gpu_seconds: float = 0.0     # work lost: what preempted jobs had run, redone after requeue
    unstarted: list[int] = field(default_factory=list)     # GPUs of each job still waiting at the window end
    timeouts: list[int] = field(default_factory=list)      # GPUs of each job dropped at its queue timeout
    hold_gpu_seconds: float = 0.0    # GPUs left free on nodes held for a starving job, times how long
    hold_cost: float = 0.0           # USD: those GPUs' share of their node's price
    # The bill by what the powered seconds were for (USD; `gap()` sets them against the lower bound):
    booting_cost: float = 0.0        # nodes booting (ECS start, kubelet, device plugin) or stopping
    idle_cost: float = 0.0           # nodes up with nothing on them, within the idle time
    spare_cost: float = 0.0          # nodes up with nothing on them past the idle time (the spare kept)
    busy_cost: float = 0.0           # nodes up with at least one job running
    share_cost: float = 0.0          # the running jobs' own shares of those nodes (lower_bound_cost's share)
    cheapest_share_cost: float = 0.0     # the same jobs, as long as they ran, at their cheapest share
    never_fit: int = 0
    never_fit_examples: list[str] = field(default_factory=list)
    waiting_at_end: int = 0
    jobs: int = 0
    placement_calls: int = 0
    # step series of what is powered on: (time, nodes, gpus), one point per change
    series: list[tuple[float, int, int]] = field(default_factory=list)
    _nodes_on: int = 0
    _gpus_on: int = 0

    def powered(self, gpus: int, price_per_hour: float, since: float, until: float) -> None:
        """A node with `gpus` GPUs at `price_per_hour` was billed from `since` to `until` (clipped
        to the window; billed per second, as ECS bills pay-as-you-go instances)."""
        seconds = max(0.0, min(until, self.end) - max(since, self.start))
        self.node_seconds += seconds
        self.gpu_seconds += seconds * gpus
        self.cost += seconds / HOUR * price_per_hour

    def segment(self, kind: str, price_per_hour: float, since: float, until: float) -> None:
        """`until - since` seconds (clipped to the window) of a node at `price_per_hour` spent as `kind`:
        booting (or stopping), idle, spare or busy."""
        seconds = max(0.0, min(until, self.end) - max(since, self.start))
        setattr(self, f"{kind}_cost", getattr(self, f"{kind}_cost") + seconds / HOUR * price_per_hour)

    def job_share(self, actual_per_hour: float, cheapest_per_hour: float, since: float, until: float) -> None:
        """A job ran from `since` to `until` holding `actual_per_hour` USD/h of its node's price, where its
        cheapest share (lower_bound_cost's) is `cheapest_per_hour`; negative spans take a run back."""
        seconds = min(until, self.end) - min(max(since, self.start), self.end)
        self.share_cost += seconds / HOUR * actual_per_hour
        self.cheapest_share_cost += seconds / HOUR * cheapest_per_hour

    def gap(self, lower_bound_cost: float | None) -> dict | None:
        """The bill minus the lower bound, by cause (USD; they add up to billed - bound):
        boots (booting and stopping time), idle (empty nodes within the idle time), spare (empty
        nodes kept past it), fragmentation (busy nodes' price the running jobs' shares leave
        unused), placement (jobs on a dearer share than their cheapest), shift (the bound's runs
        from arrival against the real ones from start: waits and the window's end)."""
        if lower_bound_cost is None:
            return None
        parts = {"boots": self.booting_cost, "idle": self.idle_cost, "spare": self.spare_cost,
                 "fragmentation": self.busy_cost - self.share_cost,
                 "placement": self.share_cost - self.cheapest_share_cost,
                 "shift": self.cheapest_share_cost - lower_bound_cost}
        return {name: round(value, 2) for name, value in parts.items()}

    def power_change(self, at: float, nodes: int, gpus: int) -> None:
        self._nodes_on += nodes
        self._gpus_on += gpus
        if self.series and self.series[-1][0] == at:
            self.series[-1] = (at, self._nodes_on, self._gpus_on)
        else:
            self.series.append((at, self._nodes_on, self._gpus_on))

    def boot_closed(self, episode: BootEpisode) -> None:
        if not episode.served:
            self.wasted_boots += 1

    @property
    def started(self) -> list[tuple[int, str, float, float]]:
        return list(self.started_jobs.values())

    @property
    def waits(self) -> list[float]:
        return [w for _, _, w, _ in self.started_jobs.values()]

    def job_started(self, arrival: float, now: float, gpus: int, run_seconds: float, team: str = "",
                    name: str | None = None) -> None:
        self.started_jobs[name or f"#{len(self.started_jobs)}"] = (gpus, team, now - arrival, run_seconds)
        self.used_gpu_seconds += gpus * max(0.0, min(now + run_seconds, self.end) - now)

    def job_preempted(self, name: str, started_at: float, now: float, gpus: int, run_seconds: float) -> None:
        """`name` was stopped at `now` to be requeued: not started any more, its run so far lost."""
        self.started_jobs.pop(name, None)
        self.preemptions += 1
        self.preempted_gpu_seconds += gpus * (now - started_at)
        self.used_gpu_seconds -= gpus * max(0.0, min(started_at + run_seconds, self.end) - now)

    def job_never_fits(self, message: str) -> None:
        self.never_fit += 1
        if message not in self.never_fit_examples and len(self.never_fit_examples) < 3:
            self.never_fit_examples.append(message)

    def summary(self, lower_bound_gpu_seconds: float, wall_seconds: float,
                lower_bound_cost: float | None = None) -> dict:
        """JSON-safe figures of this run."""
        def hours(seconds: float) -> float:
            return round(seconds / HOUR, 3)

        def secs(value: float | None) -> float | None:
            return None if value is None else round(value, 1)

        return {
            "policy": self.policy,
            "billed_node_hours": hours(self.node_seconds),
            "billed_gpu_hours": hours(self.gpu_seconds),
            "used_gpu_hours": hours(self.used_gpu_seconds),
            "lower_bound_gpu_hours": hours(lower_bound_gpu_seconds),
            "billed_cost": round(self.cost, 2),
            "lower_bound_cost": None if lower_bound_cost is None else round(lower_bound_cost, 2),
            "wait_mean_seconds": secs(mean(self.waits)),
            "wait_p95_seconds": secs(percentile(self.waits, 95)),
            "boots": self.boots,
            "wasted_boots": self.wasted_boots,
            "jobs": self.jobs,
            "jobs_started": len(self.waits),
            "jobs_never_placed": self.never_fit + self.waiting_at_end,
            "jobs_never_fit": self.never_fit,
            "jobs_waiting_at_end": self.waiting_at_end,
            "never_fit_examples": list(self.never_fit_examples),
            "placement_calls": self.placement_calls,
            "wall_seconds": round(wall_seconds, 2),
            "timeouts": len(self.timeouts),
            "jain_teams": None if (j := self.team_fairness()) is None else round(j, 4),
            "jain_teams_slowdown": None if (j := self.team_fairness(slowdown=True)) is None else round(j, 4),
            "hold_gpu_hours": hours(self.hold_gpu_seconds),
            "hold_cost": round(self.hold_cost, 2),
            "cost_ratio": None if not lower_bound_cost else round(self.cost / lower_bound_cost, 4),
            "gap_to_bound": self.gap(lower_bound_cost),
            "preemptions": self.preemptions,
            "preempted_gpu_hours": hours(self.preempted_gpu_seconds),
            "by_size": self.by_size(),
        }

    def by_size(self) -> dict[str, dict]:
        """Per job-size bucket: jobs started, still waiting at the end, timed out, and wait percentiles."""
        out = {}
        for _, _, label in SIZE_BUCKETS:
            waits = [w for g, _, w, _ in self.started if size_bucket(g) == label]
            never = sum(size_bucket(g) == label for g in self.unstarted)
            late = sum(size_bucket(g) == label for g in self.timeouts)
            floors = [f for g, f in self.floors if size_bucket(g) == label]
            if waits or never or late:
                fairness = self.team_fairness(bucket=label)
                out[label] = {"started": len(waits), "never_started": never, "timeouts": late,
                              **{f"wait_p{q}_seconds": round(percentile(waits, q) or 0.0, 1) for q in (50, 95, 99)},
                              "wait_max_seconds": round(max(waits, default=0.0), 1),
                              "floor_p95_seconds": round(percentile(floors, 95) or 0.0, 1),
                              "jain_teams_bucket": None if fairness is None else round(fairness, 4)}
        return out

    def team_fairness(self, slowdown: bool = False, bucket: str | None = None) -> float | None:
        """Jain's index over the teams' mean waits (1: every team waits alike); `slowdown`: over their
        mean bounded slowdowns instead; `bucket`: over the jobs of that size bucket alone. The latter two
        are reported beside the first, to show whether a few long jobs set it."""
        per_team: dict[str, list[float]] = {}
        for gpus, team, wait, run in self.started:
            if bucket is None or size_bucket(gpus) == bucket:
                per_team.setdefault(team, []).append(bounded_slowdown(wait, run) if slowdown else wait)
        return jain([sum(w) / len(w) for w in per_team.values()]) if len(per_team) > 1 else None


def demand_series(jobs: Iterable, start: float, end: float) -> list[tuple[float, int]]:
    """GPUs the jobs would hold if each started on arrival: a (time, gpus) step series up to `end`."""
    deltas: dict[float, int] = {}
    for job in jobs:
        if not start <= job.arrival < end:
            continue
        deltas[job.arrival] = deltas.get(job.arrival, 0) + job.gpus
        finish = job.arrival + job.run_seconds
        if finish < end:
            deltas[finish] = deltas.get(finish, 0) - job.gpus
    series, level = [(start, 0)], 0
    for at in sorted(deltas):
        level += deltas[at]
        series.append((at, level))
    return series


def overload(jobs: Iterable, gpus: int, start: float, end: float) -> dict:
    """How far the demand outruns a fleet of `gpus` GPUs, whatever the order: the jobs as a fluid
    (each GPU-second of a job due from its arrival, any GPU serving any job; packing, models and CPU
    ignored, so the truth is worse), queued behind the fleet. The peak backlog is the most work
    that has arrived and cannot be done yet even at full use; `from`-`to` is its busy stretch,
    where demanded - available = the backlog; drained: when the fleet has caught up (None: not
    within the window). Per run, it says whether any order could meet a wait target there."""
    series = demand_series(jobs, start, end) + [(end, 0)]
    backlog = peak = 0.0
    busy_from = peak_from = peak_at = start
    demanded = peak_demanded = 0.0
    drained: float | None = start
    for (t0, level), (t1, _) in itertools.pairwise(series):
        span = t1 - t0
        if backlog == 0.0:
            busy_from, demanded = t0, 0.0
        after = backlog + (level - gpus) * span
        if after <= 0.0:
            if drained is None and level < gpus:
                drained = t0 + backlog / (gpus - level)
            backlog = 0.0
            continue
        backlog, demanded = after, demanded + level * span
        if backlog > peak:
            peak, peak_from, peak_at, peak_demanded, drained = backlog, busy_from, t1, demanded, None
    hours = 1 / HOUR
    return {"fleet_gpus": gpus, "peak_backlog_gpu_hours": round(peak * hours, 1),
            "busy_from_day": round(peak_from / 86400, 2), "peak_day": round(peak_at / 86400, 2),
            "demanded_gpu_hours": round(peak_demanded * hours, 1),
            "available_gpu_hours": round(gpus * (peak_at - peak_from) * hours, 1),
            "backlog_fleet_hours": round(peak / gpus * hours, 1) if gpus else None,
            "drained_day": None if drained is None else round(drained / 86400, 2)}


def lower_bound_gpu_seconds(jobs: Iterable, end: float) -> float:
    """GPU-seconds the jobs use inside the window if each starts the moment it arrives."""
    return sum(job.gpus * max(0.0, min(job.arrival + job.run_seconds, end) - job.arrival) for job in jobs)


def share_per_hour(need, capacity, price_per_hour: float) -> float:
    """USD/h of a node that `need` holds: its largest fraction of the node's GPUs, CPU or memory."""
    return price_per_hour * max((need.get(name) / capacity.get(name) for name in need if need.get(name)), default=0.0)


class CheapestShare:
    """The smallest `share_per_hour` of any node of the fleet that holds a job (0 if none does), among
    the GPU models it accepts."""

    def __init__(self, fleet: Sequence):
        self._shapes = {(n.capacity, n.price_per_hour, n.gpu_model) for n in fleet}
        self._cache: dict = {}

    def __call__(self, job) -> float:
        key = (job.requests, job.gpu_models)
        if key not in self._cache:
            self._cache[key] = min((share_per_hour(job.requests, capacity, price)
                                    for capacity, price, model in self._shapes
                                    if job.requests.fits_in(capacity) and gpu_model_matches(job.gpu_models, model)),
                                   default=0.0)
        return self._cache[key]


def lower_bound_cost(jobs: Iterable, fleet: Sequence, end: float) -> float:
    """USD no policy can beat on this fleet: each job, from arrival for as long as it runs inside
    the window, pays the smallest share of a node it fits (of a GPU model it accepts): its largest
    fraction of the node's GPUs, CPU or memory, times the node's price (perfect packing, no boot,
    no idle time)."""
    cheapest = CheapestShare(fleet)
    return sum(cheapest(job) * max(0.0, min(job.arrival + job.run_seconds, end) - job.arrival) / HOUR
               for job in jobs)


CPU_STEP = 8000     # whole_node_floor counts CPU in steps of 8 cores (the nodes' sizes are multiples of it)


def whole_node_floor(jobs: Iterable, fleet: Sequence, end: float) -> float:
    """USD of the cheapest set of whole nodes of `fleet` whose GPUs and CPUs cover the jobs' summed
    demand at every instant (each job from arrival for its run, inside the window), as if jobs
    could move between nodes at no cost and split across them. Memory and GPU models are ignored.
    A relaxation of any placement that starts jobs on arrival, so, unlike lower_bound_cost, it
    charges what no such policy escapes: powering whole nodes, not shares of them."""
    deltas: dict[float, list[int]] = {}
    for job in jobs:
        run_end = min(job.arrival + job.run_seconds, end)
        if run_end <= job.arrival:
            continue
        for at, sign in ((job.arrival, 1), (run_end, -1)):
            delta = deltas.setdefault(at, [0, 0])
            delta[0] += sign * job.gpus
            delta[1] += sign * job.requests.get("cpu")
    levels: dict[tuple[int, int], float] = {}
    gpus = cpu = 0
    last = None
    for at in sorted(deltas):
        if last is not None and (gpus or cpu):
            key = (gpus, math.ceil(cpu / CPU_STEP))
            levels[key] = levels.get(key, 0.0) + at - last
        gpus, cpu, last = gpus + deltas[at][0], cpu + deltas[at][1], at
    if not levels:
        return 0.0
    top_g, top_c = max(g for g, _ in levels), max(c for _, c in levels)
    # best[g][c]: the cheapest nodes with at least g GPUs and c CPU steps (a bounded knapsack, each node once)
    best = [[math.inf] * (top_c + 1) for _ in range(top_g + 1)]
    best[0][0] = 0.0
    for node in fleet:
        node_g, node_c = node.gpus, node.cpu_milli // CPU_STEP
        for g in range(top_g, -1, -1):
            row = best[g]
            to = best[min(top_g, g + node_g)]
            for c in range(top_c, -1, -1):
                if row[c] < math.inf:
                    target = min(top_c, c + node_c)
                    to[target] = min(to[target], row[c] + node.price_per_hour)
    for g in range(top_g, -1, -1):      # covering more than asked is allowed
        for c in range(top_c, -1, -1):
            if g < top_g:
                best[g][c] = min(best[g][c], best[g + 1][c])
            if c < top_c:
                best[g][c] = min(best[g][c], best[g][c + 1])
    return sum(best[g][c] * seconds for (g, c), seconds in levels.items()) / HOUR

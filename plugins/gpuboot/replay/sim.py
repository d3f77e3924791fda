"""The simulated fleet: nodes that boot, run jobs, go idle and stop, on an event clock.

A policy (see `policies`) decides, for each waiting job, where it goes and what
to power on; this module carries the decision out with the emulated delays and
the shared idle-stop rule, and tells the `Recorder` what it cost.
"""
from __future__ import annotations

import math
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpuboot.core.idle import IdleRule, IdleVerdict
from gpuboot.core.model import LABEL_GPU_MODEL, LABEL_HOSTNAME, LABEL_MANAGED, NodeState, NodeView, Unavailable
from gpuboot.core.queue import Attempt, Entry, Hold, Running, releases_of, run_pass
from gpuboot.core.resources import Resources

from .clock import EventClock, Kind
from .metrics import BootEpisode, CheapestShare, Recorder, share_per_hour, team_of
from .trace import FleetNode, TraceJob


@dataclass(frozen=True)
class SimConfig:
    """The window and the emulated physical delays, the same for every policy."""

    start: float
    end: float
    start_seconds: float = 60.0           # ECS Starting -> Running
    boot_seconds: float = 60.0            # Running -> kubelet Ready
    device_plugin_seconds: float = 30.0   # Ready -> GPUs registered (the job can run)
    stop_seconds: float = 30.0            # Stopping -> Stopped (still billed)
    idle_timeout: float = 600.0           # an empty running node is stopped after this long (IdleRule)
    scaledown_every: float = 300.0        # how often scale-down looks again at a node it keeps as the spare
    queue_timeout: float = 0.0            # a job still waiting this long after arrival fails (0: never)
    teams: int = 4                        # trace jobs are spread over this many teams (metrics.team_of)
    poll_seconds: float = 30.0            # a waiting place step looks again this often (busy_poll_seconds)
    expected_runtime: bool = False        # jobs state their runtime (the trace's own) so backfill can use it
    preemptible: float = 0.0              # the share of jobs that say they are preemptible (metrics.team_of's hash)

    def __post_init__(self):
        if self.end <= self.start:
            raise ValueError(f"window: end ({self.end}) must be after start ({self.start})")
        for name in ("start_seconds", "boot_seconds", "device_plugin_seconds", "stop_seconds", "queue_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("idle_timeout", "scaledown_every"):     # scale-down runs and stops at a time, not at once
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")

    @property
    def boot_delay(self) -> float:
        return self.start_seconds + self.boot_seconds + self.device_plugin_seconds


class SimNode:
    """One ECS GPU node: its power state, what is placed on it and its current boot."""

    def __init__(self, spec: FleetNode):
        self.spec = spec
        self.name = spec.name
        self.capacity = spec.capacity
        self.price = spec.price_per_hour
        self.state = NodeState.STOPPED
        self.allocated = Resources()
        self.running: dict[str, float] = {}   # jobs running here -> when each started
        self.waiting: list[TraceJob] = []   # jobs placed here, waiting for the boot
        self.powered_since: float | None = None
        self.episode: BootEpisode | None = None
        self.start_after_stop = False
        self.idle_token = 0
        self.idle_since = 0.0
        self.marked_at = 0.0                 # the bill is split by cause up to here (Simulation._mark)
        self._view: NodeView | None = None

    @property
    def free(self) -> Resources:
        return self.capacity - self.allocated

    @property
    def busy_since(self) -> float | None:
        """When the oldest job running here started (NodeView.busy_since)."""
        return min(self.running.values(), default=None)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def changed(self) -> None:
        self._view = None

    def view(self) -> NodeView:
        """This node as the inventory would show it (cached until it changes)."""
        if self._view is None:
            spec = self.spec
            self._view = NodeView(
                name=self.name, hostname=self.name, state=self.state, reason="replay",
                allocatable=self.capacity, allocated=self.allocated,
                labels={LABEL_GPU_MODEL: spec.gpu_model, LABEL_MANAGED: "true", LABEL_HOSTNAME: self.name},
                taints=(), instance_id=f"i-{self.name}", instance_type=spec.instance_type, zone=None,
                gpu_model=spec.gpu_model, price_per_hour=self.price, managed=True,
                busy_since=self.busy_since)
        return self._view


class Simulation:
    """Replays `jobs` on `fleet` under `policy`; `run()` returns the policy's Recorder."""

    def __init__(self, fleet: Sequence[FleetNode], jobs: Sequence[TraceJob], policy, config: SimConfig):
        self.policy = policy
        self.config = config
        self.clock = EventClock(config.start)
        self.nodes = {spec.name: SimNode(spec) for spec in sorted(fleet, key=lambda n: n.name)}
        self.jobs = [job for job in jobs if config.start <= job.arrival < config.end]
        self.job_by_name = {job.name: job for job in self.jobs}
        self.run_token: dict[str, int] = {}       # job -> its current run (a preempted run's end is ignored)
        self.tried: set[str] = set()              # jobs place() has judged once (a NEVER is found then)
        self.queue: list[TraceJob] = []
        self.recorder = Recorder(policy.name, config.start, config.end, jobs=len(self.jobs))
        self.idle_rule = IdleRule(config.idle_timeout, getattr(policy, "spare_seconds", 0.0))
        self.queue_config = getattr(policy, "queue", None)     # None: today's retry loop, no order, no holds
        self.entries: dict[str, Entry] = {}
        self.holds: dict[str, Hold] = {}
        self.usage: dict[str, dict[str, int]] = {}             # team -> GPU model -> GPUs placed
        self.team_of_job: dict[str, tuple[str, str]] = {}      # job placed -> (team, GPU model)
        self.capacity: dict[str, int] = {}
        for spec in fleet:
            self.capacity[spec.gpu_model] = self.capacity.get(spec.gpu_model, 0) + spec.gpus
        self.cheapest_share = CheapestShare(fleet)
        self.pass_due = False
        self.held_since: tuple[float, float, float] = (config.start, 0.0, 0.0)   # (at, free GPUs, USD/h) held then

    # What policies read -----------------------------------------------------
    def ordered_nodes(self) -> list[SimNode]:
        return list(self.nodes.values())

    def views(self, per_class: int | None = None) -> list[NodeView]:
        """Every node as a NodeView, or only the first `per_class` (by name) of each class of twins.

        Twins (same state, model, capacity, allocation and oldest work) are interchangeable
        for placement, which breaks ties by name: a job of k tasks never needs more than
        the k first-named twins, so `place()` returns the same plan on the reduced
        list (tests/unit/gpuboot/replay/test_sim.py checks it) at a fraction of the cost.
        """
        if per_class is None:
            return [node.view() for node in self.nodes.values()]
        seen: dict[tuple, int] = {}
        views = []
        for node in self.nodes.values():
            key = (node.state, node.spec.model, node.capacity, node.allocated, node.busy_since)
            if seen.get(key, 0) < per_class:
                seen[key] = seen.get(key, 0) + 1
                views.append(node.view())
        return views

    # The run -----------------------------------------------------------------
    def run(self) -> Recorder:
        began = time.perf_counter()
        for node in self.nodes.values():
            node.marked_at = self.config.start
        if self.policy.always_on:
            for node in self.nodes.values():
                node.state = NodeState.READY
                self._power_on(node)
        for job in self.jobs:
            self.clock.schedule(job.arrival, Kind.ARRIVAL, job)
        handlers = {Kind.ARRIVAL: self._arrival, Kind.JOB_END: self._job_end, Kind.NODE_READY: self._node_ready,
                    Kind.NODE_STOPPED: self._node_stopped, Kind.IDLE_CHECK: self._idle_check,
                    Kind.QUEUE_PASS: self._queue_pass}
        while (next_at := self.clock.peek_time()) is not None and next_at < self.config.end:
            event = self.clock.pop()
            handlers[event.kind](event.payload)
        self._close()
        self.wall_seconds = time.perf_counter() - began
        return self.recorder

    def _close(self) -> None:
        """At the window end: bill what is still on, count who still waits, judge open boots."""
        end = self.config.end
        self._account_holds(end)
        for node in self.nodes.values():
            self._mark(node)
            if node.powered_since is not None:
                self.recorder.powered(node.capacity.gpus, node.price, node.powered_since, end)
            if node.episode is not None and node.state is not NodeState.BOOTING:
                self.recorder.boot_closed(node.episode)   # booted and up, yet none of its jobs ran there
            self.recorder.waiting_at_end += len(node.waiting)
            self.recorder.unstarted += [job.gpus for job in node.waiting]
        self.recorder.waiting_at_end += len(self.queue)
        self.recorder.unstarted += [job.gpus for job in self.queue]

    # Events -----------------------------------------------------------------
    def _arrival(self, job: TraceJob) -> None:
        if (floor := self._floor(job)) < math.inf:      # inf: no node holds it (never fits)
            self.recorder.floors.append((job.gpus, floor))
        if self.queue_config is None:
            self._decide(job, arriving=True)
            return
        self._enqueue(job)
        self.queue.append(job)
        self._queue_pass()      # the arriving job's own place step decides at once, in order

    def _floor(self, job: TraceJob) -> float:
        """The soonest `job` could start without preemption, were nothing else placed from now on: on
        a stopped node that holds it, one boot; on a node that is up, when enough of the work on it has
        ended (the trace's runtimes, which the policy may not know). A floor on its wait from the
        state at its arrival: if it is long, no order or hold could have started the job sooner."""
        now, best = self.clock.now, math.inf
        for node in self.nodes.values():
            if not (job.requests.fits_in(node.capacity) and job.accepts(node.spec)):
                continue
            if node.state in (NodeState.STOPPED, NodeState.STOPPING):
                best = min(best, self.config.boot_delay)
                continue
            free, at = node.free, now
            ends = sorted([(began + self.job_by_name[name].run_seconds, self.job_by_name[name].requests)
                           for name, began in node.running.items()] +
                          [(now + self.config.boot_delay + other.run_seconds, other.requests) for other in node.waiting],
                          key=lambda end: end[0])
            for end, requests in ends:
                if job.requests.fits_in(free):
                    break
                free, at = free + requests, end
            if job.requests.fits_in(free):
                best = min(best, at - now)
        return best

    def _enqueue(self, job: TraceJob) -> None:
        """The job's queue entry; a preempted job keeps its arrival as its enqueue time."""
        self.entries[job.name] = Entry(job.name, job.requests, 1, job.gpu_models,
                                       team_of(job.name, self.config.teams), enqueued_at=job.arrival,
                                       expected_runtime=job.run_seconds if self.config.expected_runtime else None,
                                       preemptible=self._preemptible(job))
        if job.gpus > 1:        # a live waiter polls all along: its pass when it starves, and when it may preempt
            config = self.queue_config
            for after in (config.starve_seconds, config.starve_seconds + (config.preempt_after_seconds or 0)):
                if job.arrival + after > self.clock.now:
                    self.clock.schedule(job.arrival + after, Kind.QUEUE_PASS)

    def _preemptible(self, job: TraceJob) -> bool:
        return zlib.crc32(f"preemptible:{job.name}".encode()) % 1000 < self.config.preemptible * 1000

    def _job_end(self, payload: tuple[TraceJob, str, int]) -> None:
        job, name, token = payload
        if self.run_token.get(job.name) != token:
            return              # that run was preempted
        node = self.nodes[name]
        self._mark(node)
        node.running.pop(job.name, None)
        node.allocated = node.allocated - job.requests
        if job.name in self.team_of_job:
            team, model = self.team_of_job.pop(job.name)
            self.usage[team][model] -= job.gpus
        node.changed()
        self._arm_idle(node)
        self._retry_queue()

    def _node_ready(self, name: str) -> None:
        node = self.nodes[name]
        self._mark(node)
        node.state = NodeState.READY
        node.changed()
        waiting, node.waiting = node.waiting, []
        for job in waiting:
            self._start_job(job, node)
        self._arm_idle(node)
        self._retry_queue()

    def _node_stopped(self, name: str) -> None:
        node = self.nodes[name]
        self._mark(node)
        node.state = NodeState.STOPPED
        self._power_off(node)
        node.changed()
        if node.start_after_stop:
            node.start_after_stop = False
            self._boot(node)
        self._retry_queue()

    def _idle_check(self, payload: tuple[str, int]) -> None:
        """Scale-down's look at an idle node: the policy's IdleRule (gpuboot.core.idle) stops it, or keeps
        it as the spare and looks again at the next scale-down run."""
        name, token = payload
        node = self.nodes[name]
        if token != node.idle_token or node.state is not NodeState.READY or not node.idle:
            return
        now, rule = self.clock.now, self.idle_rule
        elsewhere = sum(max(0, other.free.gpus) for other in self.nodes.values()
                        if other is not node and other.state in (NodeState.READY, NodeState.BOOTING))
        idle_for = round(now - node.idle_since, 6)     # armed at idle_since + idle time: no float shortfall
        verdict, _ = rule.verdict(idle_for, node.capacity.gpus, elsewhere)
        if verdict is not IdleVerdict.STOP:
            latest = node.idle_since + rule.idle_seconds + rule.spare_seconds
            self.clock.schedule(min(now + self.config.scaledown_every, latest), Kind.IDLE_CHECK, payload)
            return
        self._mark(node)
        node.state = NodeState.STOPPING
        node.changed()
        if node.episode is not None:
            self.recorder.boot_closed(node.episode)
            node.episode = None
        self.clock.schedule(self.clock.now + self.config.stop_seconds, Kind.NODE_STOPPED, name)

    # Decisions --------------------------------------------------------------
    def _decide(self, job: TraceJob, arriving: bool) -> bool:
        """Ask the policy about `job` and carry it out; False when the job still waits."""
        self.recorder.placement_calls += 1
        return self._carry_out(job, self.policy.decide(job, self, arriving), arriving)

    def _carry_out(self, job: TraceJob, decision, arriving: bool) -> bool:
        if decision.never:
            self.recorder.job_never_fits(decision.never)
            return True
        for name in decision.start:
            self._request_start(self.nodes[name], job)
        if decision.node is None:
            if arriving:
                self.queue.append(job)
            return False
        node = self.nodes[decision.node]
        node.allocated = node.allocated + job.requests
        node.changed()
        if job.name in self.entries:
            team = self.entries.pop(job.name).team
            self.team_of_job[job.name] = (team, node.spec.gpu_model)
            by_model = self.usage.setdefault(team, {})
            by_model[node.spec.gpu_model] = by_model.get(node.spec.gpu_model, 0) + job.gpus
        if node.state is NodeState.READY:
            self._start_job(job, node)
        else:
            node.waiting.append(job)
            if node.episode is not None:
                node.episode.booted_for.add(job.name)
        return True

    def _retry_queue(self) -> None:
        """Give every waiting job another try, in arrival order.

        Placing a job only takes capacity away, so once a request shape is refused
        in this pass, later jobs of the same shape are refused too: skip them.
        """
        self._drop_late()
        if not self.queue:
            return
        if self.queue_config is not None:      # the waiting jobs see the release at their next poll
            if not self.pass_due:
                self.pass_due = True
                self.clock.schedule(self.clock.now + self.config.poll_seconds, Kind.QUEUE_PASS)
            return
        refused: set[tuple] = set()
        still: list[TraceJob] = []
        for job in self.queue:
            shape = (job.requests, job.gpu_models)     # a T4 job is not refused because a V100 job was
            if shape in refused or not self._decide(job, arriving=False):
                refused.add(shape)
                still.append(job)
        self.queue = still

    def _queue_pass(self, _payload=None) -> None:
        """One decision over the waiting set (gpuboot.core.queue.run_pass, as the place steps make it)."""
        self.pass_due = False
        self._drop_late()
        now = self.clock.now
        self._account_holds(now)
        waiting = {job.name: job for job in self.queue}
        for name in [n for n in self.entries if n not in waiting]:
            del self.entries[name]
        decisions: dict[str, object] = {}
        never: set[str] = set()

        room: dict[tuple, int] = {}     # models -> the most GPUs one node could give now (marks ignored)

        def attempt(entry: Entry, marks: list[Unavailable]) -> Attempt:
            job = waiting[entry.job_id]
            if job.name in self.tried and job.gpus > self._room(job, room):
                return Attempt(False, None, "busy")     # no node could give it the GPUs: place() would say so
            self.tried.add(job.name)
            self.recorder.placement_calls += 1
            decision = self.policy.decide(job, self, False, marks)
            decisions[entry.job_id] = decision
            if decision.never:
                never.add(entry.job_id)
            model = self.nodes[decision.node].spec.gpu_model if decision.node else None
            return Attempt(decision.node is not None, model, decision.never or "busy", bool(decision.never))

        def commit(entry: Entry, _: Attempt) -> None:
            room.clear()
            self._carry_out(waiting.pop(entry.job_id), decisions[entry.job_id], False)

        for name in never:
            self._carry_out(waiting.pop(name), decisions[name], False)
        placed = self._placed()
        result = run_pass([self.entries[n] for n in waiting], now=now, config=self.queue_config, usage=self.usage,
                          capacity=self.capacity, holds=self.holds, nodes=self.views, attempt=attempt,
                          commit=commit, releases=releases_of(self.views(), placed, now, self.queue_config.hold_seconds),
                          running=placed if self.config.preemptible else [])
        for name in never & set(waiting):
            self._carry_out(waiting.pop(name), decisions[name], False)
        self.holds = result.holds
        self.queue = list(waiting.values())
        for preemptor, victims in result.preempt.items():
            self.holds[preemptor] = replace(self.holds[preemptor], firm=True)    # as JobQueue.preempt writes it
            for name in victims:
                self._preempt(name)
        self._account_holds(now)
        if result.preempt:
            self._retry_queue()         # the held job finds its room at its next poll

    def _placed(self) -> list[Running]:
        """The jobs placed on nodes, as the live queue sees them (gpuboot.lifecycle.preemption.running_jobs):
        those running, their runtimes stated only when jobs state them, and those waiting for their node's
        boot, started now with no known end (no work lost: the first a preemption takes)."""
        known, now = self.config.expected_runtime, self.clock.now
        running = [Running(name, node.name, job.requests, preemptible=self._preemptible(job), started_at=began,
                           enqueued_at=job.arrival, expected_runtime=job.run_seconds if known else None,
                           team=team_of(job.name, self.config.teams))
                   for node in self.nodes.values() for name, began in node.running.items()
                   for job in (self.job_by_name[name],)]
        booting = [Running(job.name, node.name, job.requests, preemptible=self._preemptible(job), started_at=now,
                           enqueued_at=job.arrival, team=team_of(job.name, self.config.teams))
                   for node in self.nodes.values() for job in node.waiting]
        return running + booting

    def _preempt(self, name: str) -> None:
        """Stop a preemptible job and requeue it: running (its pods deleted; it runs again from the
        start), or placed on a node still booting (nothing run, nothing lost)."""
        job = self.job_by_name[name]
        node = next(n for n in self.nodes.values() if name in n.running or job in n.waiting)
        self._mark(node)
        if job in node.waiting:
            node.waiting.remove(job)
            self.recorder.preemptions += 1          # it never started: no run to lose or to take back
        else:
            began = node.running.pop(name)
            self.recorder.job_share(share_per_hour(job.requests, node.capacity, node.price),
                                    self.cheapest_share(job), began + job.run_seconds, self.clock.now)
            self.run_token[name] += 1
            self.recorder.job_preempted(name, began, self.clock.now, job.gpus, job.run_seconds)
        node.allocated = node.allocated - job.requests
        node.changed()
        team, model = self.team_of_job.pop(name)
        self.usage[team][model] -= job.gpus
        self._enqueue(job)
        self.queue.append(job)

    def _room(self, job: TraceJob, room: dict[tuple, int]) -> int:
        """The most GPUs any node of the job's models could give it now: free on a node that is up, all
        on one to start. An upper bound of what place() finds (it also checks CPU, memory and marks), so
        a job asking more is refused without a placement: a backlog of thousands stays cheap."""
        if job.gpu_models not in room:
            room[job.gpu_models] = max(
                (node.free.gpus if node.state in (NodeState.READY, NodeState.BOOTING) else node.capacity.gpus
                 for node in self.nodes.values() if job.accepts(node.spec)), default=0)
        return room[job.gpu_models]

    def _account_holds(self, now: float) -> None:
        """Bill the GPUs left free on held nodes since the last look, then note what is held now."""
        at, free, usd = self.held_since
        self.recorder.hold_gpu_seconds += free * (now - at)
        self.recorder.hold_cost += usd * (now - at) / 3600.0
        free = usd = 0.0
        for hold in self.holds.values():
            for name in hold.nodes:
                node = self.nodes[name]
                if node.state in (NodeState.READY, NodeState.BOOTING) and node.capacity.gpus:
                    free += max(0, node.free.gpus)
                    usd += node.price * max(0, node.free.gpus) / node.capacity.gpus
        self.held_since = (now, free, usd)

    def _drop_late(self) -> None:
        """Jobs past their queue timeout fail (the live place step gives up at its deadline)."""
        timeout = self.config.queue_timeout
        if timeout and self.queue:
            late = [job for job in self.queue if job.arrival + timeout <= self.clock.now]
            if late:
                self.recorder.timeouts += [job.gpus for job in late]
                self.queue = [job for job in self.queue if job.arrival + timeout > self.clock.now]

    # Power ------------------------------------------------------------------
    def _request_start(self, node: SimNode, job: TraceJob) -> None:
        if node.state is NodeState.STOPPED:
            self._boot(node)
        elif node.state is NodeState.STOPPING:
            node.start_after_stop = True       # StartInstances is accepted once the stop completes
            node.episode = node.episode or BootEpisode(node.name, self.clock.now)
        if node.episode is not None:
            node.episode.booted_for.add(job.name)

    def _boot(self, node: SimNode) -> None:
        self._mark(node)
        node.state = NodeState.BOOTING
        node.changed()
        node.episode = node.episode or BootEpisode(node.name, self.clock.now)
        self.recorder.boots += 1
        self._power_on(node)
        self.clock.schedule(self.clock.now + self.config.boot_delay, Kind.NODE_READY, node.name)

    def _power_on(self, node: SimNode) -> None:
        node.powered_since = self.clock.now
        self.recorder.power_change(self.clock.now, 1, node.capacity.gpus)

    def _power_off(self, node: SimNode) -> None:
        self.recorder.powered(node.capacity.gpus, node.price, node.powered_since, self.clock.now)
        node.powered_since = None
        self.recorder.power_change(self.clock.now, -1, -node.capacity.gpus)

    def _arm_idle(self, node: SimNode) -> None:
        if node.idle and not self.policy.always_on:
            node.idle_token += 1
            node.idle_since = self.clock.now
            self.clock.schedule(self.clock.now + self.config.idle_timeout, Kind.IDLE_CHECK,
                                (node.name, node.idle_token))

    # Jobs -------------------------------------------------------------------
    def _mark(self, node: SimNode) -> None:
        """Bill `node`'s seconds since its last mark to what they were for (Recorder.gap), before it changes:
        booting or stopping, busy, or empty (idle up to its idle time, the spare after)."""
        now, since = self.clock.now, node.marked_at
        node.marked_at = now
        if node.state in (NodeState.BOOTING, NodeState.STOPPING):
            self.recorder.segment("booting", node.price, since, now)
        elif node.state is NodeState.READY and node.running:
            self.recorder.segment("busy", node.price, since, now)
        elif node.state is NodeState.READY:
            spare_from = min(max(since, node.idle_since + self.config.idle_timeout), now)
            self.recorder.segment("idle", node.price, since, spare_from)
            self.recorder.segment("spare", node.price, spare_from, now)

    def _start_job(self, job: TraceJob, node: SimNode) -> None:
        self._mark(node)
        self.recorder.job_share(share_per_hour(job.requests, node.capacity, node.price),
                                self.cheapest_share(job), self.clock.now, self.clock.now + job.run_seconds)
        node.running[job.name] = self.clock.now
        node.changed()
        node.idle_token += 1                  # cancels a pending idle stop
        if node.episode is not None and job.name in node.episode.booted_for:
            node.episode.served = True
        self.recorder.job_started(job.arrival, self.clock.now, job.gpus, job.run_seconds,
                                  team_of(job.name, self.config.teams), job.name)
        self.run_token[job.name] = self.run_token.get(job.name, 0) + 1
        self.clock.schedule(self.clock.now + job.run_seconds, Kind.JOB_END, (job, node.name, self.run_token[job.name]))

"""Boot policies compared by the replay, each a small strategy object.

`decide(job, cluster, arriving)` answers for one waiting job: the node it goes to
(None = keep waiting), the nodes to power on, or why it can never run. The
simulation carries the answer out with the same delays and idle-stop rule for
every policy, so only the decisions differ.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuboot.core.idle import DEFAULT_SPARE_SECONDS
from gpuboot.core.model import STATE_RANK, NodeState, Unavailable
from gpuboot.core.placement import CostModel, JobRequest, Outcome, TaskRequest, place
from gpuboot.core.queue import QueueConfig
from gpuboot.core.resources import Resources

_STARTABLE = (NodeState.STOPPED, NodeState.STOPPING)


@dataclass(frozen=True)
class Decision:
    node: str | None = None          # where the job goes now (it waits there if the node is not up yet)
    start: tuple[str, ...] = ()      # nodes to power on
    never: str | None = None         # why the job can never run in this fleet


DEFAULT_QUEUE = QueueConfig()     # equal weights, no quotas, the default starvation threshold


class Gpuboot:
    """Ours: `gpuboot.core.placement.place` as the DAGs call it, and the scale-down's idle rule with its
    spare (gpuboot.core.idle.IdleRule: the idle stop of the others, but the fleet's spare kept up to
    `spare_seconds` longer)."""

    name = "gpuboot"
    always_on = False

    def __init__(self, place: Callable = place, exact: bool = False, spare_seconds: float = DEFAULT_SPARE_SECONDS,
                 queue: QueueConfig | None = DEFAULT_QUEUE, boot_fill_from_load: float = 0.0):
        self._place = place   # the product's placement; a test may pass a counting wrapper
        # True: show place() every node, not one per class of twins; always so when place() reads the load
        self._exact = exact or bool(boot_fill_from_load)
        self.boot_fill_from_load = boot_fill_from_load   # the gpu_job field of that name (placement.CostModel)
        self.spare_seconds = spare_seconds
        self.queue = queue    # the job queue's order, quotas and holds (gpuboot.core.queue); None: today's retry loop

    def decide(self, job, cluster, arriving: bool, unavailable: Sequence[Unavailable] = ()) -> Decision:
        """`unavailable`: the holds of other jobs (node marks); the twins kept per class grow by their
        number, so a held node never hides an unheld twin from place()."""
        request = JobRequest(job_id=job.name, min_available=1, boot_fill_from_load=self.boot_fill_from_load,
                             tasks=(TaskRequest(name=job.name, requests=job.requests, gpu_model=job.gpu_models),))
        views = cluster.views(None if self._exact else len(request.tasks) + len(unavailable))
        plan = self._place(request, views, unavailable, cost=cost_model(cluster.config))
        if plan.outcome is Outcome.FITS:
            return Decision(node=plan.assignments[0].node, start=tuple(plan.nodes_to_start))
        if plan.outcome is Outcome.NEVER:
            return Decision(never=plan.message)
        return Decision()


def cost_model(config) -> CostModel:
    """The placement's cost model with the simulation's own delays (boot, stop, idle stop)."""
    return CostModel(boot_seconds=config.boot_delay, stop_seconds=config.stop_seconds,
                     idle_seconds=config.idle_timeout)


class GpubootNoQueue(Gpuboot):
    """Ours before the job queue: every waiting job retried in arrival order when capacity frees, no
    order across teams, no holds (kept to measure what the queue changes)."""

    name = "gpuboot-noqueue"

    def __init__(self, **kwargs):
        super().__init__(**kwargs, queue=None)


class AlwaysOn(Gpuboot):
    """Every node powered on from the start and never stopped; placement as ours."""

    name = "always-on"
    always_on = True


class AllocateTime:
    """All nodes considered at allocation, running preferred, per-node fit, first fit by name; the
    plain idle stop (no spare), as a cluster autoscaler's."""

    name = "allocate-time"
    always_on = False
    spare_seconds = 0.0

    def decide(self, job, cluster, arriving: bool) -> Decision:
        best = None
        for node in cluster.ordered_nodes():        # name order: the first of each rank wins
            rank = STATE_RANK.get(node.state)
            if rank is not None and (best is None or rank < best[0]) and job.requests.fits_in(node.free) \
                    and job.accepts(node.spec):
                best = (rank, node)
                if rank == 0:
                    break
        if best is not None:
            node = best[1]
            return Decision(node=node.name, start=(node.name,) if node.state in _STARTABLE else ())
        if not any(job.requests.fits_in(node.capacity) and job.accepts(node.spec) for node in cluster.ordered_nodes()):
            return Decision(never=f"no node in this fleet can hold {job.requests}"
                            + (f" (model {' or '.join(job.gpu_models)})" if job.gpu_models else ""))
        return Decision()


class QueueTime:
    """The queue-time baseline: at queueing, boot a stopped instance of size R3 when the cluster's free
    resources R2 plus R3 cover the job's need R1 (R2 + R3 >= R1), even if no single node fits.
    The job then waits until it fits on some running node; it is never re-evaluated for a boot."""

    name = "queue-time"
    always_on = False
    spare_seconds = 0.0

    def decide(self, job, cluster, arriving: bool) -> Decision:
        nodes = [node for node in cluster.ordered_nodes() if job.accepts(node.spec)]   # its GPU models only
        for node in nodes:                           # the scheduler binds where it fits now
            if node.state is NodeState.READY and job.requests.fits_in(node.free):
                return Decision(node=node.name)
        if not arriving:
            return Decision()
        cluster_free = Resources()                   # R2: free resources of every node that is up or coming up
        for node in nodes:
            if node.state in (NodeState.READY, NodeState.BOOTING):
                cluster_free = cluster_free + node.free
        if job.requests.fits_in(cluster_free):
            return Decision()                        # "enough room in the cluster": no boot, just wait
        for node in nodes:
            if node.state is NodeState.STOPPED and job.requests.fits_in(cluster_free + node.capacity):
                return Decision(start=(node.name,))
        return Decision()


POLICIES = {cls.name: cls for cls in (AlwaysOn, QueueTime, AllocateTime, GpubootNoQueue, Gpuboot)}

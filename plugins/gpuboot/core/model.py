"""The values every layer shares: node states and views, reservations, unavailable capacity,
the labels gpuboot reads and writes, and the constants several modules need (one definition each).

Pure data, no decisions: inventory builds NodeViews, placement ranks them, the ledger stores
Reservations and Unavailable marks, the replay and chaos reuse the same names.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from gpuboot.core.resources import Resources

LABEL_GPU_MODEL = "aliyun.accelerator/nvidia_name"
LABEL_GPU_COUNT = "aliyun.accelerator/nvidia_count"
LABEL_MANAGED = "gpuboot.io/managed"
LABEL_JOB = "gpuboot.io/job"
LABEL_TASK = "gpuboot.io/task"
LABEL_PRICE = "gpuboot.io/price-per-hour"   # optional node label/annotation, e.g. "3.2"
LABEL_RANK = "gpuboot.io/rank"              # a gang pod's rank (0 .. WORLD_SIZE-1)
LABEL_ATTEMPT = "gpuboot.io/attempt"        # the launch attempt a gang pod belongs to
ANNOTATION_IDLE_SINCE = "gpuboot.io/idle-since"     # when scale-down first saw the node idle (RFC 3339)
ANNOTATION_CORDONED_BY = "gpuboot.io/cordoned-by"   # who cordoned the node, so only gpuboot un-cordons its own
ANNOTATION_LEDGER = "gpuboot.io/ledger"             # the ledger (namespace/name) that books the node: one per node


def ledger_of(node: Mapping) -> str | None:
    """The ledger a Node is booked through (ANNOTATION_LEDGER), None before its first booking."""
    return ((node.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_LEDGER)
LABEL_HOSTNAME = "kubernetes.io/hostname"
LABEL_INSTANCE_TYPE = "node.kubernetes.io/instance-type"
LABEL_ZONE = "topology.kubernetes.io/zone"
TAG_MANAGED = "gpuboot:managed"

TERMINATED_PHASES = ("Succeeded", "Failed")    # a pod in these holds no node resources


class FrozenDict(dict):
    """A read-only dict: JSON-, pickle- and deepcopy-friendly (Airflow copies operators), hashable."""

    def _readonly(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is read-only; build a new one instead")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _readonly

    def __hash__(self) -> int:  # type: ignore[override]  # dict sets __hash__ = None; this one is frozen
        return hash(frozenset(self.items()))

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"


class NodeState(str, Enum):
    READY = "ready"
    BOOTING = "booting"
    STOPPED = "stopped"
    STOPPING = "stopping"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Reservation:
    """Capacity promised to one task of a job on one node, until `expires_at` (epoch seconds)."""

    job_id: str
    task: str
    node: str
    resources: Resources
    expires_at: float

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "task": self.task, "node": self.node,
                "resources": self.resources.to_json(), "expires_at": self.expires_at}

    @classmethod
    def from_json(cls, data: Mapping) -> Reservation:
        return cls(job_id=data["job_id"], task=data["task"], node=data["node"],
                   resources=Resources.from_json(data["resources"]), expires_at=float(data["expires_at"]))


@dataclass(frozen=True)
class NodeView:
    name: str
    hostname: str
    state: NodeState
    reason: str
    allocatable: Resources
    allocated: Resources
    labels: Mapping[str, str] = field(default_factory=FrozenDict)
    taints: tuple[dict, ...] = ()
    instance_id: str | None = None
    instance_type: str | None = None
    zone: str | None = None
    gpu_model: str | None = None
    price_per_hour: float | None = None
    managed: bool = False
    holders: tuple[str, ...] = ()     # who uses its capacity (jobs, other pods), for "busy" reasons
    # When the oldest workload still on the running node started (epoch seconds; None: no workload
    # pod, or the node is not running).
    # Placement fills the node whose work started earliest first (gpuboot.core.placement, "Among running
    # nodes"); it orders nodes a verdict already ranked equal, so it is no twin input.
    busy_since: float | None = None
    # A token twins share: views with one token are equal in all that placement judges a node by
    # but what is the node's own (name, labels, reason, offering, holders; see
    # gpuboot.core.placement._twin_inputs), so it judges them once. Each view gets its own, and
    # dataclasses.replace a new one; build_inventory gives twins one (inventory._share_twin).
    twin: object = field(default_factory=object, init=False, compare=False, repr=False)


    @cached_property
    def free(self) -> Resources:
        return self.allocatable - self.allocated


# Preference among node states: running beats booting beats stopped (stopping last); a state not
# here (UNAVAILABLE) is never a candidate.
STATE_RANK = {NodeState.READY: 0, NodeState.BOOTING: 1, NodeState.STOPPED: 2, NodeState.STOPPING: 3}
# Taints the node-lifecycle controller keeps on a node that is not (yet) Ready or reachable.
NOT_READY_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})


HOLD_REASON = "held for job"     # a node mark keeping the node for one job (gpuboot.core.queue; a preemption)


@dataclass(frozen=True)
class Unavailable:
    """Capacity placement must not count on until `expires_at` (epoch seconds).

    Either an offering, an instance type in a zone whose start just failed for lack of stock
    (it blocks only nodes that would need a start: Karpenter's insufficient-capacity cache),
    or one node that did not become GPU-ready in time (it blocks that node in any state).
    `boot_id`: for a node mark, the bootID the failed boot left (the evidence the mark rests
    on; gpuboot.lifecycle.booking drops the mark once the node reports another boot or is Ready).
    `failed_for_job`: the node failed the job being placed (its own record, never stored as a mark):
    placement says NEVER, not BUSY, when only such nodes could hold the job.
    A node mark whose reason is `HOLD_REASON <job id>` keeps the node for that job (`held_for`):
    it blocks every other job, not that one."""

    reason: str
    expires_at: float
    instance_type: str | None = None
    zone: str | None = None
    node: str | None = None
    boot_id: str | None = None
    failed_for_job: bool = False

    def __post_init__(self):
        if (self.node is None) == (self.instance_type is None or self.zone is None):
            raise ValueError("Unavailable: give either node, or instance_type and zone")

    @property
    def what(self) -> str:
        return f"node {self.node}" if self.node else f"offering {self.instance_type} in {self.zone}"

    @classmethod
    def holding(cls, job_id: str, node: str, until: float) -> Unavailable:
        """A mark keeping `node` for `job_id` until `until` (read back by `held_for`)."""
        return cls(reason=f"{HOLD_REASON} {job_id}", expires_at=until, node=node)

    @property
    def held_for(self) -> str | None:
        """The job this mark keeps its node for (None: it keeps the node from every job)."""
        prefix = HOLD_REASON + " "
        return self.reason[len(prefix):] if self.node is not None and self.reason.startswith(prefix) else None

    def blocks(self, node: NodeView) -> bool:
        if self.node is not None:
            return node.name == self.node
        return node.state in _NEEDS_START and (node.instance_type, node.zone) == (self.instance_type, self.zone)

    def to_json(self) -> dict:
        return {k: v for k, v in (("reason", self.reason), ("expires_at", self.expires_at),
                                  ("instance_type", self.instance_type), ("zone", self.zone),
                                  ("node", self.node), ("boot_id", self.boot_id)) if v is not None}

    @classmethod
    def from_json(cls, d: Mapping) -> Unavailable:
        return cls(reason=str(d["reason"]), expires_at=float(d["expires_at"]), instance_type=d.get("instance_type"),
                   zone=d.get("zone"), node=d.get("node"), boot_id=d.get("boot_id"))


_NEEDS_START = (NodeState.STOPPED, NodeState.STOPPING)


def blocked_nodes(unavailable: Sequence[Unavailable], nodes: Sequence[NodeView]) -> list[int]:
    """The indices of the nodes some entry of `unavailable` blocks (`Unavailable.blocks`), in one
    pass with set lookups: a fleet of 10,000 nodes and a few marks, not 10,000 times each mark."""
    if not unavailable:
        return []
    names = {u.node for u in unavailable if u.node is not None}
    offerings = {(u.instance_type, u.zone) for u in unavailable if u.node is None}
    return [i for i, node in enumerate(nodes) if node.name in names
            or (offerings and node.state in _NEEDS_START and (node.instance_type, node.zone) in offerings)]

"""A job's pods as one gang: their manifests (rank environment, node pinning) and one verdict
over all of them. Pure: the launch step (gpuboot.operators.launch) and its trigger
(gpuboot.triggers.gang) do the I/O.

Ranks are the plan's assignments in order (0 .. WORLD_SIZE-1). With `min_available` <
`replicas`, placement may have placed only some tasks: the gang is then the tasks that got a
place, WORLD_SIZE is their number (between min_available and replicas), and the others are not
launched later. An elastic job reads WORLD_SIZE; GPUBOOT_TASK_INDEX keeps the task's index
among all replicas.

MASTER_ADDR is rank 0's pod IP: rank 0 is created first (its own MASTER_ADDR is its
`status.podIP` through the downward API), the others once its IP is known. Why not a headless
Service with pod hostname/subdomain: it needs a Service and cluster DNS per job, another RBAC
verb, and DNS records that appear only once the pod is Ready (publishNotReadyAddresses aside),
while a pod IP is fixed for the pod's life, and a gang whose rank 0 dies is relaunched whole
(restartPolicy Never, one fate), so a new rank 0 never needs the old address.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuboot.core.inventory import parse_time
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import (
    LABEL_ATTEMPT,
    LABEL_HOSTNAME,
    LABEL_JOB,
    LABEL_RANK,
    LABEL_TASK,
    TERMINATED_PHASES,
    NodeState,
)
from gpuboot.core.placement import Assignment, Outcome, Plan

MASTER_PORT = 29500           # torchrun's default
CONTAINER = "base"            # the container's name (the pod operator's, so `kubectl logs` habits hold)
TASK_INDEX_ENV = "GPUBOOT_TASK_INDEX"
RANK_ENV = ("WORLD_SIZE", "RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", TASK_INDEX_ENV)


def node_selector(spec: JobSpec, assignment: Assignment) -> dict[str, str]:
    """Where a rank's pod may run: the job's own selector, pinned to its planned node."""
    return {**spec.node_selector, LABEL_HOSTNAME: assignment.hostname}


DRAFT_HOST = "draft-node"         # the placeholder node a draft gang is pinned to (a valid label value)
DRAFT_MASTER = "192.0.2.1"        # ... and its ranks' MASTER_ADDR (TEST-NET-1: never routed)


def draft_gang(spec: JobSpec, job_id: str, attempt: int = 1, ranks: Sequence[int] | None = None) -> list[dict]:
    """The pods launch will create for `spec`, before any node is chosen: the same manifests,
    pinned to a placeholder node. What the API server refuses in them (a server-side dry run at
    place time) it would refuse at launch, after a node was booted for nothing."""
    requests = spec.requests()
    draft = Plan(job_id, Outcome.FITS, "draft", tuple(
        Assignment(task, DRAFT_HOST, DRAFT_HOST, None, NodeState.READY, requests) for task in spec.task_names()))
    return gang_pods(spec, draft, attempt, DRAFT_MASTER, ranks)


# Where a refused field of a pod comes from in the job spec (the first match wins).
_SPEC_FIELDS = (("metadata.name", "name"), ("metadata.labels", "name"), ("spec.tolerations", "tolerations"),
                ("spec.nodeSelector", "node_selector"), (".envFrom", "env_from_secrets"),
                ("secretKeyRef", "secret_env"), (".env", "env"), (".image", "image"),
                (".command", "command"), (".args", "args"), (".resources", "gpus, cpu, memory or extra_resources"))


def spec_field(pod_field: str | None) -> str | None:
    """The job spec field a refused pod field (`spec.tolerations[0].value`) comes from, if known."""
    return next((ours for theirs, ours in _SPEC_FIELDS if pod_field and theirs in pod_field), None)


def rank_env(rank: int, world_size: int, master_addr: str | None, task_index: int,
             master_port: int = MASTER_PORT) -> list[dict]:
    """The variables torchrun-style launchers read, in API form. `master_addr` None: rank 0's
    own pod IP through the downward API (its IP is not known before the pod exists)."""
    addr = ({"name": "MASTER_ADDR", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
            if master_addr is None else {"name": "MASTER_ADDR", "value": master_addr})
    return [{"name": "WORLD_SIZE", "value": str(world_size)}, {"name": "RANK", "value": str(rank)},
            {"name": "NODE_RANK", "value": str(rank)}, addr, {"name": "MASTER_PORT", "value": str(master_port)},
            {"name": TASK_INDEX_ENV, "value": str(task_index)}]


def job_env(spec: JobSpec) -> list[dict]:
    """The job's own variables in API form: env's values, then secret_env's Secret references
    (the kubelet reads those values; they never pass through Airflow). The rank variables are gpuboot's."""
    env: list[dict] = [{"name": k, "value": str(v)} for k, v in spec.env.items() if k not in RANK_ENV]
    for k, ref in spec.secret_env.items():
        if k not in RANK_ENV:
            secret, _, key = ref.partition("/")
            env.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    return env


def pod_name(task: str, job_id: str, attempt: int) -> str:
    """Unique per job run and launch attempt: a retry's pods never wait for the old names to free."""
    return f"{task}-{hashlib.sha256(job_id.encode()).hexdigest()[:8]}-{attempt}"


def gang_pods(spec: JobSpec, plan: Plan, attempt: int, master_addr: str | None,
              ranks: Sequence[int] | None = None) -> list[dict]:
    """The pod manifests of the gang's `ranks` (all by default) for launch attempt `attempt`.
    The job's own env comes first: the rank variables gpuboot sets win over a clash."""
    world = len(plan.assignments)
    names = spec.task_names()
    out = []
    for rank, a in enumerate(plan.assignments):
        if ranks is not None and rank not in ranks:
            continue
        resources = a.requests.to_k8s()
        index = names.index(a.task) if a.task in names else rank
        env = [*job_env(spec), *rank_env(rank, world, None if rank == 0 else master_addr, index)]
        container = {"name": CONTAINER, "image": spec.image, "env": env,
                     "resources": {"requests": resources, "limits": resources}}
        if spec.env_from_secrets:
            container["envFrom"] = [{"secretRef": {"name": name}} for name in spec.env_from_secrets]
        if spec.command:
            container["command"] = list(spec.command)
        if spec.args:
            container["args"] = list(spec.args)
        out.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(a.task, plan.job_id, attempt), "namespace": spec.namespace,
                         "labels": {LABEL_JOB: plan.job_id, LABEL_TASK: a.task, LABEL_RANK: str(rank),
                                    LABEL_ATTEMPT: str(attempt)}},
            "spec": {"restartPolicy": "Never", "nodeSelector": node_selector(spec, a),
                     "tolerations": [dict(t) for t in spec.tolerations], "containers": [container]},
        })
    return out


@dataclass(frozen=True)
class RankFailure:
    rank: int
    pod: str
    reason: str
    exit_code: int | None = None

    def describe(self) -> str:
        code = "" if self.exit_code is None else f" with exit code {self.exit_code}"
        return f"rank {self.rank} (pod {self.pod}) failed{code}: {self.reason}"

    def to_json(self) -> dict:
        return {"rank": self.rank, "pod": self.pod, "reason": self.reason, "exit_code": self.exit_code}

    @classmethod
    def from_json(cls, d: Mapping) -> RankFailure:
        return cls(int(d["rank"]), str(d["pod"]), str(d["reason"]), d.get("exit_code"))


@dataclass(frozen=True)
class GangState:
    """One verdict over the gang: "running", "succeeded" (every rank), or "failed" (the first
    failed rank decides, by rank order)."""

    status: str
    failure: RankFailure | None = None
    done: tuple[int, ...] = ()


def _terminated(pod: Mapping) -> dict:
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (s.get("state") or {}).get("terminated")
        if term is not None:
            return term
    return {}


def _node_ready(node: Mapping | None) -> bool:
    return node is not None and any(c.get("type") == "Ready" and c.get("status") == "True"
                                    for c in (node.get("status") or {}).get("conditions") or [])


def rank_failure(rank: int, pod: Mapping | None, nodes: Mapping[str, Mapping | None] | None = None,
                 name: str | None = None) -> RankFailure | None:
    """Why this rank has failed, or None while it runs or once it succeeded. `name`: the rank's pod,
    for one that is gone."""
    name = ((pod or {}).get("metadata") or {}).get("name", name or f"rank-{rank}")
    if pod is None:
        return RankFailure(rank, name, "its pod is gone (deleted)")
    status = pod.get("status") or {}
    phase = status.get("phase")
    if phase == "Failed":
        term = _terminated(pod)
        reason = ": ".join(x for x in (status.get("reason"), status.get("message")) if x) or \
            ": ".join(str(x) for x in (term.get("reason"), term.get("message")) if x) or "its container failed"
        return RankFailure(rank, name, reason, term.get("exitCode"))
    if pod["metadata"].get("deletionTimestamp"):
        return RankFailure(rank, name, "its pod is being deleted (evicted or removed)")
    for s in status.get("containerStatuses") or []:
        waiting = (s.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CreateContainerConfigError":    # a Secret or key it reads is missing
            return RankFailure(rank, name, f"its container cannot be created: {waiting.get('message') or 'config error'}"
                               ". Create the Secret (and key) in the job's namespace, or fix secret_env / "
                               "env_from_secrets")
    node = (pod.get("spec") or {}).get("nodeName")
    if phase == "Running" and nodes is not None and node is not None and node in nodes and not _node_ready(nodes[node]):
        return RankFailure(rank, name, f"its node {node} is not Ready (node lost)")
    return None


def pod_times(pod: Mapping | None) -> dict:
    """When one rank's pod was bound to its node, started running and finished (epoch seconds, None
    when not yet), read from its status: the run page's last three moments."""
    pod = pod or {}
    status = pod.get("status") or {}
    bound = next((c.get("lastTransitionTime") for c in status.get("conditions") or []
                  if c.get("type") == "PodScheduled" and c.get("status") == "True"), None)
    state = next(((s.get("state") or {}) for s in status.get("containerStatuses") or []), {})
    running = (state.get("running") or state.get("terminated") or {}).get("startedAt")
    return {"pod": (pod.get("metadata") or {}).get("name"), "node": (pod.get("spec") or {}).get("nodeName"),
            "phase": status.get("phase"), "bound_at": parse_time(bound), "running_at": parse_time(running),
            "finished_at": parse_time((state.get("terminated") or {}).get("finishedAt"))}


def completion(pods: Sequence[Mapping]) -> str | None:
    """Why the job did not run to completion, or None when it did: the pods of its last launch
    attempt, every rank there and Succeeded. Read from the cluster, so whatever a user did to the
    run's tasks (marked it failed, cleared a step) the run's end says what really happened."""
    if not pods:
        return "no pod of it ran"
    attempts = {int((p["metadata"].get("labels") or {}).get(LABEL_ATTEMPT) or 0) for p in pods}
    last = [p for p in pods if int((p["metadata"].get("labels") or {}).get(LABEL_ATTEMPT) or 0) == max(attempts)]
    phases = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") or "Pending" for p in last}
    unfinished = sorted(f"{name} {phase}" for name, phase in phases.items() if phase != "Succeeded")
    return None if not unfinished else f"its pod(s) did not all succeed: {', '.join(unfinished)}"


def judge(pods: Mapping[int, Mapping | None], world_size: int,
          nodes: Mapping[str, Mapping | None] | None = None, names: Sequence[str] = ()) -> GangState:
    """The gang's state from its pods by rank (None: the pod is gone) and, optionally, the
    Nodes of running ranks (a rank whose node is not Ready is lost with it: its containers
    died with the machine even while the pod still reads Running). Of several failed ranks the
    one whose container ended first is named: the others most likely failed because of it."""
    failures, done = [], []
    for rank in range(world_size):
        failure = rank_failure(rank, pods.get(rank), nodes, names[rank] if rank < len(names) else None)
        if failure is not None:
            finished = _terminated(pods.get(rank) or {}).get("finishedAt") or "~"   # unknown: after any time
            failures.append((finished, rank, failure))
        elif ((pods.get(rank) or {}).get("status") or {}).get("phase") == "Succeeded":
            done.append(rank)
    if failures:
        return GangState("failed", min(failures)[2], tuple(done))
    return GangState("succeeded" if len(done) == world_size else "running", done=tuple(done))


def adoptable(pods: Sequence[Mapping], world_size: int, try_number: int | None = None) -> tuple[int, list[str]] | None:
    """(attempt, pod names by rank) when `pods` (every pod of the job) are one whole launch
    attempt with no rank failed or being deleted, and still live (a rank not yet ended) or of
    this very try (`try_number`): a worker died while its gang ran, and the retry follows the
    same pods. A finished gang of an earlier try is never adopted: a cleared launch runs the
    job again rather than replaying its old verdict. None: launch anew (after clearing whatever
    is there)."""
    attempts = {(p["metadata"].get("labels") or {}).get(LABEL_ATTEMPT) for p in pods}
    if len(attempts) != 1 or None in attempts:
        return None
    by_rank = {int((p["metadata"].get("labels") or {}).get(LABEL_RANK, -1)): p for p in pods}
    if sorted(by_rank) != list(range(world_size)) or len(pods) != world_size:
        return None
    if any(rank_failure(rank, pod) is not None for rank, pod in by_rank.items()):
        return None
    attempt = int(str(attempts.pop()))
    live = any((p.get("status") or {}).get("phase") not in TERMINATED_PHASES for p in pods)
    if not live and attempt != try_number:
        return None
    return attempt, [by_rank[r]["metadata"]["name"] for r in range(world_size)]

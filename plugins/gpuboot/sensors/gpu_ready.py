"""GpuReadySensor: the `wait_gpu_ready` step, deferrable by default.

Deferred, it hands one node at a time to NodeGpuReadyTrigger (a watch in the
triggerer, no worker slot held); in poke mode it feeds the same GpuWait (the rule, the boot's
phases, the deadline and its one stretch) from Node reads, and looks for the job's preemption
record in the queue with the trigger's own PreemptionWatch (every 2 s at most): either way a job
preempted while its nodes come up is handed to its launch step, which requeues it.

Every try starts from the ledger, not from its XCom inputs (`JobBoot.ensure_up`): where
the job is reserved now (an earlier try may have failed over, a cleared `place` may have
re-placed it), what it started (so nothing is started twice and a boot's clock is not
restarted) and which nodes already failed for it (never waited on again).

Boot timeout. A node being booted that is not GPU-ready within the boot timeout (counted
from the job's first start request) is given up inside this task
(gpuboot.lifecycle.boot.JobBoot.fail_over): it fails for this job, is marked unavailable for others
(until it is Ready or boots again, or the mark expires), the job's reservation is moved to
another node in the same ledger commit, the instance is stopped again if this job started it
and no other job claims it, the new node is started, and the wait starts over for it, up to
`max_boot_attempts` boots. A node that was already up when the job chose it is not held to
the boot timeout (there is no boot) and is never marked for others. When what is left is
busy, the sensor waits and re-places exactly like the start step (gpuboot.operators.capacity_wait.WaitsForCapacity).
Why here and not by retrying upstream tasks: Airflow cannot re-run `place`/`start` from a
downstream failure, while one task that logs "timed out on X (evidence), stopped X,
re-placed on Y, started Y" keeps the audit trail in one place. The plan the job ends on is
pushed as XCom "plan" for `launch`. When the attempts are used up (or the sensor was wired
without the job), the task fails with the evidence and a hint of where to look, after the
same release and stop.

Trigger logs. Airflow 3.3 writes a trigger's log to `<task try log>.trigger.<triggerer job
id>.log`, opened anew for each trigger, so a second deferral in the same try (after a
fail-over) overwrites the first one's file. The trigger therefore returns its watch history
in its event, and the sensor writes it into the task log: every deferral's history is kept.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowFailException

from gpuboot._aliases import moved
from gpuboot.core.gpu_wait import GpuWait
from gpuboot.core.placement import Plan
from gpuboot.core.readiness import DEFAULT_FALLBACK_SECONDS, BootBaseline
from gpuboot.core.steplog import boot_summary, evidence_block
from gpuboot.core.timefmt import duration, utc, utc_relative
from gpuboot.exceptions import JobPreempted
from gpuboot.hooks.kube import Gone, KubeClient
from gpuboot.lifecycle.booking import LAUNCH_MARGIN_SECONDS
from gpuboot.lifecycle.boot import (
    ALREADY_UP_GRACE_SECONDS,
    DEFAULT_UNAVAILABLE_TTL_SECONDS,
    BringUp,
    JobBoot,
    wait_deadline,
)
from gpuboot.lifecycle.jobqueue import CONFIGMAP, Preempted
from gpuboot.operators.base import GpuJobStep, refusal, summarize, summarizes_failure
from gpuboot.operators.capacity_wait import WaitsForCapacity, handed_to_launch
from gpuboot.triggers.gpu_ready import NodeGpuReadyTrigger, PreemptionWatch


def describe_evidence(evidence: Mapping[str, Any]) -> str:
    """One line for the task log: Ready? GPUs? bootID? heartbeat age?"""
    keys = ("ready", "gpus_allocatable", "boot_id", "boot_id_changed", "heartbeat_age_seconds", "held_seconds")
    shown = [f"{k}={evidence[k]}" for k in keys if k in evidence]
    shown += [f"{k}={utc(v) if k.endswith('_at') and isinstance(v, (int, float)) else v}"
              for k, v in sorted(evidence.items()) if k not in keys]
    return ", ".join(shown) or "nothing"


def where_to_look(node: str, evidence: Mapping[str, Any]) -> str:
    """A hint, for a node that did not pass the readiness rule, of where its failure shows."""
    if not evidence:
        return f"hint: node {node} could not be read: check that the Node object exists and the API server is reachable"
    if evidence.get("ready") != "True" or evidence.get("fresh") is False:
        return (f"hint: the kubelet on {node} never reported Ready for this boot: check the instance's console "
                f"output (ECS GetInstanceConsoleOutput) and the kubelet log on it (journalctl -u kubelet)")
    if evidence.get("unschedulable"):
        return f"hint: node {node} is cordoned (spec.unschedulable): see who cordoned it (kubectl describe node {node})"
    needed, have = int(evidence.get("gpus_needed") or 0), int(evidence.get("gpus_allocatable") or 0)
    if needed and have < needed:
        return (f"hint: the NVIDIA device plugin never registered the GPUs on {node}: check its DaemonSet pod on "
                f"that node (kubectl -n kube-system get pods -o wide --field-selector spec.nodeName={node}) and its log")
    return f"hint: node {node} passed the rule only briefly: its Ready condition or GPU count kept changing"


@dataclass(frozen=True)
class WaitState:
    """What the sensor waits on: the plan (JSON), the boot baselines of its nodes, and what was
    tried. Made from a `BringUp` (lifecycle) and carried through every deferral."""

    plan: dict | None
    baselines: list
    tried: list

    @classmethod
    def of(cls, result: BringUp) -> WaitState:
        return cls(result.plan.to_json(), list(result.baselines), list(result.tried))

    def to_json(self) -> dict:
        return {"plan": self.plan, "baselines": list(self.baselines), "tried": list(self.tried)}

    @classmethod
    def from_json(cls, d: Mapping) -> WaitState:
        return cls(d.get("plan"), list(d.get("baselines") or []), list(d.get("tried") or []))


@dataclass(frozen=True)
class WaitProgress:
    """Where a deferred wait stands: which node of the plan it watches, the settle window, the
    evidence of nodes already cleared, and the WaitState. It travels in the trigger's echo
    (dag.test() hands the resumed task only the event)."""

    index: int
    settle: float
    seen: dict
    state: WaitState

    def to_json(self) -> dict:
        return {"index": self.index, "settle": self.settle, "seen": dict(self.seen), "state": self.state.to_json()}

    @classmethod
    def from_json(cls, d: Mapping) -> WaitProgress:
        return cls(index=int(d["index"]), settle=float(d["settle"]), seen=dict(d.get("seen") or {}),
                   state=WaitState.from_json(d.get("state") or d))   # `d`: an echo of 0.1 had the fields flat


class GpuReadySensor(GpuJobStep, WaitsForCapacity, BaseSensorOperator):
    """Wait until every node of the plan passes the GPU-readiness rule.

    `baselines` is the start step's list of boot baselines (XCom key "baselines"), `plan` the start
    step's plan (XCom key "plan"); settle window and boot timeout come from the job (XCom
    key "job" of the place step) unless given. Returns the plan's task names, now cleared
    to launch (the gang `launch` creates); the per-node evidence goes to XCom key
    "evidence" and the plan the job ended on to key "plan"."""

    template_fields = ("baselines", "job", "plan")
    ui_color = "#e8f5e9"

    def __init__(self, *, baselines: Sequence[Mapping] | Any = None, job: Mapping | Any = None, plan: Mapping | Any = None,
                 settle_seconds: float | None = None, boot_timeout_seconds: float | None = None,
                 kubernetes_conn_id: str = "kubernetes_default", ecs_conn_id: str = "alibaba_ecs_default",
                 ledger_namespace: str = "default", max_boot_attempts: int = 2,
                 unavailable_ttl_seconds: float = DEFAULT_UNAVAILABLE_TTL_SECONDS, deferrable: bool = True,
                 poke_interval: float = 2.0, busy_poll_seconds: float = 30.0,
                 fallback_seconds: float = DEFAULT_FALLBACK_SECONDS, **kwargs) -> None:
        if "boots" in kwargs:       # its name in gpuboot 0.1
            moved("GpuReadySensor(boots=...)", "GpuReadySensor(baselines=...)")
            baselines = kwargs.pop("boots")
        if not deferrable and kwargs.get("mode") == "reschedule":
            raise ValueError("mode='reschedule' would restart the settle window on every poke; "
                             "use deferrable=True or mode='poke'")
        if max_boot_attempts < 1:
            raise ValueError(f"max_boot_attempts must be >= 1, got {max_boot_attempts}")
        super().__init__(poke_interval=poke_interval, **kwargs)
        self.baselines, self.job, self.plan = baselines, job, plan
        self.settle_seconds, self.boot_timeout_seconds = settle_seconds, boot_timeout_seconds
        self.kubernetes_conn_id, self.ecs_conn_id, self.deferrable = kubernetes_conn_id, ecs_conn_id, deferrable
        self.ledger_namespace, self.max_boot_attempts = ledger_namespace, max_boot_attempts
        self.unavailable_ttl_seconds, self.fallback_seconds = unavailable_ttl_seconds, fallback_seconds
        self.busy_poll_seconds = busy_poll_seconds
        self._waits: dict[str, GpuWait] = {}           # poke mode: each node's wait, as the trigger keeps it
        self._versions: dict[str, str | None] = {}     # poke mode: the resourceVersion each node was read at
        self._latest: dict[str, dict] = {}
        self._state = WaitState(None, [], [])
        self._preemption = PreemptionWatch(None, kubernetes_conn_id)    # poke mode: the trigger's look at the queue

    def _timing(self) -> tuple[float, float]:
        spec = self.spec()
        settle = self.settle_seconds if self.settle_seconds is not None else (spec.settle_seconds if spec else 5)
        timeout = (self.boot_timeout_seconds if self.boot_timeout_seconds is not None
                   else (spec.boot_timeout_seconds if spec else 900))
        return float(settle), float(timeout)

    @summarizes_failure
    def execute(self, context):
        settle, timeout = self._timing()
        state = WaitState(dict(self.plan) if self.plan else None, [dict(b) for b in self.baselines or ()], [])
        boot = self._boot(state)
        if boot is not None and boot.spec is not None:
            boot.hold(timeout + LAUNCH_MARGIN_SECONDS)
            result = self.bring_up_or_wait(boot, lambda: boot.ensure_up(Plan.from_json(state.plan),
                                                                        boot.failures(), state.baselines or None),
                                           None, "resume_after_capacity")
            state = self._state_of(context, result)
        if not state.baselines:
            self.log.info("no node to wait for")
            return self._cleared(context, {}, state)
        if not self.deferrable:
            self.timeout = timeout * self.max_boot_attempts + 60     # our own deadlines fail first, with evidence
            self._start_poking(state)
            return super().execute(context)
        return self._defer_for(0, settle, {}, state)

    def _start_poking(self, state: WaitState) -> None:
        """What the pokes wait on: `state`'s nodes, and the job's preemption record in the queue."""
        self._state = state
        self._preemption = PreemptionWatch(self._queue_record(state), self.kubernetes_conn_id)

    def _boot(self, state: WaitState) -> JobBoot | None:
        if not state.plan:
            return None
        return self.job_boot(state.plan["job_id"], max_attempts=self.max_boot_attempts,
                             unavailable_ttl_seconds=self.unavailable_ttl_seconds)

    @staticmethod
    def _state_of(context, result: BringUp) -> WaitState:
        state = WaitState.of(result)
        context["ti"].xcom_push(key="plan", value=state.plan)
        return state

    def _hold_until(self, state: WaitState, moment: float) -> None:
        """Renew the job's reservations to cover waiting until `moment` and the launch after it."""
        if state.plan:
            self.ledger().renew(
                state.plan["job_id"], moment + LAUNCH_MARGIN_SECONDS)

    def _defer_for(self, index: int, settle: float, seen: dict, state: WaitState):
        baseline = state.baselines[index]
        deadline = wait_deadline(baseline, self._timing()[1], settle, time.time())
        self._hold_until(state, deadline)
        self.log.info("waiting for node %s (%d/%d) until %s%s", baseline["node"], index + 1, len(state.baselines),
                      utc_relative(deadline, time.time()), "" if baseline.get("start_requested_at") is not None else
                      " (it was up when the job chose it: no boot timeout)")
        self.defer(trigger=NodeGpuReadyTrigger(baseline=dict(baseline), deadline=deadline, settle_seconds=settle,
                                               kubernetes_conn_id=self.kubernetes_conn_id,
                                               fallback_seconds=self.fallback_seconds, ecs_conn_id=self.ecs_conn_id,
                                               echo=WaitProgress(index, settle, seen, state).to_json(),
                                               preemption=self._queue_record(state)),
                   method_name="execute_complete")

    def _queue_record(self, state: WaitState) -> list | None:
        """Where the job's preemption record would be: (namespace, queue ConfigMap, job id)."""
        return [self.ledger_namespace, CONFIGMAP, state.plan["job_id"]] if state.plan else None

    def _preempted(self, context, record: Preempted, state: WaitState, settle: float, seen: Mapping | None = None):
        """Preempted while its nodes came up: nothing more is waited for, its launch step requeues it
        (gpuboot.operators.requeue); the deferred and the poking wait end here alike."""
        return self._watch(context, handed_to_launch(self, JobPreempted(record), state.tried), settle, seen)

    @summarizes_failure
    def execute_complete(self, context, event: Mapping):
        """Back from the trigger; where we were (node, plan, attempts) comes back in event["echo"]."""
        node, progress = event.get("node"), WaitProgress.from_json(event["echo"])
        index, settle, seen = progress.index, progress.settle, progress.seen
        state = WaitState(progress.state.plan or self.plan, progress.state.baselines or list(self.baselines or ()),
                          progress.state.tried)
        history = event.get("history") or []
        if history:
            self.log.info("watch of node %s in the triggerer (%d change(s)):\n  %s", node, len(history),
                          "\n  ".join(history))
        if event.get("status") in ("stopped", "timeout"):
            # the node the job leaves stays in the evidence (the run page draws its path too), kept
            # before placing again so a run that fails here still shows it
            why = event.get("message") if event.get("status") == "stopped" else event.get("reason")
            seen = {**seen, node: {**(event.get("evidence") or {}), "boot": event.get("boot"),
                                   "left": why or event["status"], "left_at": time.time(),
                                   "summary": f"left {node}: {why}"}}
            context["ti"].xcom_push(key="evidence", value=seen)
        if event.get("status") == "preempted":    # its launch step requeues it (gpuboot.operators.requeue)
            return self._preempted(context, Preempted.from_json(event["preempted"]), state, settle, seen)
        if event.get("status") == "stopped":
            return self._watch(context, self._move_off(context, state, node, event.get("message") or ""), settle, seen)
        if event.get("status") != "ready":
            result = self._fail_over(context, state, node, event.get("reason"), event.get("evidence") or {})
            return self._watch(context, result, settle, seen)
        summary = event.get("summary") or f"node {node} is GPU-ready"
        self.log.info("%s; evidence:\n%s", summary, evidence_block(event.get("evidence") or {}))
        seen = {**seen, node: {**(event.get("evidence") or {}), "summary": summary, "boot": event.get("boot")}}
        if index + 1 < len(state.baselines):
            self._defer_for(index + 1, settle, seen, state)
        self._hold_until(state, time.time())
        return self._cleared(context, seen, state)

    @summarizes_failure
    def resume_after_capacity(self, context, event: Mapping):
        """Back from waiting for busy capacity (holding nothing): place again and watch the new nodes."""
        settle, _ = self._timing()
        boot = self._boot(WaitState(self.plan, [], []))
        return self._watch(context, self.capacity_resumed(boot, event["echo"], "resume_after_capacity"), settle)

    def _watch(self, context, result: BringUp, settle: float, left: Mapping | None = None):
        """Wait for the nodes of `result`; `left`: evidence of the nodes the job left (kept, see execute_complete)."""
        state = self._state_of(context, result)
        left = {n: e for n, e in (left or {}).items() if e.get("left")}
        if not result.baselines:
            return self._cleared(context, left, state)
        return self._defer_for(0, settle, left, state)

    def _fail_over(self, context, state: WaitState, node: str, reason: str | None, evidence: Mapping) -> BringUp:
        """Node `node` timed out: re-place the job elsewhere (see the module doc), wait for busy
        capacity like the start step, or fail with the evidence and where to look."""
        baseline = next((b for b in state.baselines or () if b["node"] == node), {})
        booted = baseline.get("start_requested_at") is not None
        what = (f"node {node} not GPU-ready before the boot timeout: {reason}; "
                if booted else f"node {node}, up when the job chose it, did not pass the readiness rule in "
                               f"{ALREADY_UP_GRACE_SECONDS}s: {reason}; ")
        what += f"last seen: {describe_evidence(evidence)}\n{where_to_look(node, evidence)}"
        self.log.warning("%s", what)
        _, timeout = self._timing()
        why = f"not GPU-ready within {duration(timeout)} ({reason})" if booted else f"not GPU-ready although up ({reason})"
        return self._place_again(context, state, node, why, what, {node: {**baseline, **evidence}})

    def _move_off(self, context, state: WaitState, node: str, why: str) -> BringUp:
        """The node's instance was stopped outside gpuboot: not the node's fault, so it is neither
        marked for other jobs nor failed for this one; the job is placed again at once (counted
        against max_boot_attempts), or waits for capacity like the start step."""
        self.log.warning("%s; placing the job again", why)
        return self._place_again(context, state, node, why, why, None, blame=False)

    def _place_again(self, context, state: WaitState, node: str, why: str, what: str,
                     evidence: Mapping | None, blame: bool = True) -> BringUp:
        """Move the job off `node` (JobBoot.fail_over), or wait for busy capacity like the start step;
        when nothing is left to move to (or the sensor was wired without the job), the task fails with
        `what`, holding nothing."""
        boot = self._boot(state)
        if boot is None:
            raise refusal(self, context, what)
        plan = Plan.from_json(state.plan)
        try:
            return self.bring_up_or_wait(
                boot, lambda: boot.fail_over(plan, {node: why}, state.tried, evidence, blame=blame),
                None, "resume_after_capacity")
        except AirflowFailException as exc:   # nothing left to move to: the run fails, holding nothing
            raise refusal(self, context, f"{what}\n{exc}") from None

    def _cleared(self, context, evidence: dict, state: WaitState) -> list[str]:
        context["ti"].xcom_push(key="evidence", value=evidence)
        lines = [e.get("summary") or f"{n} GPU-ready" for n, e in evidence.items() if not e.get("left")]
        summarize(self, context, "; ".join(lines) or "no node to wait for")
        if state.plan:
            context["ti"].xcom_push(key="plan", value=state.plan)
        return [a["task"] for a in (state.plan or {}).get("assignments", [])]

    @summarizes_failure
    def poke(self, context):
        settle, _ = self._timing()
        kube = self.kube()
        now = time.time()
        record = self._preemption.poked(kube, now, self.log)
        if record is not None:        # as the trigger's "preempted" event (execute_complete)
            return PokeReturnValue(is_done=True, xcom_value=self._preempted(context, record, self._state, settle))
        readiness = {b["node"]: self._poke_node(kube, b, settle, now) for b in self._state.baselines}
        waiting = {n: r for n, r in readiness.items() if not r.ready}
        if not waiting:
            cleared = self._cleared(context, {n: {**r.evidence, "summary": boot_summary(n, self._waits[n].clock),
                                                  "boot": self._waits[n].clock.to_json()}
                                              for n, r in readiness.items()}, self._state)
            return PokeReturnValue(is_done=True, xcom_value=cleared)
        for node, r in waiting.items():
            self.log.info("node %s not ready yet: %s", node, r.reason)
        expired = next((n for n in waiting if self._waits[n].expired(now)), None)
        if expired is not None:
            r = waiting[expired]
            result = self._fail_over(context, self._state, expired, r.reason, r.evidence)
            self._state = self._state_of(context, result)
            self._waits, self._versions = {}, {}
        return False

    def _poke_node(self, kube: KubeClient, boot: Mapping, settle: float, now: float):
        """Judge one node with the trigger's own GpuWait: every write since the last poke is replayed
        (a short watch from the last resourceVersion, the baseline's at first), so polls see the
        kubelet's reset like the trigger."""
        name = boot["node"]
        if name not in self._waits:
            baseline = BootBaseline.from_json(boot)
            self._versions[name] = (baseline.resource_version_before
                                    if baseline.start_requested_at is not None else None)
            self._waits[name] = GpuWait.of(baseline, wait_deadline(boot, self._timing()[1], settle, now),
                                           settle_seconds=settle, fallback_seconds=self.fallback_seconds,
                                           continuous=self._versions[name] is not None)
        wait, version = self._waits[name], self._versions[name]
        # A read takes the collection's version, where the next poke's watch resumes: the Node's own
        # (its last write) may be older than the history on a quiet node, Gone at every poke.
        read = None
        try:
            states = [] if version is None else kube.node_writes_since(name, version)
        except Gone:
            wait.lost_continuity("the watch expired (410 Gone) and the Node was re-read")
            version = None
        if version is None:
            node, read = kube.node_to_watch(name)
            states = [node]
        if states:
            self._latest[name] = states[-1]
            self._versions[name] = read or states[-1]["metadata"].get("resourceVersion") or version
        elif name not in self._latest:   # nothing written since the start yet: judge the Node as it is
            self._latest[name] = kube.get_node(name)
        readiness = None
        for state in states or [self._latest[name]]:
            readiness = wait.observe(state if state is None or state.get("status") else {}, time.time())
        return readiness

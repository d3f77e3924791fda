"""The chaos run: many GPU jobs against the local cloud while everything goes wrong.

Faults, all at once: about 30% of ECS calls throttled, no stock for the preferred GPU
instance type (the cheapest 1-GPU type, which placement picks first among stopped
nodes), one node whose kubelet never becomes Ready, one whose device plugin never
registers its GPUs, Kubernetes API latency and recurring bursts of 409 Conflicts on
the ledger, and one worker process SIGKILLed in the middle of a job's step (by default
`launch`, while it creates the pods; Airflow would fail that try and retry it). Every step try
runs in its own forked worker process (chaos.runner.ProcessWorkers), so the kill is real.

Afterwards the idle scale-down runs, as its DAG would, until nothing it should stop is
left, and the run is judged: every job succeeded or failed with a reason; no node was
ever promised more than it has (chaos.monitor); no reservation is left in the ledger; no
instance this run started is left running idle; the killed step's job has one pod.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from chaos.harness import ConflictBursts, api_client_factory, cloud_connections, job_dag, job_pods, run_all
from chaos.monitor import Monitor, MonitorReport
from chaos.runner import DagRunner, InlineWorkers, ProcessWorkers, RunResult, StepCall, Triggerer
from gpuboot.core.model import LABEL_JOB
from gpuboot.operators.base import job_id_for
from simcloud.harness import SimCloud, small_fleet, wait_until

log = logging.getLogger(__name__)

T4, A10, V100 = "ecs.gn6i-c4g1.xlarge", "ecs.gn7i-c8g1.2xlarge", "ecs.gn6v-c8g1.2xlarge"
T4X2, V100X4 = "ecs.gn6i-c24g1.12xlarge", "ecs.gn6v-c8g1.8xlarge"
PREFERRED = T4                      # cheapest, least-waste 1-GPU type: what placement tries first
NEVER_READY, NO_DEVICE_PLUGIN = "v100-a", "v100-b"
NODES = [
    {"name": "t4-running", "instance_type": T4, "status": "Running"},
    {"name": "t4-a", "instance_type": T4, "status": "Stopped"},
    {"name": "t4-b", "instance_type": T4, "status": "Stopped"},
    {"name": "a10-a", "instance_type": A10, "status": "Stopped"},
    {"name": "a10-b", "instance_type": A10, "status": "Stopped"},
    {"name": "t4x2-a", "instance_type": T4X2, "status": "Stopped"},
    {"name": NEVER_READY, "instance_type": V100, "status": "Stopped"},
    {"name": NO_DEVICE_PLUGIN, "instance_type": V100, "status": "Stopped"},
    {"name": "v100x4", "instance_type": V100X4, "status": "Stopped"},
]
FAULTS = {"ecs_throttle_rate": 0.3, "no_stock": [PREFERRED], "never_ready": [NEVER_READY],
          "device_plugin_never": [NO_DEVICE_PLUGIN], "k8s_latency_ms": 10}
ACTIVE = ("Pending", "Starting", "Running")


def jobs(count: int, seed: int, run_seconds: float = 2, boot_timeout: int = 8) -> list[dict]:
    """Mostly 1-GPU jobs of any model; some ask for V100 (they meet the two broken V100 nodes
    first) and some for 2 GPUs. The seed shuffles the mix."""
    rng = random.Random(seed)
    kinds = [{}, {}, {}, {"gpu_model": "V100"}, {"gpus": 2}]
    out = []
    for n in range(count):
        kind = kinds[n % len(kinds)] if n < len(kinds) else rng.choice(kinds)
        out.append({"name": f"chaos-{n:02d}", "image": "busybox", "gpus": 1, "cpu": "1", "memory": "1Gi",
                    "command": ["sh", "-c", f"echo chaos-{n:02d} start; sleep {run_seconds}; echo chaos-{n:02d} done"],
                    "settle_seconds": 1, "boot_timeout_seconds": boot_timeout, "queue_timeout_seconds": 300,
                    **kind})
    rng.shuffle(out)
    return out


WORKER_DIED = "worker process died"     # chaos.runner.ProcessWorkers' error for a try whose worker died


class WorkerKiller:
    """SIGKILLs one worker process running task `step` (first try), at the moment that hurts:
    for `launch`, once its first pod exists (the worker is creating the gang; once it is created
    the launch defers and no worker is left to kill); for `start`, once ECS shows one of its
    instances starting; otherwise as soon as it is up. Every such worker is watched, not only
    the first: launches of a burst run side by side, and one that defers before its moment was
    seen (a one-pod gang defers as soon as its pod exists) is a miss, after which any launch
    worker still alive is killed at once. Watching waits as long as the worker lives (bounded
    by `timeout`): on a loaded machine a pod may take minutes to run.

    A kill counts (`killed`) only once the try it was aimed at is seen to have died of it
    (`on_result`, from the DagRunner): a step such as `start` may send its result in the
    instant between the moment and the signal, and then the try succeeded and nothing was
    killed. One kill is in flight at a time; until one counts the killer stays armed."""

    def __init__(self, cloud: SimCloud, step: str = "launch", timeout: float = 600.0) -> None:
        self.cloud, self.step, self.timeout = cloud, step, timeout
        self.lock = threading.Lock()
        self.aimed: StepCall | None = None      # the try a SIGKILL was sent to, not yet seen to end
        self.killed: StepCall | None = None
        self.missed = 0                         # tries that ended before the kill hit them

    def on_spawn(self, call: StepCall, process) -> None:
        if not call.task_id.endswith("." + self.step) or call.try_number != 1 or call.method != "execute":
            return
        with self.lock:
            if self.killed:
                return
        threading.Thread(target=self._kill_when_it_hurts, args=(call, process), daemon=True).start()

    def on_result(self, call, outcome) -> None:
        """The try `call` ended with `outcome`: confirm the kill aimed at it, or re-arm."""
        with self.lock:
            if self.aimed is not call:
                return
            self.aimed = None
            if outcome.status == "failed" and (outcome.error or "").startswith(WORKER_DIED):
                self.killed = call
                log.warning("chaos: the SIGKILL failed %s %s try %d (%s)", call.run_id, call.task_id,
                            call.try_number, outcome.error)
            else:
                self.missed += 1
                log.warning("chaos: the SIGKILL of %s %s came after its try had ended (%s); re-arming",
                            call.run_id, call.task_id, outcome.status)

    def _moment(self, call: StepCall) -> Callable[[], bool]:
        if self.step == "launch":
            core = self.cloud.core_v1()
            job_id = job_id_for(call.dag_id, call.run_id, call.task_id.rpartition(".")[0])
            # launch holds its worker only while it creates the gang (then it defers): hit it there,
            # or at once after a miss
            return lambda: self.missed > 0 or bool(
                core.list_pod_for_all_namespaces(label_selector=f"{LABEL_JOB}={job_id}").items)
        if self.step == "start":
            wanted = {a["instance_id"] for a in (call.kwargs.get("plan") or {}).get("assignments", [])
                      if a.get("node") in (call.kwargs.get("plan") or {}).get("nodes_to_start", [])}
            return lambda: any(i.get("status") in ACTIVE for i in self.cloud.state()["instances"]
                               if i.get("instance_id") in wanted)
        return lambda: True

    def _kill_when_it_hurts(self, call: StepCall, process) -> None:
        sent = False
        try:
            moment = self._moment(call)
            wait_until(lambda: not process.is_alive() or self.killed is not None
                       or (self.aimed is None and moment()), timeout=self.timeout, interval=0.1)
            with self.lock:
                if process.is_alive() and self.killed is None and self.aimed is None:
                    self.aimed, sent = call, True
            if sent:
                process.kill()
                log.warning("chaos: SIGKILLed the worker of %s %s (pid %s)", call.run_id, call.task_id, process.pid)
        except Exception as exc:
            log.info("chaos: kill of %s %s skipped (%s)", call.run_id, call.task_id, exc)
        finally:
            if not sent and not process.is_alive():
                with self.lock:
                    if self.killed is None:
                        self.missed += 1    # the try ended before its moment came: the next live one is hit at once
                        log.info("chaos: %s %s ended before its moment; aiming at the next live %s worker",
                                 call.run_id, call.task_id, self.step)


@dataclass
class KilledStep:
    """What became of the killed step, read from its run's history: one source for the report
    line and the verdict."""

    run_id: str
    task_id: str
    map_index: int
    killed_try: int
    run_state: str
    tries: list[tuple[int, str]]            # (try number, how it ended), in order

    @classmethod
    def of(cls, run: RunResult, killed: StepCall) -> KilledStep:
        ended = [(a.try_number, a.status) for a in run.history
                 if a.task_id == killed.task_id and a.map_index == killed.map_index and a.status != "deferred"]
        return cls(run.run_id, killed.task_id, killed.map_index, killed.try_number, run.state, ended)

    @property
    def retried(self) -> bool:
        """A later try of the step succeeded (whatever became of the job after the step)."""
        return any(n > self.killed_try and status == "success" for n, status in self.tries)

    def line(self, pods: int) -> str:
        step = self.task_id + (f"[{self.map_index}]" if self.map_index >= 0 else "")
        tries = ", ".join(f"try {n} {status}" for n, status in self.tries) or "no try recorded"
        return (f"killed worker of {self.run_id} {step} (try {self.killed_try}): "
                f"{'retried to success' if self.retried else 'NOT retried to success'} ({tries}); "
                f"job {self.run_state}, {pods} pod(s)")


@dataclass
class ChaosOutcome:
    results: list[RunResult]
    report: MonitorReport
    idle_running: list[str] = field(default_factory=list)     # instances we started, idle, still running
    duplicate_pods: dict[str, int] = field(default_factory=dict)
    killed: KilledStep | None = None
    scaledown_passes: int = 0

    @property
    def succeeded(self) -> list[RunResult]:
        return [r for r in self.results if r.state == "success"]

    @property
    def failed_with_reason(self) -> list[RunResult]:
        return [r for r in self.results if r.state != "success" and r.reason]

    @property
    def without_reason(self) -> list[RunResult]:
        return [r for r in self.results if r.state != "success" and not r.reason]

    def summary(self) -> str:
        return (f"chaos: {len(self.results)} jobs, {len(self.succeeded)} succeeded, "
                f"{len(self.failed_with_reason)} failed with a reason, {len(self.report.overcommits)} overcommitted, "
                f"{len(self.report.leaked())} leaked reservations, {len(self.idle_running)} idle instances left running")

    def problems(self) -> list[str]:
        """Everything that makes the run fail (empty: it passed)."""
        out = list(self.report.problems())
        out += [f"job {r.run_id} ended {r.state} without a reason: {r.short_states()}" for r in self.without_reason]
        out += [f"instance {i} was started by this run and is left running idle" for i in self.idle_running]
        out += [f"job {job} has {n} pods (crash safety: one expected)" for job, n in self.duplicate_pods.items()]
        if self.killed is not None and not self.killed.retried:
            out.append(f"the killed step {self.killed.run_id} {self.killed.task_id} was not retried to success: "
                       f"{self.killed.tries}")
        return out


def _instances(cloud: SimCloud) -> dict[str, str]:
    return {i["instance_id"]: i["status"] for i in cloud.state()["instances"]}


def _idle_started(cloud: SimCloud, before: dict[str, str], report_ledger) -> list[str]:
    """Instances that were stopped before the run, are up now, and hold no workload pod or reservation."""
    core = cloud.core_v1()
    busy_nodes = {p.spec.node_name for p in core.list_pod_for_all_namespaces(
        field_selector="status.phase!=Succeeded,status.phase!=Failed").items if p.spec.node_name}
    busy_nodes |= {r.node for r in report_ledger if any(r.resources.values()) and r.expires_at > time.time()}
    node_of = {n["instance_id"]: n["name"] for n in cloud.state()["nodes"] if n.get("instance_id")}
    return sorted(f"{iid} ({node_of.get(iid, '?')})" for iid, status in _instances(cloud).items()
                  if before.get(iid) == "Stopped" and status in ACTIVE and node_of.get(iid) not in busy_nodes)


def scale_down(cloud: SimCloud, before: dict[str, str], idle_seconds: float = 2, timeout: float = 90) -> int:
    """Run the idle scale-down (the operator its DAG runs) until no instance we started is idle
    and running; returns the number of passes."""
    from airflow.sdk import DAG

    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.ledger import ReservationLedger
    from gpuboot.operators.scaledown import IdleScaleDownOperator

    with DAG(dag_id="gpuboot_idle_scaledown", schedule=None) as dag:
        IdleScaleDownOperator(task_id="scale_down", idle_seconds=idle_seconds, spare_seconds=0, stop_timeout_seconds=60,
                              stop_poll_seconds=0.5)
    runner = DagRunner(dag, InlineWorkers(), min_retries=0)
    passes = 0
    try:
        def done() -> bool:
            nonlocal passes
            passes += 1
            result = runner.run(f"scaledown-{passes}")
            log.info("scale-down pass %d: %s", passes, result.xcom.get(("scale_down", -1, "return_value")))
            return not _idle_started(cloud, before, ReservationLedger(KubeClient()).live())
        wait_until(done, timeout=timeout, interval=1.0)
    except TimeoutError:
        log.warning("scale-down left idle instances after %d passes", passes)
    finally:
        runner.close()
    return passes


def run_chaos(job_count: int = 16, seed: int = 7, workdir: Path | str = "chaos-run", kill_step: str = "launch",
              progress: Callable[[str], None] = lambda line: None, burst: bool = False) -> ChaosOutcome:
    """`burst`: every job is released in the same instant (chaos.harness.run_all)."""
    workdir = Path(workdir)
    fleet = small_fleet(NODES)
    with SimCloud.start(fleet, workdir / "cloud", seed=seed, ready_timeout=120) as cloud, \
            cloud_connections(cloud.gpuboot_connections()):   # the product as its ServiceAccount
        before = _instances(cloud)
        cloud.set_faults(**FAULTS)
        killer = WorkerKiller(cloud, kill_step)
        runner = DagRunner(job_dag("gpu_job_chaos", busy_poll_seconds=1, poke_interval=0.5),
                           ProcessWorkers(log_path=str(workdir / "workers.log")), Triggerer(),
                           on_spawn=killer.on_spawn, on_result=killer.on_result)
        confs = jobs(job_count, seed)
        progress(f"chaos: {job_count} jobs (seed {seed}) on {len(NODES)} nodes; faults {FAULTS}; "
                 f"killing one {kill_step} worker; {'burst: all released at once; ' if burst else ''}logs in {workdir}")
        try:
            with Monitor(api_client_factory(cloud.kubeconfig)) as monitor, ConflictBursts(cloud, size=3, every=1.5):
                results = run_all(runner, confs, prefix="chaos", burst=burst)
                for r in results:
                    progress(f"  {r.run_id} {r.conf['name']}: {r.state}" + (f" ({r.reason})" if r.reason else ""))
                cloud.set_faults(k8s_conflict_burst=0, never_ready=[], device_plugin_never=[])
                passes = scale_down(cloud, before)
        finally:
            runner.close()
        outcome = ChaosOutcome(results=results, report=monitor.report, scaledown_passes=passes)
        outcome.idle_running = _idle_started(cloud, before, monitor.report.ledger)
        pods = job_pods(cloud.core_v1())
        outcome.duplicate_pods = {job: len(p) for job, p in pods.items() if len(p) > 1}
        if killer.killed is not None:
            run = next(r for r in results if r.run_id == killer.killed.run_id)
            outcome.killed = KilledStep.of(run, killer.killed)
            progress("  " + outcome.killed.line(len(pods.get(_job_id(run), []))))
        else:
            progress(f"  no {kill_step} worker was killed ({killer.missed} of its tries ended before the kill hit them)")
        return outcome


def _job_id(run: RunResult) -> str | None:
    return next((v for (t, _, k), v in run.xcom.items() if t.endswith(".place") and k == "job_id"), None)

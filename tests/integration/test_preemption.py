"""Live preemption on the local cloud, with the real steps and clients (both Kubernetes backends):
a low-priority preemptible job runs on the only 8-GPU node; a high-priority job that only fits there
arrives; its place step deletes the victim's pods and places on the node; the high job runs; the
victim's launch step, deferred on its gang, is told it was preempted (by whom, why), waits in the
job queue, places again once the high job is released, and runs to success. Nothing leaks."""
from __future__ import annotations

import asyncio
import threading

import pytest
from airflow.sdk.exceptions import TaskDeferred

from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.jobqueue import JobQueue
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.operators.launch import GpuPodOperator
from gpuboot.operators.start import StartGpuNodesOperator
from gpuboot.sensors.gpu_ready import GpuReadySensor
from simcloud.harness import MANAGED, small_fleet, wait_until
from tests.integration.conftest import running_cloud
from tests.integration.test_cancel import running_pods
from tests.integration.test_operators import context, place, release

V100X8 = "ecs.gn6v-c10g1.20xlarge"
FLEET = small_fleet([{"name": "gpu8", "instance_type": V100X8, "status": "Running", **MANAGED},
                     {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"}],
                    timings={"stale_seconds": 1.0, "device_plugin_seconds": 0.5})
FLEET["instance_types"][V100X8] = {"cpu": 82, "memory_gib": 336, "gpu": 8, "gpu_spec": "NVIDIA V100",
                                   "price_per_hour": 26.0}
JOB = {"image": "python:3.11", "gpus": 8, "cpu": "1", "memory": "1Gi", "settle_seconds": 1,
       "boot_timeout_seconds": 60}
LOW = {**JOB, "name": "sweep", "priority_class": "low", "preemptible": True,
       "command": ["python", "-c", "import time\nprint('sweep step', flush=True)\ntime.sleep(30)\nprint('sweep done')"]}  # sleep-ok: the pod's own workload
HIGH = {**JOB, "name": "urgent", "priority_class": "high", "command": ["python", "-c", "print('urgent done')"]}


@pytest.fixture
def cloud(tmp_path, monkeypatch):
    with running_cloud(FLEET, tmp_path, monkeypatch) as sim:
        yield sim


def drive(op, ctx, method: str = "execute", event: dict | None = None):
    """Run a step as the worker and the triggerer would: each deferral's trigger to its first event,
    then the method it names, until the step returns."""
    try:
        return getattr(op, method)(ctx) if event is None else getattr(op, method)(ctx, event)
    except TaskDeferred as deferred:
        payload = asyncio.run(deferred.trigger.run().__anext__()).payload
        return drive(op, ctx, deferred.method_name, payload)


def run_job(job: dict, job_id: str, after_place=None) -> list[str]:
    """place, start, wait_gpu_ready and launch, as the gpu_job group chains them; `after_place()` runs
    between place and start."""
    plan, pushed = place(job, job_id=job_id)
    assert plan["outcome"] == "fits", plan["message"]
    if after_place:
        after_place()
    started = StartGpuNodesOperator(task_id="start", plan=plan, job=pushed["job"]).execute(context("start"))
    waited = context("wait")
    drive(GpuReadySensor(task_id="wait", baselines=started["baselines"], job=pushed["job"], plan=started["plan"]),
          waited)
    launch = GpuPodOperator(task_id="launch", job=pushed["job"], plan=waited["ti"].pushed.get("plan", started["plan"]),
                            env_source=job, startup_timeout_seconds=30, busy_poll_seconds=5)
    return drive(launch, context("launch"))


def test_a_high_job_preempts_a_low_preemptible_one_which_is_requeued_and_later_succeeds(cloud, capfd, tmp_path):
    victim: dict = {}
    log: list[str] = []

    def low() -> None:
        try:
            victim["pods"] = run_job(LOW, "sweep-run")
        except BaseException as exc:
            victim["error"] = exc

    def logged(text: str) -> bool:
        log.append(capfd.readouterr().out)
        return text in "".join(log)

    thread = threading.Thread(target=low)
    thread.start()
    wait_until(lambda: running_pods("sweep-run") != [], timeout=120, message="the low job's pod did not start")
    first_pods = running_pods("sweep-run")

    def preempted() -> None:               # the high job runs once the victim waits in the queue
        assert logged("preempted job sweep (sweep-run, class low, preemptible): deleted its pod(s)")
        wait_until(lambda: logged("requeued after preemption: queue position 1 of 1"), timeout=120,
                   message="the victim's launch did not requeue")

    assert len(run_job(HIGH, "urgent-run", after_place=preempted)) == 1   # placed on gpu8 once the victim went
    assert release("urgent-run") == ["urgent"]

    thread.join(240)
    assert not thread.is_alive() and "error" not in victim, victim.get("error")
    assert victim["pods"] == first_pods                                  # the same gang (names), run again
    logged("")
    out = "".join(log)
    (tmp_path / "preemption.log").write_text(out)
    assert "why: it needs 8 GPU(s) on node(s) gpu8 and priority class high outranks low" in out
    assert "job sweep (sweep-run) was preempted by job urgent (urgent-run) at 20" in out
    assert "it needs 8 GPU(s) on node(s) gpu8 and priority class high outranks low; this job said preemptible: " \
           "true. Requeued (not failed)" in out
    assert "woken by a release in the job queue: placing again" in out
    assert "placed again after preemption" in out and "sweep done" in out
    assert release("sweep-run") == ["sweep"]                             # it ran to completion
    assert ReservationLedger(KubeClient()).live() == []
    state = JobQueue(KubeClient()).snapshot()
    assert (state.waiting, state.running, state.preempted) == ((), (), ())


def test_two_preemptors_at_once_never_both_take_the_victims_place(cloud, capfd):
    """Two high jobs' place steps at once, each with its own clients, polling until one of them runs,
    for the one node a low job runs on: the victim is preempted once, by the job that gets the node;
    the other waits in the queue; the ledger holds the node's 8 GPUs once and no mark holds it any more;
    after the releases nothing is left."""
    plan, pushed = place(LOW, job_id="victim")
    started = StartGpuNodesOperator(task_id="start", plan=plan, job=pushed["job"]).execute(context("start"))
    with pytest.raises(TaskDeferred):          # the gang is created; its trigger is left unrun
        GpuPodOperator(task_id="launch", job=pushed["job"], plan=started["plan"], env_source=LOW,
                       startup_timeout_seconds=30).execute(context("launch"))
    wait_until(lambda: running_pods("victim") != [], timeout=120, message="the low job's pod did not start")
    outcomes: dict = {}
    barrier = threading.Barrier(2)

    def preemptor(job_id: str) -> None:
        barrier.wait()
        for _poll in range(5):         # each poll of a waiting place step, until one of them runs
            try:
                outcomes[job_id] = place({**HIGH, "name": job_id}, job_id=job_id)[0]["outcome"]
            except TaskDeferred:
                outcomes[job_id] = "waiting"
            if "fits" in outcomes.values():
                return

    threads = [threading.Thread(target=preemptor, args=(j,)) for j in ("high-a", "high-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(outcomes.values()) == ["fits", "waiting"], outcomes
    winner = next(j for j, o in outcomes.items() if o == "fits")
    live = ReservationLedger(KubeClient()).live()
    assert [(r.job_id, r.node, r.resources.gpus) for r in live] == [(winner, "gpu8", 8)]
    assert [u for u in ReservationLedger(KubeClient()).live_unavailable() if u.held_for] == []
    state = JobQueue(KubeClient()).snapshot()
    # preempted once, by the job that runs on the freed node: only the queue's head preempts, and the
    # room it freed is held for it (its firm hold, the ledger's mark) until it placed
    assert [(p.job_id, p.by) for p in state.preempted] == [("victim", winner)]
    assert sorted(w.entry.job_id for w in state.waiting) == sorted({"high-a", "high-b", "victim"} - {winner})
    assert running_pods("victim") == []
    assert capfd.readouterr().out.count("preempted job sweep (victim") == 1
    for job_id in ("high-a", "high-b", "victim"):
        release(job_id)
    assert ReservationLedger(KubeClient()).live() == []
    state = JobQueue(KubeClient()).snapshot()
    assert (state.waiting, state.running, state.preempted) == ((), (), ())

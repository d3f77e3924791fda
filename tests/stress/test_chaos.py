"""`make chaos` in small: a few jobs through every injected fault (throttled ECS, NoStock on the
preferred type, a node never Ready, a device plugin never registering, 409 bursts, one launch
worker SIGKILLed mid-pod), each step try in its own forked worker process (chaos.scenario).
And the verdict on the killed step alone, on recorded runs (no cloud)."""
from __future__ import annotations

import re
import threading

from chaos.monitor import MonitorReport
from chaos.runner import Attempt, RunResult, StepCall, StepResult
from chaos.scenario import ChaosOutcome, KilledStep, WorkerKiller, run_chaos

SUMMARY = re.compile(r"chaos: (\d+) jobs, (\d+) succeeded, (\d+) failed with a reason, 0 overcommitted, "
                     r"0 leaked reservations, 0 idle instances left running")


def test_small_chaos_run_keeps_every_promise(tmp_path):
    outcome = run_chaos(job_count=5, seed=3, workdir=tmp_path, kill_step="launch")
    summary = outcome.summary()
    assert outcome.problems() == [], summary
    jobs, succeeded, failed = map(int, SUMMARY.fullmatch(summary).groups())
    assert jobs == 5 and succeeded + failed == jobs
    # The killed launch was retried and adopted the pod it had created: one pod, job succeeded.
    assert outcome.killed is not None and outcome.killed.retried and outcome.duplicate_pods == {}
    # The faults were met and got over: the nodes that never became Ready / never registered GPUs
    # were given up on at the boot timeout (whether a job meets NoStock depends on the mix; the
    # full `make chaos` run of 16 jobs does). Every job not pinned to V100 succeeds; the V100 job
    # meets both broken V100 nodes and may use up its bounded re-placements: then it fails, with
    # the boot timeout as its reason.
    log = (tmp_path / "workers.log").read_text()
    assert "not GPU-ready" in log
    unpinned = [r for r in outcome.results if r.conf.get("gpu_model") != "V100"]
    assert all(r.state == "success" for r in unpinned), [(r.run_id, r.reason) for r in unpinned]
    assert all("not GPU-ready" in r.reason for r in outcome.failed_with_reason)


# -- the killed step's verdict, on recorded runs ----------------------------------------------
def start_call(run_id: str) -> StepCall:
    return StepCall(operator="gpuboot.operators.start:StartGpuNodesOperator", kwargs={}, dag_id="gpu_job_chaos",
                    run_id=run_id, task_id="gpu_job.start")


STEPS = ("place", "start", "wait_gpu_ready", "launch", "release")


def recorded_run(run_id: str, start_tries: list[tuple[int, str, str]]) -> RunResult:
    """A run whose start step's tries ended as `start_tries` ((try, status, detail)), every
    other step in one try; the run succeeded."""
    run = RunResult(run_id, {"name": run_id})
    run.history.append(Attempt(1.0, "gpu_job.place", -1, 1, "success"))
    run.history += [Attempt(1.0 + n, "gpu_job.start", -1, n, status, detail) for n, status, detail in start_tries]
    run.history += [Attempt(8.0, "gpu_job.wait_gpu_ready", -1, 1, "deferred", "NodeGpuReadyTrigger"),
                    Attempt(9.0, "gpu_job.wait_gpu_ready", -1, 1, "success"),
                    Attempt(10.0, "gpu_job.launch", -1, 1, "success"),
                    Attempt(11.0, "gpu_job.release", -1, 1, "success")]
    run.states = {f"gpu_job.{step}": "success" for step in STEPS}
    return run


def test_the_report_line_and_the_verdict_on_the_killed_step_agree():
    retried = KilledStep.of(recorded_run("chaos-005", [(1, "failed", "worker process died (exit code -9)"),
                                                       (2, "success", "")]), start_call("chaos-005"))
    assert retried.retried
    assert retried.line(1) == ("killed worker of chaos-005 gpu_job.start (try 1): retried to success "
                               "(try 1 failed, try 2 success); job success, 1 pod(s)")
    assert ChaosOutcome([], MonitorReport(), killed=retried).problems() == []

    # A killed try that was never retried: the line says so, and so does the verdict.
    stuck = KilledStep.of(recorded_run("chaos-009", [(1, "failed", "worker process died (exit code -9)")]),
                          start_call("chaos-009"))
    assert not stuck.retried and "NOT retried to success (try 1 failed)" in stuck.line(0)
    (problem,) = ChaosOutcome([], MonitorReport(), killed=stuck).problems()
    assert "chaos-009 gpu_job.start was not retried to success" in problem


class Worker:
    """A forked worker as the killer sees it: alive until killed or until it ends by itself."""

    def __init__(self) -> None:
        self.pid, self.signalled = 4242, threading.Event()

    def is_alive(self) -> bool:
        return not self.signalled.is_set()

    def kill(self) -> None:
        self.signalled.set()


def test_a_kill_that_lands_after_the_try_sent_its_result_is_not_counted_and_the_killer_re_arms():
    """Issue 11: `--kill-step start` ended with "the killed step ... was not retried" while its
    report line said "retried -> success": the start step returns right after StartInstances,
    the very moment the killer waits for, so its SIGKILL could land after the try had sent its
    result. That try succeeded (nothing to retry), yet the killer counted it as killed."""
    killer = WorkerKiller(cloud=None, step="start")
    killer._moment = lambda call: (lambda: True)         # the instance shows as starting at once
    late, worker = start_call("chaos-017"), Worker()
    killer.on_spawn(late, worker)
    assert worker.signalled.wait(10)
    killer.on_result(late, StepResult("success", value={"plan": {}}))    # the result was already sent
    assert killer.killed is None and killer.missed == 1

    hit, worker = start_call("chaos-018"), Worker()
    killer.on_spawn(hit, worker)                         # re-armed: the next start worker is killed
    assert worker.signalled.wait(10)
    killer.on_result(hit, StepResult("failed", error="worker process died (exit code -9)"))
    assert killer.killed is hit

    other, worker = start_call("chaos-019"), Worker()
    killer.on_spawn(other, worker)                       # one kill per run
    assert not worker.signalled.wait(0.5)


def test_the_runner_runs_release_after_a_failed_step_as_airflow_does():
    """release is a teardown (all_done_setup_success, setup: place): it runs after a failed wait or
    launch, not after a failed place; the steps after a failure do not run."""
    from chaos.harness import job_dag
    from chaos.runner import DagRunner

    dag = job_dag()
    runner = DagRunner(dag)
    try:
        ids = {t.task_id.rsplit(".", 1)[-1]: t for t in dag.tasks}
        ran = {"place": "success", "start": "success", "wait_gpu_ready": "failed", "launch": "upstream_failed"}
        done = {ids[k].task_id: v for k, v in ran.items()}
        assert runner._may_run(ids["release"], done)
        assert not runner._may_run(ids["launch"], {ids["wait_gpu_ready"].task_id: "failed", **done})
        failed_place = {ids[k].task_id: v for k, v in {**ran, "place": "failed"}.items()}
        assert not runner._may_run(ids["release"], failed_place)
    finally:
        runner.close()

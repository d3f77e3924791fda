"""Crash safety: each step runs in its own process (tests/integration/step_runner.py), is
SIGKILLed mid-step, and is run again as Airflow's retry would. The job still finishes with
one StartInstances effect, one pod and a clean ledger. Reservations left by a dead run expire."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuboot.core.jobspec import JobSpec
from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.booking import LAUNCH_MARGIN_SECONDS, Booker
from gpuboot.lifecycle.ledger import ReservationLedger
from tests.integration.conftest import wait_until
from tests.integration.test_operators import JOB, place, release
from tests.integration.test_resilience import ledger, starts_of, status

REPO = Path(__file__).resolve().parents[2]
# The pod runs until the test opens its gate (a FIFO): it is still running whenever the retry looks.
SCRIPT = ("import os\nprint('crash-test begin', flush=True)\nopen(os.environ['CRASH_GATE']).read()\n"
          "print('crash-test done', flush=True)\n")
CRASH_JOB = {**JOB, "gpus": 2, "command": ["python", "-c", SCRIPT],
             "boot_timeout_seconds": 180}   # a boot timeout is not what this test is about: ample on a loaded machine


class Step:
    """One step of the job run in a subprocess; `kill()` is the worker dying (SIGKILL)."""

    def __init__(self, tmp_path: Path, step: str, kwargs: dict, try_number: int = 1, pause_at: str | None = None):
        self.out = tmp_path / f"{step}-{try_number}.json"
        spec = tmp_path / f"{step}-{try_number}.spec.json"
        spec.write_text(json.dumps({"step": step, "kwargs": kwargs, "try_number": try_number,
                                    "out": str(self.out), "pause_at": pause_at}))
        self.log = open(tmp_path / f"{step}-{try_number}.log", "wb")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "plugins")])}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.integration.step_runner", str(spec)],
                                        cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def paused(self) -> bool:
        assert self.process.poll() is None, f"step exited early with {self.process.returncode}: {self.text()}"
        return Path(f"{self.out}.paused").exists()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self.log.close()

    def result(self, timeout: float = 240) -> dict:
        """Its answer once it exits; the deadline is generous: on a loaded 2-core machine a step's
        subprocess spends tens of seconds importing Airflow before it waits on anything."""
        code = self.process.wait(timeout)
        self.log.close()
        assert code == 0, self.text()
        return json.loads(self.out.read_text())

    def text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]


def job_pods(cloud, job_id: str) -> list:
    return cloud.core_v1().list_namespaced_pod("gpu-jobs", label_selector=f"gpuboot.io/job={job_id}").items


def test_killed_start_wait_and_launch_retry_to_one_start_one_pod_and_a_clean_ledger(cloud, tmp_path):
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    crash_job = {**CRASH_JOB, "env": {"CRASH_GATE": str(gate)}}
    plan, pushed = place(crash_job, job_id="crash")
    assert plan["nodes_to_start"] == ["gpu2-stop"]
    job = pushed["job"]

    # start: the worker dies right after StartInstances was accepted, before any XCom
    first = Step(tmp_path, "start", {"plan": plan, "job": job}, pause_at="started")
    wait_until(first.paused, timeout=60)
    first.kill()
    assert status(cloud, "gpu2-stop") in ("Starting", "Running")
    started = Step(tmp_path, "start", {"plan": plan, "job": job}, try_number=2).result()["result"]
    assert started["started"] == []                         # the retry saw it already starting
    assert [a["node"] for a in started["plan"]["assignments"]] == ["gpu2-stop"]
    assert starts_of(cloud, "gpu2-stop") == 1

    # wait: the worker dies while the wait is deferred; the retry waits again from scratch
    wait_kwargs = {"baselines": started["baselines"], "job": job, "plan": started["plan"]}
    first = Step(tmp_path, "wait", wait_kwargs, pause_at="deferred")
    wait_until(first.paused, timeout=60)
    first.kill()
    waited = Step(tmp_path, "wait", wait_kwargs, try_number=2).result()
    assert waited["result"] == ["train"]

    # launch: the worker dies while the pod runs; the retry reattaches to that pod
    launch_kwargs = {"job": job, "plan": waited["pushed"]["plan"], "env_source": crash_job, "startup_timeout_seconds": 60}
    first = Step(tmp_path, "launch", launch_kwargs)
    wait_until(lambda: any(p.status.phase == "Running" for p in job_pods(cloud, "crash")), timeout=60,
               message=first.text)
    first.kill()
    retry = Step(tmp_path, "launch", launch_kwargs, try_number=2)
    wait_until(lambda: "adopting the gang of attempt 1" in retry.text(), timeout=120, message=retry.text)
    gate.write_text("go")                                  # the adopted pod may end now
    retry.result()
    pods = job_pods(cloud, "crash")
    assert len(pods) == 1, [p.metadata.name for p in pods]
    assert (pods[0].spec.node_name, pods[0].status.phase) == ("gpu2-stop", "Succeeded")
    assert "adopting the gang of attempt 1" in retry.text() and "crash-test done" in retry.text()

    release("crash")
    assert ledger().live() == [] and ledger().read()[0] == []
    assert starts_of(cloud, "gpu2-stop") == 1


def test_reservation_lifetime_comes_from_the_spec_and_a_dead_run_leaks_nothing(cloud):
    before = time.time()
    place({**JOB, "boot_timeout_seconds": 120}, job_id="derived")
    (r,) = ledger().live()
    assert before + 120 + LAUNCH_MARGIN_SECONDS <= r.expires_at <= time.time() + 120 + LAUNCH_MARGIN_SECONDS

    # a user TTL shorter than what the run needs (boot timeout + launch) is raised to it
    place({**JOB, "name": "dead", "reservation_ttl_seconds": 2}, job_id="dead")
    (dead,) = [r for r in ledger().live() if r.job_id == "dead"]
    assert dead.node == "gpu-stop" and dead.expires_at >= before + JOB["boot_timeout_seconds"] + LAUNCH_MARGIN_SECONDS

    # the run dies (no release, no renewal): a placement made once its entry expired gets the GPU
    kube = KubeClient()
    later = Booker(kube, EcsHook(), ReservationLedger(kube), logging.getLogger("later"),
                   clock=lambda: dead.expires_at + 1)
    plan = later.book(JobSpec.from_dict({**JOB, "name": "next"}), "next").plan
    assert [a.node for a in plan.assignments] == ["gpu-stop"]
    assert sorted(r.job_id for r in ledger().live(now=dead.expires_at + 1)) == ["derived", "next"]

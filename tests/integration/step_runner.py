"""Run one gpuboot step the way an Airflow worker would, in its own process, so a test can
SIGKILL it mid-step and run it again as the retry.

    python -m tests.integration.step_runner STEP.json

STEP.json: {"step": "start"|"wait"|"launch", "kwargs": {...operator arguments...},
"try_number": 1, "out": "result.json", "pause_at": null|"started"|"deferred"}.
A deferral is resumed in-process, as the triggerer would (run the trigger to its event).
`pause_at` writes `<out>.paused` at that point and then blocks, for the test to kill
the process there: "started" right after StartInstances returned, "deferred" when the
sensor has handed its wait to the trigger. Kubernetes and ECS are the real local cloud.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from airflow.sdk.exceptions import TaskDeferred

from gpuboot.hooks.ecs import EcsHook
from gpuboot.operators.launch import GpuPodOperator
from gpuboot.operators.start import StartGpuNodesOperator
from gpuboot.sensors.gpu_ready import GpuReadySensor

OPERATORS = {"start": StartGpuNodesOperator, "wait": GpuReadySensor, "launch": GpuPodOperator}


class TaskInstance:
    """Identity and XCom pushes."""

    def __init__(self, task_id: str, try_number: int, map_index: int):
        self.dag_id, self.task_id, self.run_id = "crash_dag", task_id, "crash_run"
        self.try_number, self.map_index = try_number, map_index
        self.pushed: dict = {}

    def xcom_push(self, key, value):
        self.pushed[key] = value


def pause(out: Path) -> None:
    Path(f"{out}.paused").write_text("paused")
    while True:               # the test kills us here
        time.sleep(60)  # sleep-ok: a process the test kills


def main(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    out = Path(spec["out"])
    step, pause_at = spec["step"], spec.get("pause_at")
    if pause_at == "started":
        real = EcsHook.start_instances

        def start_then_pause(self, ids):
            outcomes = real(self, ids)
            pause(out)
            return outcomes
        EcsHook.start_instances = start_then_pause
    ti = TaskInstance(step, spec.get("try_number", 1), -1)
    context = {"ti": ti, "run_id": ti.run_id, "dag": None, "params": {}, "task_state_store": None}
    op = OPERATORS[step](task_id=step, **spec["kwargs"])
    try:
        result = op.execute(context)
    except TaskDeferred as deferred:
        while True:
            if pause_at == "deferred":
                pause(out)
            event = asyncio.run(deferred.trigger.run().__anext__()).payload
            try:
                result = getattr(op, deferred.method_name)(context, event)
                break
            except TaskDeferred as again:
                deferred = again
    out.write_text(json.dumps({"result": result, "pushed": ti.pushed}, default=str))


if __name__ == "__main__":
    main(sys.argv[1])

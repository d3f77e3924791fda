"""A small stand-in for Airflow's scheduler, workers and triggerer, to run many GPU job
DAG runs at once in one process.

Why not dag.test(): it runs one DAG run at a time, in-process, and one process per run
(each importing Airflow) is too heavy for 30 runs on 2 cores. Why not a real scheduler:
seconds of scheduling latency per step and a database; the product's behaviour under
contention is in the operators, the trigger and the cluster, not in Airflow's loop.

So this walks the *real* task graph of a DAG (e.g. dags/gpu_job.py, built by
gpuboot.task_groups.gpu_job.gpu_job_group) the way Airflow would: tasks in dependency order,
trigger rules (ALL_SUCCESS, ALL_DONE for release), XComArgs resolved from the runs'
own XCom store (keys included), mapped tasks expanded over their upstream's list,
operators instantiated afresh for every try and every resume with the task's own
constructor arguments, `TaskDeferred` handed to a shared triggerer (one asyncio loop,
like Airflow's triggerer) and the task resumed with the event, retries with a short
delay (a try is failed by any exception but AirflowFailException, or by the death of
its worker process). Each try runs either in the calling thread (InlineWorkers, cheap:
the concurrency stress test) or in a process forked from a forkserver that has
Airflow and gpuboot preloaded (ProcessWorkers: a worker can be SIGKILLed mid-step,
as `make chaos` does). What it leaves out: pools, priorities, scheduling delays and
the metadata database.
"""
from __future__ import annotations

import asyncio
import copy
import datetime as dt
import importlib
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

log = logging.getLogger(__name__)

RETURN_KEY = "return_value"


# -- one try of one task (runs in a worker) -----------------------------------------------------
@dataclass
class StepCall:
    """Everything a worker needs to run (or resume) one task try; picklable."""

    operator: str                   # "module:QualName"
    kwargs: dict
    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    try_number: int = 1
    params: dict = field(default_factory=dict)
    method: str = "execute"         # or the resume method named by TaskDeferred
    method_kwargs: dict = field(default_factory=dict)
    xcoms: dict = field(default_factory=dict)   # (task id, key) -> value: what the run's unmapped tasks pushed


@dataclass
class StepResult:
    status: str                     # success | deferred | failed | skipped
    value: Any = None
    pushed: dict = field(default_factory=dict)
    error: str | None = None
    retryable: bool = True
    trigger: tuple[str, dict] | None = None
    resume: str | None = None
    resume_kwargs: dict = field(default_factory=dict)


class TaskInstanceStandIn:
    """What operators read from context["ti"]: identity, try number, XCom pushes, and pulls of what the
    run's earlier tasks pushed (release reads the nodes launch created its gang on)."""

    def __init__(self, call: StepCall):
        self.dag_id, self.task_id, self.run_id = call.dag_id, call.task_id, call.run_id
        self.map_index, self.try_number = call.map_index, call.try_number
        self.start_date = dt.datetime.now(dt.UTC)
        self.pushed: dict[str, Any] = {}
        self.xcoms = call.xcoms

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value

    def xcom_pull(self, task_ids: str | None = None, key: str = RETURN_KEY, **_) -> Any:
        return self.xcoms.get((task_ids, key))


def load(path: str):
    module, _, name = path.partition(":")
    target = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


def run_step(call: StepCall) -> StepResult:
    """Instantiate the operator and run execute (or the resume method) with a minimal context."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException, TaskDeferred

    ti = TaskInstanceStandIn(call)
    try:
        op = load(call.operator)(task_id=call.task_id, **call.kwargs)
        context = {"ti": ti, "task_instance": ti, "run_id": call.run_id, "dag": None, "task": op,
                   "params": dict(call.params), "map_index": call.map_index}
        if call.method == "execute":
            value = op.execute(context)
        else:
            value = getattr(op, call.method)(context, **call.method_kwargs)
        return StepResult("success", value=value, pushed=ti.pushed)
    except TaskDeferred as deferred:
        return StepResult("deferred", pushed=ti.pushed, trigger=deferred.trigger.serialize(),
                          resume=deferred.method_name, resume_kwargs=dict(deferred.kwargs or {}))
    except AirflowSkipException as exc:
        return StepResult("skipped", pushed=ti.pushed, error=str(exc))
    except AirflowFailException as exc:
        return StepResult("failed", pushed=ti.pushed, error=f"{type(exc).__name__}: {exc}", retryable=False)
    except Exception as exc:
        log.debug("try failed:\n%s", traceback.format_exc())
        return StepResult("failed", pushed=ti.pushed, error=f"{type(exc).__name__}: {exc}")


# -- workers ----------------------------------------------------------------------------------
class InlineWorkers:
    """Run each try in the calling thread."""

    def run(self, call: StepCall, on_spawn: Callable | None = None) -> StepResult:
        return run_step(call)

    def close(self) -> None:
        pass


def _child(call: StepCall, conn, log_path: str | None) -> None:
    if log_path:   # the worker's output (operator logs, pod logs) goes to the run's log file
        import os
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    conn.send(run_step(call))
    conn.close()


class ProcessWorkers:
    """Run each try in its own process, forked from a forkserver with Airflow and gpuboot
    already imported (cheap, like a prefork worker pool). A process that dies fails the try.
    Create it after the environment (AIRFLOW_CONN_*) is set: the forkserver inherits it."""

    PRELOAD: ClassVar[list[str]] = ["chaos.runner", "gpuboot.operators.place", "gpuboot.operators.start", "gpuboot.sensors.gpu_ready",
               "gpuboot.operators.launch", "gpuboot.operators.release", "gpuboot.triggers.gpu_ready"]

    def __init__(self, log_path: str | None = None) -> None:
        import multiprocessing

        self.log_path = log_path
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(self.PRELOAD)

    def run(self, call: StepCall, on_spawn: Callable | None = None) -> StepResult:
        receive, send = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(target=_child, args=(call, send, self.log_path), daemon=True,
                                   name=f"worker {call.run_id} {call.task_id}[{call.map_index}]#{call.try_number}")
        process.start()
        send.close()
        if on_spawn:
            on_spawn(call, process)
        try:
            result = receive.recv()
        except EOFError:
            result = None
        finally:
            receive.close()
        process.join()
        if result is None:
            return StepResult("failed", error=f"worker process died (exit code {process.exitcode})")
        return result

    def close(self) -> None:
        pass


# -- triggerer ----------------------------------------------------------------------------------
class Triggerer:
    """One asyncio loop in a thread running every deferred task's trigger until its first event."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="triggerer")
        self.thread.start()

    def run(self, trigger: tuple[str, dict]) -> dict:
        return asyncio.run_coroutine_threadsafe(self._first_event(*trigger), self.loop).result()

    @staticmethod
    async def _first_event(classpath: str, kwargs: dict) -> dict:
        module, _, name = classpath.rpartition(".")
        trigger = getattr(importlib.import_module(module), name)(**kwargs)
        async for event in trigger.run():
            return event.payload
        raise RuntimeError(f"trigger {classpath} ended without an event")

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# -- DAG runs -----------------------------------------------------------------------------------
@dataclass
class Attempt:
    """One thing that happened to a task: a try's outcome, a deferral or a resume."""

    at: float
    task_id: str
    map_index: int
    try_number: int
    status: str
    detail: str = ""


@dataclass
class RunResult:
    run_id: str
    conf: dict
    states: dict[str, str] = field(default_factory=dict)      # task id (map index appended) -> state
    errors: dict[str, str] = field(default_factory=dict)      # task -> last error
    history: list[Attempt] = field(default_factory=list)
    xcom: dict[tuple[str, int, str], Any] = field(default_factory=dict)
    started_at: float = 0.0
    ended_at: float = 0.0

    @property
    def state(self) -> str:
        bad = {"failed", "upstream_failed"}
        return "failed" if any(s in bad for s in self.states.values()) else "success"

    @property
    def reason(self) -> str | None:
        """Why the run failed: the first failed task's last error."""
        for task, state in self.states.items():
            if state == "failed":
                return f"{task}: {self.errors.get(task) or 'no error recorded'}"
        return None

    def short_states(self) -> dict[str, str]:
        return {task.split(".", 1)[-1]: state for task, state in self.states.items()}


class DagRunner:
    """Runs DAG runs of `dag`; `run()` is thread-safe, so many runs can go at once."""

    def __init__(self, dag, workers=None, triggerer: Triggerer | None = None, *, min_retries: int = 2,
                 retry_delay: float = 0.5, on_spawn: Callable | None = None,
                 on_result: Callable[[StepCall, StepResult], None] | None = None) -> None:
        """`on_spawn(call, process)` is called as a ProcessWorkers worker starts, `on_result(call,
        outcome)` as any worker's call ends (with the same call object): what that worker's try did."""
        self.dag = dag
        self.workers = workers or InlineWorkers()
        self.triggerer = triggerer or Triggerer()
        self.min_retries, self.retry_delay = min_retries, retry_delay
        self.on_spawn, self.on_result = on_spawn, on_result

    def close(self) -> None:
        self.triggerer.close()
        self.workers.close()

    def run(self, run_id: str, conf: Mapping | None = None) -> RunResult:
        result = RunResult(run_id=run_id, conf=dict(conf or {}), started_at=time.time())
        params = self._params(conf or {})
        done: dict[str, str] = {}
        for task in self.dag.topological_sort():
            upstream = [done[u] for u in task.upstream_task_ids]
            if not self._may_run(task, done):
                state = "skipped" if upstream and all(s == "skipped" for s in upstream) else "upstream_failed"
            elif getattr(task, "is_mapped", False):
                state = self._run_mapped(task, params, result)
            else:
                state = self._run_task(task, self._kwargs(task, result), params, result)
            done[task.task_id] = result.states[task.task_id] = state
        result.ended_at = time.time()
        return result

    def _may_run(self, task, done: Mapping[str, str]) -> bool:
        """Airflow's trigger rules the DAGs here use: all_success (the default), all_done, and a
        teardown's all_done_setup_success (every upstream done and, if it has setups, one of them
        succeeded: release runs after a failed wait, as in Airflow's trigger_rule_dep; a runner that
        skipped it would hide a leaked reservation)."""
        rule = str(getattr(task.trigger_rule, "value", task.trigger_rule))
        upstream = {u: done[u] for u in task.upstream_task_ids}
        if rule == "all_done":
            return True
        if rule == "all_done_setup_success":
            setups = [u for u in upstream if getattr(self.dag.get_task(u), "is_setup", False)]
            return not setups or any(upstream[u] == "success" for u in setups)
        if rule != "all_success":
            raise NotImplementedError(f"trigger rule {rule} of {task.task_id} is not emulated by chaos.runner")
        return all(state == "success" for state in upstream.values())

    def _params(self, conf: Mapping) -> dict:
        """The DAG's params with the run's conf applied, validated (as a triggered run gets them)."""
        params = copy.deepcopy(self.dag.params)
        for key, value in conf.items():
            params[key] = value
        return params.validate()

    # -- XComArgs -------------------------------------------------------------------------------
    def _resolve(self, value, result: RunResult):
        from airflow.sdk.definitions.xcom_arg import PlainXComArg

        if isinstance(value, PlainXComArg):
            task_id, key = value.operator.task_id, value.key
            if getattr(value.operator, "is_mapped", False):
                return [v for (t, _, k), v in sorted(result.xcom.items(), key=lambda kv: kv[0][1])
                        if t == task_id and k == key]
            return result.xcom.get((task_id, -1, key))
        if isinstance(value, dict):
            return {k: self._resolve(v, result) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._resolve(v, result) for v in value)
        return value

    def _kwargs(self, task, result: RunResult) -> tuple[str, dict]:
        raw = {k: v for k, v in task._BaseOperator__init_kwargs.items() if k not in ("task_id", "dag", "task_group")}
        return self._classpath(type(task)), self._resolve(raw, result)

    @staticmethod
    def _classpath(kind: type) -> str:
        return f"{kind.__module__}:{kind.__qualname__}"

    # -- tasks ----------------------------------------------------------------------------------
    def _run_mapped(self, task, params: dict, result: RunResult) -> str:
        (name, arg), = task.expand_input.value.items()
        items = self._resolve(arg, result) or []
        if not items:
            return "skipped"
        partial = {k: v for k, v in task.partial_kwargs.items() if k not in ("task_id", "dag", "task_group")}
        base = self._resolve(partial, result)
        classpath = self._classpath(task.operator_class)

        def one(index: int) -> str:
            kwargs = {**base, name: items[index], "_airflow_from_mapped": True}
            state = self._run_task(task, (classpath, kwargs), params, result, map_index=index)
            result.states[f"{task.task_id}[{index}]"] = state
            return state

        with ThreadPoolExecutor(max_workers=len(items)) as pool:
            states = list(pool.map(one, range(len(items))))
        return "success" if all(s == "success" for s in states) else "failed"

    def _note(self, result: RunResult, task_id: str, map_index: int, try_number: int, status: str,
              detail: str = "") -> None:
        result.history.append(Attempt(time.time(), task_id, map_index, try_number, status, detail))
        log.info("%s %s[%d] try %d: %s %s", result.run_id, task_id, map_index, try_number, status, detail[:300])

    def _run_task(self, task, operator: tuple[str, dict], params: dict, result: RunResult,
                  map_index: int = -1) -> str:
        classpath, kwargs = operator
        retries = max(int(getattr(task, "retries", 0) or 0), self.min_retries)
        key = task.task_id if map_index < 0 else f"{task.task_id}[{map_index}]"
        for try_number in range(1, retries + 2):
            call = StepCall(operator=classpath, kwargs=kwargs, dag_id=self.dag.dag_id, run_id=result.run_id,
                            task_id=task.task_id, map_index=map_index, try_number=try_number, params=params,
                            xcoms={(t, k): v for (t, i, k), v in result.xcom.items() if i < 0})
            while True:
                outcome = self.workers.run(call, self.on_spawn)
                if self.on_result:
                    self.on_result(call, outcome)
                for k, v in outcome.pushed.items():
                    result.xcom[(task.task_id, map_index, k)] = v
                if outcome.status != "deferred":
                    break
                self._note(result, task.task_id, map_index, try_number, "deferred", outcome.trigger[0])
                event = self.triggerer.run(outcome.trigger)
                call = StepCall(**{**call.__dict__, "method": outcome.resume,
                                   "method_kwargs": {**outcome.resume_kwargs, "event": event}})
            self._note(result, task.task_id, map_index, try_number, outcome.status, outcome.error or "")
            if outcome.status == "success":
                if outcome.value is not None:
                    result.xcom[(task.task_id, map_index, RETURN_KEY)] = outcome.value
                return "success"
            if outcome.status == "skipped":
                return "skipped"
            result.errors[key] = outcome.error or "failed"
            if not outcome.retryable:
                break
            if try_number <= retries:
                time.sleep(self.retry_delay)   # Airflow's retry_delay, shortened
        return "failed"

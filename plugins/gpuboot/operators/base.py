"""What every gpuboot step shares on the Airflow side: its connections, the ledger's namespace,
the job spec (parsed once per task instance) and the JobBoot built from them.

The steps (place, start, wait_gpu_ready, launch, release, idle scale-down) each set
`kubernetes_conn_id`, `ecs_conn_id`, `ledger_namespace` and, where they take one, `job`;
this mixin turns those into adapters, so no step builds them its own way. The helpers below
(`resolve_job`, `job_id_for`, `context_job_id`, `push`) are the steps' other shared pieces.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from gpuboot.core.jobspec import ENV_WITHHELD, JobSpec, JobSpecError, params_schema
from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.boot import JobBoot
from gpuboot.lifecycle.ledger import ReservationLedger


class GpuJobStep:
    """Mixin for the gpuboot steps (see the module doc)."""

    kubernetes_conn_id: str
    ecs_conn_id: str
    ledger_namespace: str = "default"
    job: Mapping | Any = None

    def kube(self) -> KubeClient:
        return KubeClient(self.kubernetes_conn_id)

    def ecs(self) -> EcsHook:
        return EcsHook(self.ecs_conn_id)

    def ledger(self, kube: KubeClient | None = None) -> ReservationLedger:
        return ReservationLedger(kube or self.kube(), self.ledger_namespace)

    def render_template_fields(self, context, jinja_env=None) -> None:
        """Rendered as usual, then `job` (what "Rendered Templates" shows) keeps its env's names only;
        the values stay in this task's memory (job_values) for the step itself."""
        super().render_template_fields(context, jinja_env)  # type: ignore[misc]
        self._job_values = self.job
        self.job = withhold_env(self.job)

    def job_values(self) -> Mapping | Any:
        """`job` as rendered, env values included (the shown `job` has names only)."""
        return getattr(self, "_job_values", None) or self.job

    def spec(self) -> JobSpec | None:
        """The job as the place step validated it (XCom "job"), parsed once; None when wired without it."""
        job = self.job_values()
        if not job:
            return None
        cached = getattr(self, "_spec_cache", None)
        if cached is None or cached[0] is not job:
            cached = (job, JobSpec.from_dict(dict(job), source="job"))
            self._spec_cache = cached
        return cached[1]

    def job_boot(self, job_id: str, **kwargs) -> JobBoot:
        """Bring-up and fall-back for `job_id` with this step's connections, ledger and spec."""
        kube = self.kube()
        return JobBoot(kube, self.ecs(), self.ledger(kube), self.log, spec=self.spec(), job_id=job_id, **kwargs)


# -- shared helpers ------------------------------------------------------------------------
def resolve_job(job: Mapping | None, context: Mapping, declared: Iterable[str] = ()) -> JobSpec:
    """The job from the `job` argument, or from the DAG run's params when it is None;
    an invalid job fails the task at once (no retry) with the field and the fix.

    From params, every key is part of the job except params the DAG declares for its own
    use (`declared` minus the JobSpec fields): a key the trigger conf brings that is neither
    (a typo such as `gpu`) is refused by JobSpec's unknown-field check, never dropped."""
    if job is None:
        own = set(declared) - set(params_schema())
        job = {k: v for k, v in (context.get("params") or {}).items() if k not in own}
        source = "DAG run params"
    else:
        source = "job"
    try:
        return JobSpec.from_dict(dict(job), source=source)
    except JobSpecError as exc:
        raise AirflowFailException(str(exc)) from None


def withhold_env(job: Mapping | Any) -> Mapping | Any:
    """A job mapping as it may be shown or passed on: the env's names, never its values (ENV_WITHHELD)."""
    if isinstance(job, Mapping) and isinstance(job.get("env"), Mapping):
        return {**job, "env": dict.fromkeys(job["env"], ENV_WITHHELD)}
    return job


def job_id_for(dag_id: str, run_id: str, group: str) -> str:
    """Stable across retries of one run, unique per (DAG, run, task group), a valid label value."""
    digest = hashlib.sha256(f"{dag_id}\x00{run_id}\x00{group}".encode()).hexdigest()[:20]
    return f"gb-{digest}"


def context_job_id(task: BaseOperator, context: Mapping) -> str:
    group = task.task_id.rpartition(".")[0]   # tasks of one task group share the job id
    return job_id_for(task.dag_id, context["run_id"], group)


def push(context: Mapping, key: str, value: Any) -> None:
    context["ti"].xcom_push(key=key, value=value)


def summarize(task: BaseOperator, context: Mapping, line: str) -> None:
    """The step's one summary line (gpuboot.core.steplog): logged as `summary: ...` and pushed as XCom
    "summary", so the task's XCom tab says what happened without opening the log; gpuboot.ui.run_note
    gathers them into the run's note when the run ends. The task cannot set a note itself: Airflow
    3.3's Task SDK gives a running task no way to (the execution API only reads the run's note;
    apache/airflow#61066 and #69403 propose it), and the public REST API would need a user's
    credentials inside the task."""
    task.log.info("summary: %s", line)
    push(context, "summary", line)


class Refused(AirflowFailException):
    """A failure without retry whose first line is already the step's summary (refusal)."""


def refusal(task: BaseOperator, context: Mapping, message: str) -> AirflowFailException:
    """The failure to raise, its first line summarized first (`failed: ...`), so the run's note
    says why the step failed as well as its log does."""
    _summarize_failure(task, context, message)
    return Refused(message)


def summarizes_failure(entry):
    """For a step's entry points (execute, and the methods a deferral resumes): a failure without
    retry raised anywhere below is summarized as a refusal is, then raised as it was, so every such
    failure reaches the run's note, once, whichever layer raised it (a bad spec, a queue timeout,
    capacity that never comes)."""
    @functools.wraps(entry)
    def summarized(self, context, *args, **kwargs):
        try:
            return entry(self, context, *args, **kwargs)
        except Refused:
            raise
        except AirflowFailException as exc:
            _summarize_failure(self, context, str(exc) or type(exc).__name__)
            raise
    return summarized


def _summarize_failure(task: BaseOperator, context: Mapping, message: str) -> None:
    summarize(task, context, f"failed: {(message.splitlines() or [''])[0]}")

"""gpu_job_group: the whole GPU job as one task group inside a user's DAG.

    place >> start >> wait_gpu_ready >> launch >> release

`launch` is one task for the whole gang: it creates a pod per assignment of the plan (one
rank each, rendezvous environment set), follows them all from the triggerer and fails them
as one (gpuboot.operators.launch); a single-task job is a gang of one.

The plan flows place -> start -> wait_gpu_ready -> launch through XCom key "plan":
`start` may move the job when ECS has no stock, and `wait_gpu_ready` when a node does
not boot in time (see gpuboot.lifecycle.boot), so each step takes the plan from the step before.
"""
from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

from airflow.sdk import TaskGroup

from gpuboot.operators.launch import GpuPodOperator
from gpuboot.operators.place import PlaceGpuJobOperator
from gpuboot.operators.release import ReleaseReservationOperator
from gpuboot.operators.start import StartGpuNodesOperator
from gpuboot.sensors.gpu_ready import GpuReadySensor


def gpu_job_group(job: Mapping | None = None, *, group_id: str = "gpu_job",
                  kubernetes_conn_id: str = "kubernetes_default", ecs_conn_id: str = "alibaba_ecs_default",
                  ledger_namespace: str = "default", deferrable: bool = True,
                  busy_poll_seconds: float = 30.0, poke_interval: float = 2.0, cpu_jobs_on_gpu_nodes: bool = True,
                  retries: int = 2, retry_delay: timedelta = timedelta(seconds=30)) -> TaskGroup:
    """Build the group in the current DAG. `job` is a job spec mapping (see gpuboot.core.jobspec);
    None takes it from the DAG run's params (the `gpu_job` DAG's form).

    Every step is retried (`retries`, exponential backoff from `retry_delay`): a worker that
    dies mid-step is finished by the retry without a second start or a second pod (the steps
    are idempotent, see gpuboot.lifecycle.boot). Failures that no retry can fix (a job that never fits,
    bad input, no capacity left) raise AirflowFailException and are not retried.
    `cpu_jobs_on_gpu_nodes=False` keeps CPU-only jobs off GPU nodes even when they set allow_gpu_nodes."""
    # retry_exponential_backoff is a multiplier in Airflow 3.3: True would mean 1, a constant delay
    retry_args = {"retries": retries, "retry_delay": retry_delay, "retry_exponential_backoff": 2.0}
    with TaskGroup(group_id=group_id, default_args=retry_args) as group:
        place = PlaceGpuJobOperator(task_id="place", job=job, kubernetes_conn_id=kubernetes_conn_id,
                                    ecs_conn_id=ecs_conn_id, ledger_namespace=ledger_namespace,
                                    busy_poll_seconds=busy_poll_seconds, cpu_jobs_on_gpu_nodes=cpu_jobs_on_gpu_nodes)
        spec = place.output["job"]
        start = StartGpuNodesOperator(task_id="start", plan=place.output, job=spec,
                                      kubernetes_conn_id=kubernetes_conn_id, ecs_conn_id=ecs_conn_id,
                                      ledger_namespace=ledger_namespace, busy_poll_seconds=busy_poll_seconds)
        wait = GpuReadySensor(task_id="wait_gpu_ready", baselines=start.output["baselines"], job=spec,
                              plan=start.output["plan"], kubernetes_conn_id=kubernetes_conn_id,
                              ecs_conn_id=ecs_conn_id, ledger_namespace=ledger_namespace, deferrable=deferrable,
                              poke_interval=poke_interval)
        launch = GpuPodOperator(task_id="launch", job=spec, plan=wait.output["plan"], env_source=job,
                                kubernetes_conn_id=kubernetes_conn_id, deferrable=deferrable,
                                ecs_conn_id=ecs_conn_id, ledger_namespace=ledger_namespace,
                                busy_poll_seconds=busy_poll_seconds)
        release = ReleaseReservationOperator(task_id="release", kubernetes_conn_id=kubernetes_conn_id,
                                             ledger_namespace=ledger_namespace, launch_task_id=launch.task_id)
        # release is the teardown of place's reservation: it runs whatever happens after place
        # succeeded; it fails the run when the job did not run to completion (a teardown is the
        # last task to end, so a run marked failed while it waited would otherwise end green).
        # start and wait_gpu_ready are setups of launch too: clearing launch (Airflow clears a task's
        # setups with it) then places, starts and waits for the node again before the pods run,
        # rather than launching on a node scale-down may have stopped since.
        place >> start.as_setup() >> wait.as_setup() >> launch
        launch >> release.as_teardown(setups=place, on_failure_fail_dagrun=True)
    return group

"""The `gpu_job` DAG: run one GPU job on demand, from the Airflow UI's trigger form.

Composition only: the form comes from gpuboot.core.jobspec.params_schema() (so the UI
validates types, bounds, patterns and GPU models at trigger time) and the work from
gpuboot.task_groups.gpu_job.gpu_job_group(), which re-validates the run's params as a JobSpec.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from gpuboot.core.jobspec import form_fields
from gpuboot.task_groups.gpu_job import gpu_job_group

DOC_MD = """
### Run a GPU job

Fill in the form and trigger. Airflow's form checks patterns and bounds only when you press
Trigger; the plugin's [Run a GPU job](/gpuboot/jobs/new) page (Browse menu) checks every field as
you leave it, then triggers this DAG. The job runs as five audited steps:

1. **place**: looks at *every* node, running and stopped, keeps those that can hold
   each task **alone** (GPU, CPU, memory, GPU model, node selector, taints), prefers
   running nodes, and reserves the capacity. A job bigger than any node in the fleet
   fails here at once with the node size it would need; a job that fits the fleet but
   not its free capacity right now waits (up to the queue timeout).
2. **start**: powers on the chosen ECS instance, only if it is stopped.
3. **wait_gpu_ready**: waits (deferred, in the triggerer) until the node is Ready
   *after this boot* and its `nvidia.com/gpu` (and any other requested device) are registered
   again after the kubelet reset them.
4. **launch**: runs the pods (one per replica, as one gang) pinned to their nodes, followed from
   the triggerer; every rank's log is in this task's log, prefixed `[rank N]`, and its
   "Rendered Templates" show the image, command, arguments, env names, node and resources it ran with.
5. **release** (a teardown, runs whatever happened): drops the reservation and stops again
   a node the job started but never ran on.

Each step ends its log with one `summary:` line (e.g. `booted gpu-t4x2-1 in 17.2 s (instance up
3.1 s, kubelet Ready 4.0 s, GPUs registered 5.1 s, settled 5.0 s)`), also in its XCom `summary`.
The place task's log shows a table of every candidate node with its verdict.
"""


def trigger_form() -> dict[str, Param]:
    """Airflow Params built from the JobSpec schema, main fields first, the rest under "Advanced"."""
    return {f["key"]: Param(f["default"], description=f["description"],
                            **({**f["schema"], "section": "Advanced"} if not f["main"] else f["schema"]))
            for f in form_fields()}

with DAG(
    dag_id="gpu_job",
    schedule=None,
    catchup=False,
    max_active_runs=16,
    tags=["gpuboot"],
    description="Run one GPU job on a node booted on demand",
    doc_md=DOC_MD,
    params=trigger_form(),
) as dag:
    gpu_job_group()

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
Trigger; the plugin's **[Run a GPU job](/gpuboot/jobs/new)** page (Browse menu) checks every field as
you leave it, then triggers this DAG and links to the run. Each run's **GPU placement** tab draws
where its minutes and money went (queue, boot, device plugin, settle, run); the
[GPU fleet](/gpuboot/fleet) page shows every node. The job runs as five audited steps:

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


# Airflow's form answers a bad value only on Trigger, one field at a time: the first field's help
# (markdown, so a link) leads to gpuboot's own form
JOB_FORM_HINT = " Checked as you type, every field at once: **[Run a GPU job](/gpuboot/jobs/new)**."


def trigger_form() -> dict[str, Param]:
    """Airflow Params built from the JobSpec schema, main fields first, the rest under "Advanced"."""
    fields = form_fields()

    def param(i: int, f: dict) -> Param:
        schema = {**f["schema"], "section": "Advanced"} if not f["main"] else f["schema"]
        if i == 0:      # Airflow shows description_md only when there is no plain description
            return Param(f["default"], description=None, description_md=f["description"] + JOB_FORM_HINT, **schema)
        return Param(f["default"], description=f["description"], **schema)

    return {f["key"]: param(i, f) for i, f in enumerate(fields)}

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

"""The `gpuboot_idle_scaledown` DAG: every 5 minutes, stop managed GPU instances left idle.

Composition only: the work and its safety argument live in gpuboot.operators.scaledown.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG, Param

from gpuboot.core.idle import DEFAULT_SPARE_SECONDS
from gpuboot.operators.scaledown import IdleScaleDownOperator

DOC_MD = """
### Stop idle GPU nodes

Every 5 minutes, for each **managed** node (label `gpuboot.io/managed=true` or ECS tag
`gpuboot:managed=true`; other nodes are never touched): a node with no workload pod
(DaemonSet and static pods do not count) and no live reservation is *idle* from the
first run that sees it so (annotation `gpuboot.io/idle-since`). Once idle for
`idle_minutes`, it is cordoned, the pods and the reservation ledger are checked again
(with a ledger write that makes any concurrent placement re-read), and only then its
ECS instance is stopped in economical mode (`StopCharging`); it is un-cordoned once
Stopped. One exception, the **spare**: a node whose GPUs the rest of the running fleet
could not replace (the other running nodes have fewer free GPUs than it has) is kept up
to `spare_minutes` longer, so the next job need not wait a boot (0 keeps no spare).
The task log has one line per managed node with its verdict and reason.

Trigger with `dry_run` on to see what would be stopped without changing anything.

This DAG is created **unpaused** (whatever `dags_are_paused_at_creation` says): stopping
idle nodes is what keeps them from being billed. Pausing it is a deliberate choice, kept
across re-deploys.
"""

with DAG(
    dag_id="gpuboot_idle_scaledown",
    schedule=dt.timedelta(minutes=5),
    start_date=dt.datetime(2025, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=False,      # powering idle nodes off is the point: run from the start
    render_template_as_native_obj=True,
    tags=["gpuboot"],
    description="Stop managed GPU instances idle longer than the idle time (StopCharging)",
    doc_md=DOC_MD,
    default_args={"retries": 0},
    params={
        "idle_minutes": Param(10, type="number", minimum=0.1, maximum=1440,
                              description="Stop a managed node once idle this long (minutes; fractions "
                                          "allowed, e.g. 0.25 in the demo)."),
        "spare_minutes": Param(DEFAULT_SPARE_SECONDS / 60, type="number", minimum=0, maximum=1440,
                               description="Keep the fleet's spare (an idle node whose GPUs the other running "
                                           "nodes could not replace) up to this much longer (minutes; 0: none)."),
        "dry_run": Param(False, type="boolean",
                         description="Log the decisions without cordoning or stopping anything."),
    },
) as dag:
    IdleScaleDownOperator(
        task_id="scale_down",
        idle_seconds="{{ params.idle_minutes * 60 }}",
        spare_seconds="{{ params.spare_minutes * 60 }}",
        dry_run="{{ params.dry_run }}",
        stop_timeout_seconds=150,       # a node still Stopping is un-cordoned by a later run
        execution_timeout=dt.timedelta(minutes=4),
    )

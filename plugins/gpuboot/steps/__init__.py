"""The Airflow steps of one GPU job, one module each: place -> start -> wait_gpu_ready -> launch -> release.

    place.py     PlaceGpuJobOperator: choose nodes, reserve them in the ledger (or wait while busy)
    start.py     StartGpuNodesOperator: power on the plan's stopped instances, capacity fall-back
    wait.py      GpuReadySensor: wait until the nodes are GPU-ready (deferrable), boot-timeout fail-over
    launch.py    GpuPodOperator: the job's pod, pinned to its planned node
    release.py   ReleaseReservationOperator: end the job's reservations (a teardown)
    base.py      what every step shares: GpuJobStep (connections, ledger, job spec, JobBoot) and helpers
    waiting.py   the busy-wait shared by start and wait (CapacityWait), failures without retry

They stay thin: gather inputs through the adapters (kube, ecs, ledger), call the pure core
(inventory, placement) and the lifecycle (booking, boot), do the I/O and log what was decided
and why. The job is validated once, by `place`, which hands the canonical spec to the other
steps via XCom (key "job") next to the plan (return value). Import each step from its module.
"""

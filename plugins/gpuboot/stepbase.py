"""What every gpuboot step shares on the Airflow side: its connections, the ledger's namespace,
the job spec (parsed once per task instance) and the JobBoot built from them.

The steps (place, start, wait_gpu_ready, launch, release, idle scale-down) each set
`kubernetes_conn_id`, `ecs_conn_id`, `ledger_namespace` and, where they take one, `job`;
this mixin turns those into adapters, so no step builds them its own way.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuboot.boot import JobBoot
from gpuboot.ecs import EcsHook
from gpuboot.jobspec import JobSpec
from gpuboot.kube import KubeClient
from gpuboot.ledger import ReservationLedger


class GpuJobStep:
    """Mixin for the gpuboot operators and the sensor (see the module doc)."""

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

    def spec(self) -> JobSpec | None:
        """The job as the place step validated it (XCom "job"), parsed once; None when wired without it."""
        if not self.job:
            return None
        cached = getattr(self, "_spec_cache", None)
        if cached is None or cached[0] is not self.job:
            cached = (self.job, JobSpec.from_dict(dict(self.job), source="job"))
            self._spec_cache = cached
        return cached[1]

    def job_boot(self, job_id: str, **kwargs) -> JobBoot:
        """Bring-up and fall-back for `job_id` with this step's connections, ledger and spec."""
        kube = self.kube()
        return JobBoot(kube, self.ecs(), self.ledger(kube), self.log, spec=self.spec(), job_id=job_id, **kwargs)

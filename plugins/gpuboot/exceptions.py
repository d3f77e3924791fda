"""Every exception gpuboot raises, in one place (pure: no Airflow, no I/O library). Each is
also importable from the module that raises it."""
from __future__ import annotations

import json
from collections.abc import Sequence


class Conflict(Exception):
    """409 from the API server: the object changed since it was read (or already exists)."""


class InvalidRequest(Exception):
    """The API server refused a write that no retry can change (400 Bad Request, 422 Invalid):
    its message and the fields it names, without the HTTP headers of an ApiException."""

    def __init__(self, status: int, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.fields = status, message, fields

    @classmethod
    def of(cls, exc) -> InvalidRequest:
        try:
            body = json.loads(exc.body or "{}")
        except (TypeError, ValueError):
            body = {}
        causes = (body.get("details") or {}).get("causes") or []
        return cls(exc.status, body.get("message") or str(exc.reason),
                   tuple(c["field"] for c in causes if c.get("field")))


class Overloaded(Exception):
    """429, or a 5xx such as 504 Timeout, from the API server: it gave up on the request under load (a
    write may have landed or not). The same request may be tried again after a pause."""


class NotPermitted(Exception):
    """401 or 403 from the API server: this identity may not do that (its RBAC rules, its token). No retry
    changes it; the message names what was asked."""


class Gone(Exception):
    """410 from a watch: the resourceVersion is too old; re-list and watch again."""


class LedgerContended(Exception):
    """Every commit attempt met a conflicting write for a while; nothing is held: retry later."""


class LedgerConflict(Exception):
    """The ledger changed since it was read: re-read, re-place, commit again."""


class LedgerFull(Exception):
    """A write would make one of the ledger's ConfigMaps larger than gpuboot lets one grow (well below 1 MiB)."""


class SecondLedger(Exception):
    """A node to be booked is booked through another ledger: two gpuboot deployments with different
    ledgers manage the same nodes, and would each promise its GPUs. Nothing was booked."""


class BootError(Exception):
    """A start that failed for a reason a retry may fix (not a lack of capacity)."""


class CapacityUnavailable(Exception):
    """No capacity left for the job: every offering tried was out of stock (or failed to boot),
    and nothing else can ever hold it. The message names each one and why. No retry can fix
    it: the Airflow steps fail the task for good (gpuboot.operators.capacity_wait.final_failures)."""


class CapacityBusy(Exception):
    """The job was moved off capacity that failed, and what is left is busy right now: the
    caller waits and re-places (`JobBoot.rebook`) like the place step does, holding nothing."""

    def __init__(self, message: str, tried: Sequence[str]) -> None:
        super().__init__(message)
        self.tried = list(tried)


class JobPreempted(Exception):
    """A preemptor requeued the job while its nodes were still coming up (its start or wait step):
    the step re-places nothing and hands the job to its launch step, which requeues it
    (gpuboot.operators.requeue). `record`: the queue's preemption record (by whom, why)."""

    def __init__(self, record) -> None:
        super().__init__(f"job {record.job_id} was preempted by job {record.preemptor}: {record.reason}")
        self.record = record


class EcsError(Exception):
    """A classified ECS failure. kind: "capacity" (try another node/type), "transient"
    (retried already, may succeed later) or "permanent" (fix the request or the setup)."""

    def __init__(self, kind: str, code: str, message: str, request_id: str | None = None):
        self.kind, self.code, self.message, self.request_id = kind, code, message, request_id
        super().__init__(f"ECS {code} ({kind}): {message}" + (f" [RequestId {request_id}]" if request_id else ""))


class QuantityError(ValueError):
    """A value that is not a valid (or acceptable) Kubernetes quantity."""


class JobSpecError(ValueError):
    """A job spec mistake: `field` names what is wrong, the message says how to fix it."""

    def __init__(self, field: str, problem: str, fix: str, source: str = "job spec"):
        self.field, self.problem, self.fix, self.source = field, problem, fix, source
        super().__init__(f"{source}: {field}: {problem}. {fix}")

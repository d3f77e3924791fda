"""The reservation ledger: capacity promised to jobs, kept in one ConfigMap.

Why one ConfigMap: a gang's reservations must be taken atomically, and the API
server's resourceVersion gives compare-and-swap on one object for free. Every write
is read-modify-write guarded by the version that was read; a 409 means someone else
wrote first and the caller re-reads and re-places. Entries carry an expiry so a
crashed run leaks nothing, and expired entries are pruned on every write.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable

from gpuboot.inventory import Reservation
from gpuboot.kube import Conflict, KubeClient

log = logging.getLogger(__name__)

CONFIGMAP = "gpuboot-reservations"
DATA_KEY = "reservations.json"


class LedgerConflict(Exception):
    """The ledger changed since it was read: re-read, re-place, commit again."""


class ReservationLedger:
    """Live reservations of every job, in ConfigMap `gpuboot-reservations` of `namespace`."""

    def __init__(self, kube: KubeClient, namespace: str = "default", name: str = CONFIGMAP,
                 clock: Callable[[], float] = time.time) -> None:
        self.kube, self.namespace, self.name, self.clock = kube, namespace, name, clock

    def read(self) -> tuple[list[Reservation], str | None]:
        """All entries (expired ones included) and the version they were read at (None: no ledger yet)."""
        cm = self.kube.read_configmap(self.namespace, self.name)
        if cm is None:
            return [], None
        raw = (cm.get("data") or {}).get(DATA_KEY) or "[]"
        return [Reservation.from_json(d) for d in json.loads(raw)], cm["metadata"]["resourceVersion"]

    def live(self, now: float | None = None) -> list[Reservation]:
        now = self.clock() if now is None else now
        return [r for r in self.read()[0] if r.expires_at > now]

    def commit(self, job_id: str, reservations: Iterable[Reservation], expected_version: str | None) -> None:
        """Replace `job_id`'s entries with `reservations`, only if the ledger is still at
        `expected_version` (the version the placement was computed from); else LedgerConflict."""
        new = list(reservations)
        if any(r.job_id != job_id for r in new):
            raise ValueError(f"commit for job {job_id!r} got reservations of another job")
        current, version = self.read()
        if version != expected_version:
            raise LedgerConflict(f"ledger moved from version {expected_version} to {version}")
        self._write([r for r in current if r.job_id != job_id] + new, version)

    def release(self, job_id: str, attempts: int = 20) -> list[Reservation]:
        """Remove every entry of `job_id` (idempotent); returns what was removed."""
        for _ in range(attempts):
            current, version = self.read()
            mine = [r for r in current if r.job_id == job_id]
            if not mine:
                return []
            try:
                self._write([r for r in current if r.job_id != job_id], version)
                return mine
            except LedgerConflict:
                continue
        raise LedgerConflict(f"could not release job {job_id} after {attempts} conflicting writes")

    def _write(self, entries: list[Reservation], version: str | None) -> None:
        now = self.clock()
        kept = sorted((r for r in entries if r.expires_at > now), key=lambda r: (r.job_id, r.task))
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/managed-by": "gpuboot"}},
                "data": {DATA_KEY: json.dumps([r.to_json() for r in kept], sort_keys=True)}}
        try:
            if version is None:
                self.kube.create_configmap(self.namespace, body)
            else:
                body["metadata"]["resourceVersion"] = version
                self.kube.replace_configmap(self.namespace, body)
        except Conflict as exc:
            raise LedgerConflict(str(exc)) from None

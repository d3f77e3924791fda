"""The reservation ledger: capacity promised to jobs, kept in one ConfigMap.

Why one ConfigMap: a gang's reservations must be taken atomically, and the API
server's resourceVersion gives compare-and-swap on one object for free. Every write
is read-modify-write guarded by the version that was read; a 409 means someone else
wrote first and the caller re-reads and re-places. Entries carry an expiry so a
crashed run leaks nothing, and expired entries are pruned on every write.

The same ConfigMap holds the insufficient-capacity cache (key `unavailable.json`):
offerings that ran out of stock and nodes that failed to boot, each with an expiry.
Keeping it next to the reservations means every run and worker shares it, and a
placement that commits after a mark was written must have read that mark (the CAS
guarantees it), which is what lets a run stop a node it abandons without a race.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuboot.inventory import Reservation
from gpuboot.kube import Conflict, KubeClient
from gpuboot.placement import Unavailable

log = logging.getLogger(__name__)

CONFIGMAP = "gpuboot-reservations"
DATA_KEY = "reservations.json"
UNAVAILABLE_KEY = "unavailable.json"


class LedgerConflict(Exception):
    """The ledger changed since it was read: re-read, re-place, commit again."""


@dataclass(frozen=True)
class LedgerState:
    """Everything in the ledger (expired entries included) and the version it was read at."""

    reservations: tuple[Reservation, ...]
    unavailable: tuple[Unavailable, ...]
    version: str | None        # None: no ledger yet

    def others(self, job_id: str, now: float) -> list[Reservation]:
        """Live reservations of every other job: what a placement of `job_id` must count."""
        return [r for r in self.reservations if r.job_id != job_id and r.expires_at > now]

    def live_unavailable(self, now: float) -> list[Unavailable]:
        return [u for u in self.unavailable if u.expires_at > now]


class ReservationLedger:
    """Live reservations of every job, in ConfigMap `gpuboot-reservations` of `namespace`."""

    def __init__(self, kube: KubeClient, namespace: str = "default", name: str = CONFIGMAP,
                 clock: Callable[[], float] = time.time) -> None:
        self.kube, self.namespace, self.name, self.clock = kube, namespace, name, clock

    def snapshot(self) -> LedgerState:
        cm = self.kube.read_configmap(self.namespace, self.name)
        if cm is None:
            return LedgerState((), (), None)
        data = cm.get("data") or {}
        return LedgerState(tuple(Reservation.from_json(d) for d in json.loads(data.get(DATA_KEY) or "[]")),
                           tuple(Unavailable.from_json(d) for d in json.loads(data.get(UNAVAILABLE_KEY) or "[]")),
                           cm["metadata"]["resourceVersion"])

    def read(self) -> tuple[list[Reservation], str | None]:
        """All reservations (expired ones included) and the version they were read at (None: no ledger yet)."""
        state = self.snapshot()
        return list(state.reservations), state.version

    def live(self, now: float | None = None) -> list[Reservation]:
        now = self.clock() if now is None else now
        return [r for r in self.read()[0] if r.expires_at > now]

    def live_unavailable(self, now: float | None = None) -> list[Unavailable]:
        return self.snapshot().live_unavailable(self.clock() if now is None else now)

    def commit(self, job_id: str, reservations: Iterable[Reservation], expected_version: str | None,
               unavailable: Iterable[Unavailable] = ()) -> None:
        """Replace `job_id`'s entries with `reservations` and add the `unavailable` marks, in one
        write, only if the ledger is still at `expected_version` (the version the placement was
        computed from); else LedgerConflict."""
        new = list(reservations)
        if any(r.job_id != job_id for r in new):
            raise ValueError(f"commit for job {job_id!r} got reservations of another job")
        state = self.snapshot()
        if state.version != expected_version:
            raise LedgerConflict(f"ledger moved from version {expected_version} to {state.version}")
        self._write([r for r in state.reservations if r.job_id != job_id] + new,
                    _merge(state.unavailable, unavailable), state.version)

    def release(self, job_id: str, attempts: int = 20) -> list[Reservation]:
        """Remove every entry of `job_id` (idempotent); returns what was removed."""
        for _ in range(attempts):
            state = self.snapshot()
            mine = [r for r in state.reservations if r.job_id == job_id]
            if not mine:
                return []
            try:
                self._write([r for r in state.reservations if r.job_id != job_id], state.unavailable, state.version)
                return mine
            except LedgerConflict:
                continue
        raise LedgerConflict(f"could not release job {job_id} after {attempts} conflicting writes")

    def mark_unavailable(self, marks: Iterable[Unavailable], attempts: int = 20) -> None:
        """Add (or renew) insufficient-capacity marks, retrying through conflicts."""
        marks = list(marks)
        for _ in range(attempts):
            state = self.snapshot()
            try:
                self._write(list(state.reservations), _merge(state.unavailable, marks), state.version)
                return
            except LedgerConflict:
                continue
        raise LedgerConflict(f"could not record {len(marks)} unavailable mark(s) after {attempts} conflicting writes")

    def _write(self, entries: list[Reservation], unavailable: Iterable[Unavailable], version: str | None) -> None:
        now = self.clock()
        kept = sorted((r for r in entries if r.expires_at > now), key=lambda r: (r.job_id, r.task))
        marks = sorted((u for u in unavailable if u.expires_at > now), key=lambda u: u.what)
        data = {DATA_KEY: json.dumps([r.to_json() for r in kept], sort_keys=True)}
        if marks:
            data[UNAVAILABLE_KEY] = json.dumps([u.to_json() for u in marks], sort_keys=True)
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/managed-by": "gpuboot"}},
                "data": data}
        try:
            if version is None:
                self.kube.create_configmap(self.namespace, body)
            else:
                body["metadata"]["resourceVersion"] = version
                self.kube.replace_configmap(self.namespace, body)
        except Conflict as exc:
            raise LedgerConflict(str(exc)) from None


def _merge(current: Iterable[Unavailable], added: Iterable[Unavailable]) -> list[Unavailable]:
    """One mark per offering or node: a new mark replaces (renews) the old one."""
    by_what = {u.what: u for u in current}
    by_what.update((u.what, u) for u in added)
    return list(by_what.values())

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

And one record per job (key `jobs.json`, `JobRecord`): the instances the job started
(written *before* StartInstances is called, so a worker killed right after the call still
left the record) and the nodes that failed for it. Every later try and every step of the
job reads it from here, not from an XCom of an earlier try: that is what lets a retry stop
a node an earlier try started, and never wait again on a node that already failed for it.

Lifetime. The TTL of an entry exists only for crashed runs. A live run keeps what it holds
with `renew` (compare-and-swap like every write): each step extends the job's reservations
and record to cover its own longest wait plus the launch before it starts waiting, so an
entry of a live run cannot expire under it (see `gpuboot.booking.reservation_ttl`).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from gpuboot.model import Reservation
from gpuboot.kube import Conflict, KubeClient
from gpuboot.model import Unavailable


CONFIGMAP = "gpuboot-reservations"
DATA_KEY = "reservations.json"
UNAVAILABLE_KEY = "unavailable.json"
JOBS_KEY = "jobs.json"


class LedgerConflict(Exception):
    """The ledger changed since it was read: re-read, re-place, commit again."""


@dataclass(frozen=True)
class StartedNode:
    """An instance a job asked ECS to start: when, and the node's bootID and resourceVersion
    read before that (a later try's readiness watch resumes from it and sees the whole boot)."""

    node: str
    instance_id: str
    at: float
    boot_id_before: str | None = None
    resource_version_before: str | None = None

    def to_json(self) -> dict:
        return {"node": self.node, "instance_id": self.instance_id, "at": self.at,
                "boot_id_before": self.boot_id_before, "resource_version_before": self.resource_version_before}

    @classmethod
    def from_json(cls, d: dict) -> "StartedNode":
        return cls(node=d["node"], instance_id=d["instance_id"], at=float(d["at"]),
                   boot_id_before=d.get("boot_id_before"), resource_version_before=d.get("resource_version_before"))


@dataclass(frozen=True)
class JobRecord:
    """What one job did, seen by every try and step: instances it started, nodes that failed for it."""

    job_id: str
    expires_at: float
    started: tuple[StartedNode, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()     # (node, why), this job's own verdicts

    def started_on(self, node: str) -> StartedNode | None:
        return next((s for s in self.started if s.node == node), None)

    @property
    def failed_nodes(self) -> dict[str, str]:
        return dict(self.failed)

    def with_started(self, entries: Iterable[StartedNode]) -> "JobRecord":
        """The first start of a node is the one kept (its time and bootID are the baseline)."""
        known = {s.node for s in self.started}
        added = tuple(s for s in entries if s.node not in known)
        return replace(self, started=self.started + added)

    def with_failed(self, bad: dict[str, str]) -> "JobRecord":
        merged = {**self.failed_nodes, **bad}
        return replace(self, failed=tuple(sorted(merged.items())))

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "expires_at": self.expires_at,
                "started": [s.to_json() for s in self.started], "failed": [list(f) for f in self.failed]}

    @classmethod
    def from_json(cls, d: dict) -> "JobRecord":
        return cls(job_id=d["job_id"], expires_at=float(d["expires_at"]),
                   started=tuple(StartedNode.from_json(s) for s in d.get("started") or ()),
                   failed=tuple((str(n), str(w)) for n, w in d.get("failed") or ()))


@dataclass(frozen=True)
class LedgerState:
    """Everything in the ledger (expired entries included) and the version it was read at."""

    reservations: tuple[Reservation, ...]
    unavailable: tuple[Unavailable, ...]
    version: str | None        # None: no ledger yet
    jobs: tuple[JobRecord, ...] = field(default=())

    def record(self, job_id: str, now: float) -> JobRecord | None:
        """The job's live record (None: it has none, or it expired with the crashed run)."""
        return next((j for j in self.jobs if j.job_id == job_id and j.expires_at > now), None)

    def held(self, job_id: str, now: float) -> list[Reservation]:
        return [r for r in self.reservations if r.job_id == job_id and r.expires_at > now]

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
                           cm["metadata"]["resourceVersion"],
                           tuple(JobRecord.from_json(d) for d in json.loads(data.get(JOBS_KEY) or "[]")))

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
               unavailable: Iterable[Unavailable] = (), record: JobRecord | None = None,
               drop_unavailable: Iterable[Unavailable] = ()) -> None:
        """Replace `job_id`'s entries with `reservations` (and its record with `record`, when
        given), add the `unavailable` marks and remove `drop_unavailable`, in one write, only if
        the ledger is still at `expected_version` (the version the placement was computed
        from); else LedgerConflict."""
        new = list(reservations)
        if any(r.job_id != job_id for r in new) or (record is not None and record.job_id != job_id):
            raise ValueError(f"commit for job {job_id!r} got entries of another job")
        state = self.snapshot()
        if state.version != expected_version:
            raise LedgerConflict(f"ledger moved from version {expected_version} to {state.version}")
        jobs = list(state.jobs) if record is None else [j for j in state.jobs if j.job_id != job_id] + [record]
        self._write([r for r in state.reservations if r.job_id != job_id] + new,
                    _merge(_without(state.unavailable, drop_unavailable), unavailable), state.version, jobs)

    def update(self, change: Callable[[LedgerState], tuple[list[Reservation], list[Unavailable],
                                                            list[JobRecord]] | None],
               what: str, attempts: int = 20) -> LedgerState | None:
        """Read-modify-write through conflicts: `change(state)` returns the new entries (or None:
        nothing to write). Returns the state the write was guarded by (None: nothing written)."""
        for _ in range(attempts):
            state = self.snapshot()
            new = change(state)
            if new is None:
                return None
            try:
                self._write(new[0], new[1], state.version, new[2])
                return state
            except LedgerConflict:
                continue
        raise LedgerConflict(f"could not {what} after {attempts} conflicting writes")

    def renew(self, job_id: str, until: float) -> list[Reservation]:
        """Extend the job's live reservations and record to at least `until` (never shortens).
        Returns the reservations it holds; [] means it holds nothing (they expired or went)."""
        now = self.clock()
        held: list[Reservation] = []

        def change(state: LedgerState):
            held[:] = state.held(job_id, now)
            rec = state.record(job_id, now)
            if all(r.expires_at >= until for r in held) and (rec is None or rec.expires_at >= until):
                return None
            res = [replace(r, expires_at=max(r.expires_at, until)) if r in held else r for r in state.reservations]
            jobs = [replace(j, expires_at=max(j.expires_at, until)) if j is rec else j for j in state.jobs]
            return res, list(state.unavailable), jobs

        self.update(change, f"renew job {job_id}")
        return [replace(r, expires_at=max(r.expires_at, until)) for r in held]

    def record_starts(self, job_id: str, started: Iterable[StartedNode], until: float) -> JobRecord:
        """Add instances the job is about to start to its record (write-ahead: before StartInstances)."""
        started = list(started)
        out: list[JobRecord] = []

        def change(state: LedgerState):
            now = self.clock()
            lasts = max([until, *(r.expires_at for r in state.held(job_id, now))])   # as long as what it holds
            rec = state.record(job_id, now) or JobRecord(job_id, lasts)
            rec = replace(rec.with_started(started), expires_at=max(rec.expires_at, lasts))
            out[:] = [rec]
            return list(state.reservations), list(state.unavailable), _put(state.jobs, rec)

        self.update(change, f"record the starts of job {job_id}")
        return out[0]

    def drop_unavailable(self, marks: Iterable[Unavailable]) -> None:
        """Remove these exact marks (a mark renewed or replaced since is kept)."""
        marks = list(marks)

        def change(state: LedgerState):
            kept = _without(state.unavailable, marks)
            if len(kept) == len(state.unavailable):
                return None
            return list(state.reservations), kept, list(state.jobs)

        self.update(change, f"drop {len(marks)} unavailable mark(s)")

    def release(self, job_id: str, attempts: int = 20) -> list[Reservation]:
        """Remove every entry of `job_id`, its record included (idempotent); returns the
        reservations that were removed."""
        for _ in range(attempts):
            state = self.snapshot()
            mine = [r for r in state.reservations if r.job_id == job_id]
            jobs = [j for j in state.jobs if j.job_id != job_id]
            if not mine and len(jobs) == len(state.jobs):
                return []
            try:
                self._write([r for r in state.reservations if r.job_id != job_id], state.unavailable,
                            state.version, jobs)
                return mine
            except LedgerConflict:
                continue
        raise LedgerConflict(f"could not release job {job_id} after {attempts} conflicting writes")

    def _write(self, entries: list[Reservation], unavailable: Iterable[Unavailable], version: str | None,
               jobs: Iterable[JobRecord] | None = None) -> None:
        """Write the whole ledger at `version`. `jobs` None keeps the records as they were read
        (only for callers that read them in the same snapshot: the CAS refuses any other)."""
        now = self.clock()
        if jobs is None:
            jobs = self.snapshot().jobs if version is not None else ()
        kept = sorted((r for r in entries if r.expires_at > now), key=lambda r: (r.job_id, r.task))
        marks = sorted((u for u in unavailable if u.expires_at > now), key=lambda u: u.what)
        records = sorted((j for j in jobs if j.expires_at > now), key=lambda j: j.job_id)
        data = {DATA_KEY: json.dumps([r.to_json() for r in kept], sort_keys=True)}
        if marks:
            data[UNAVAILABLE_KEY] = json.dumps([u.to_json() for u in marks], sort_keys=True)
        if records:
            data[JOBS_KEY] = json.dumps([j.to_json() for j in records], sort_keys=True)
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


def _put(jobs: Iterable[JobRecord], record: JobRecord) -> list[JobRecord]:
    return [j for j in jobs if j.job_id != record.job_id] + [record]


def _without(current: Iterable[Unavailable], dropped: Iterable[Unavailable]) -> list[Unavailable]:
    gone = set(dropped)
    return [u for u in current if u not in gone]


def _merge(current: Iterable[Unavailable], added: Iterable[Unavailable]) -> list[Unavailable]:
    """One mark per offering or node: a new mark replaces (renews) the old one."""
    by_what = {u.what: u for u in current}
    by_what.update((u.what, u) for u in added)
    return list(by_what.values())

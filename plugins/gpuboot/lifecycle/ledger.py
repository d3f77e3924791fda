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

Tombstones and the write counter (key `meta.json`). Every write bumps `seq`, a counter of the
ledger's own writes (not the opaque resourceVersion), and leaves a tombstone for each live
reservation it removes (a release, a re-placement, a job giving up), stamped with that write's
seq and kept TOMBSTONE_SECONDS. A placer that re-places against a cluster survey read after
ledger seq s counts the tombstones with seq > s as still reserved (their pods may have been
bound after its pod listing): see `gpuboot.lifecycle.booking.Booker` for the safety argument. When a
tombstone is pruned the ledger raises `tombstones_from` past its seq, so a placer whose survey
predates a pruned tombstone knows it and reads the cluster again: the safety does not rest on
clocks agreeing.

Size. A ConfigMap holds at most 1 MiB: every write prunes what expired (reservations, marks,
records, tombstones) and a write that would still be larger than MAX_LEDGER_BYTES is refused
with `LedgerFull`, which says what fills it; nothing is ever truncated silently.

Lifetime. The TTL of an entry exists only for crashed runs. A live run keeps what it holds
with `renew` (compare-and-swap like every write): each step extends the job's reservations
and record to cover its own longest wait plus the launch before it starts waiting, so an
entry of a live run cannot expire under it (see `gpuboot.lifecycle.booking.reservation_ttl`).
"""
from __future__ import annotations

import json
import random
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from gpuboot.core.model import ANNOTATION_LEDGER, Reservation, Unavailable, ledger_of
from gpuboot.core.resources import Resources
from gpuboot.exceptions import LedgerConflict, LedgerFull, SecondLedger
from gpuboot.hooks.kube import Conflict, KubeClient

CONFIGMAP = "gpuboot-reservations"
DATA_KEY = "reservations.json"
UNAVAILABLE_KEY = "unavailable.json"
JOBS_KEY = "jobs.json"
TOMBSTONES_KEY = "tombstones.json"
META_KEY = "meta.json"
BATCH_KEY = "batch.json"
TOMBSTONE_SECONDS = 120         # longer than any survey a placer re-places against (booking.SURVEY_MAX_AGE_SECONDS)
MAX_LEDGER_BYTES = 1_000_000    # the API server refuses a ConfigMap over 1 MiB (data + metadata)


WRITE_CONTENDED_SECONDS = 30    # a read-modify-write (renew, release, marks) retries conflicts at least this long


def write_attempts(attempts: int):
    """Attempt numbers for a read-modify-write: at least `attempts`, and for WRITE_CONTENDED_SECONDS
    (a burst of placements keeps the ledger changing; a release must not fail for that)."""
    give_up = time.monotonic() + WRITE_CONTENDED_SECONDS
    attempt = 0
    while attempt < attempts or time.monotonic() < give_up:
        yield attempt
        attempt += 1


def backoff(attempt: int, base: float = 0.02, cap: float = 1.0, rng: random.Random | None = None) -> float:
    """Seconds to wait after the `attempt`-th conflict in a row: full jitter, capped exponential
    (so writers that collided spread out instead of colliding again in lockstep)."""
    return (rng or random).uniform(0, min(cap, base * 2 ** min(attempt, 16)))


@dataclass(frozen=True)
class Tombstone:
    """A reservation a write removed (`seq`: that write's), kept TOMBSTONE_SECONDS for placers
    whose cluster survey predates it (gpuboot.lifecycle.booking)."""

    job_id: str
    task: str
    node: str
    resources: Resources
    seq: int
    expires_at: float

    def as_reservation(self) -> Reservation:
        return Reservation(self.job_id, self.task, self.node, self.resources, float("inf"))

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "task": self.task, "node": self.node,
                "resources": self.resources.to_json(), "seq": self.seq, "expires_at": self.expires_at}

    @classmethod
    def from_json(cls, d: dict) -> Tombstone:
        return cls(d["job_id"], d["task"], d["node"], Resources.from_json(d["resources"]), int(d["seq"]),
                   float(d["expires_at"]))


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
    def from_json(cls, d: dict) -> StartedNode:
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

    def with_started(self, entries: Iterable[StartedNode]) -> JobRecord:
        """The first start of a node is the one kept (its time and bootID are the baseline)."""
        known = {s.node for s in self.started}
        added = tuple(s for s in entries if s.node not in known)
        return replace(self, started=self.started + added)

    def with_failed(self, bad: dict[str, str]) -> JobRecord:
        merged = {**self.failed_nodes, **bad}
        return replace(self, failed=tuple(sorted(merged.items())))

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "expires_at": self.expires_at,
                "started": [s.to_json() for s in self.started], "failed": [list(f) for f in self.failed]}

    @classmethod
    def from_json(cls, d: dict) -> JobRecord:
        return cls(job_id=d["job_id"], expires_at=float(d["expires_at"]),
                   started=tuple(StartedNode.from_json(s) for s in d.get("started") or ()),
                   failed=tuple((str(n), str(w)) for n, w in d.get("failed") or ()))


@dataclass(frozen=True)
class Queued:
    """A first placement waiting for a batch (gpuboot.lifecycle.batching): the job's placement request only
    (resources and constraints, never its command or env), its reservation TTL, and `ticket`, which
    names this wait so a decision is matched to the wait that asked for it."""

    job_id: str
    ticket: str
    request: dict
    ttl: float
    expires_at: float

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "ticket": self.ticket, "request": self.request, "ttl": self.ttl,
                "expires_at": self.expires_at}

    @classmethod
    def from_json(cls, d: dict) -> Queued:
        return cls(d["job_id"], d["ticket"], d["request"], float(d["ttl"]), float(d["expires_at"]))


@dataclass(frozen=True)
class Decided:
    """A batch's answer to one `Queued` wait: the plan (JSON; the job's reservations, when it fits,
    went into the same write) and who decided it."""

    job_id: str
    ticket: str
    plan: dict
    by: str
    expires_at: float

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "ticket": self.ticket, "plan": self.plan, "by": self.by,
                "expires_at": self.expires_at}

    @classmethod
    def from_json(cls, d: dict) -> Decided:
        return cls(d["job_id"], d["ticket"], d["plan"], d["by"], float(d["expires_at"]))


@dataclass(frozen=True)
class Batch:
    """The group-commit state in the ledger (key `batch.json`): answers not yet read and the lease
    of the one placer surveying the cluster for every queued request (the queue itself is sharded
    over its own ConfigMaps, `RequestQueue`, so that a burst queueing does not contend here)."""

    decided: tuple[Decided, ...] = ()
    leader: str | None = None
    lease_until: float = 0.0

    def live(self, now: float) -> Batch:
        """Without what expired (compaction)."""
        leader = self.led_by(now)
        return Batch(tuple(d for d in self.decided if d.expires_at > now), leader, self.lease_until if leader else 0.0)

    def led_by(self, now: float) -> str | None:
        return self.leader if self.lease_until > now else None

    def answer(self, ticket: str) -> Decided | None:
        return next((d for d in self.decided if d.ticket == ticket), None)

    def to_json(self) -> dict:
        return {"decided": [d.to_json() for d in self.decided], "leader": self.leader, "lease_until": self.lease_until}

    @classmethod
    def from_json(cls, d: dict) -> Batch:
        return cls(tuple(Decided.from_json(x) for x in d.get("decided", ())), d.get("leader"),
                   float(d.get("lease_until") or 0.0))


@dataclass(frozen=True)
class LedgerState:
    """Everything in the ledger (expired entries included) and the version it was read at."""

    reservations: tuple[Reservation, ...]
    unavailable: tuple[Unavailable, ...]
    version: str | None        # None: no ledger yet
    jobs: tuple[JobRecord, ...] = field(default=())
    seq: int = 0               # writes so far (the ledger's own counter)
    tombstones: tuple[Tombstone, ...] = field(default=())
    tombstones_from: int = 0   # every tombstone with seq > this is still here (older ones may be pruned)
    batch: Batch = field(default=Batch())

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

    def released_since(self, seq: int, job_id: str) -> list[Reservation] | None:
        """Reservations of other jobs removed by writes after `seq`, as reservations to count (see
        gpuboot.lifecycle.booking); None when some of them may have been pruned (read the cluster again)."""
        if self.tombstones_from > seq or self.seq < seq:
            return None
        return [t.as_reservation() for t in self.tombstones if t.seq > seq and t.job_id != job_id]


class ReservationLedger:
    """Live reservations of every job, in ConfigMap `gpuboot-reservations` of `namespace`."""

    def __init__(self, kube: KubeClient, namespace: str = "default", name: str = CONFIGMAP,
                 clock: Callable[[], float] = time.time) -> None:
        self.kube, self.namespace, self.name, self.clock = kube, namespace, name, clock

    @property
    def identity(self) -> str:
        return f"{self.namespace}/{self.name}"

    def claim_nodes(self, nodes: Iterable[dict]) -> None:
        """Before a booking on them: mark each Node as booked through this ledger (ANNOTATION_LEDGER, first
        come, a compare-and-swap on the Node), or raise SecondLedger when one names another: its bookings
        are in a ledger this one never reads (issue 35 #3)."""
        for seen in nodes:
            node, name = seen, seen["metadata"]["name"]
            while ledger_of(node) != self.identity:
                owner = ledger_of(node)
                if owner is not None:
                    raise SecondLedger(
                        f"node {name} is booked through ledger {owner}, this deployment's is {self.identity}: two "
                        f"gpuboot deployments with different ledgers on the same nodes would promise the same GPUs "
                        f"twice, and one's scale-down would stop a node the other booked. Nothing was booked. Give "
                        f"every deployment on these nodes the same ledger_namespace, or keep their nodes apart "
                        f"(node_selector); a node moved for good: kubectl annotate node {name} {ANNOTATION_LEDGER}-")
                try:
                    self.kube.merge_patch_node(name, {"metadata": {"annotations": {ANNOTATION_LEDGER: self.identity},
                                                                   "resourceVersion": node["metadata"].get("resourceVersion")}})
                    break
                except Conflict:        # the Node changed since it was read (perhaps claimed): read it again
                    node = self.kube.get_node(name)

    def snapshot(self) -> LedgerState:
        cm = self.kube.read_configmap(self.namespace, self.name)
        if cm is None:
            return LedgerState((), (), None)
        data = cm.get("data") or {}
        meta = json.loads(data.get(META_KEY) or "{}")
        return LedgerState(tuple(Reservation.from_json(d) for d in json.loads(data.get(DATA_KEY) or "[]")),
                           tuple(Unavailable.from_json(d) for d in json.loads(data.get(UNAVAILABLE_KEY) or "[]")),
                           cm["metadata"]["resourceVersion"],
                           tuple(JobRecord.from_json(d) for d in json.loads(data.get(JOBS_KEY) or "[]")),
                           int(meta.get("seq", 0)),
                           tuple(Tombstone.from_json(d) for d in json.loads(data.get(TOMBSTONES_KEY) or "[]")),
                           int(meta.get("tombstones_from", 0)),
                           Batch.from_json(json.loads(data.get(BATCH_KEY) or "{}")))

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
               drop_unavailable: Iterable[Unavailable] = (), state: LedgerState | None = None) -> None:
        """Replace `job_id`'s entries with `reservations` (and its record with `record`, when
        given), add the `unavailable` marks and remove `drop_unavailable`, in one write, only if
        the ledger is still at `expected_version` (the version the placement was computed
        from); else LedgerConflict. `state`: the ledger as read at that version (spares a read;
        the write's compare-and-swap still refuses it if the ledger moved since)."""
        new = list(reservations)
        if any(r.job_id != job_id for r in new) or (record is not None and record.job_id != job_id):
            raise ValueError(f"commit for job {job_id!r} got entries of another job")
        if state is None or state.version != expected_version:
            state = self.snapshot()
        if state.version != expected_version:
            raise LedgerConflict(f"ledger moved from version {expected_version} to {state.version}")
        jobs = list(state.jobs) if record is None else [j for j in state.jobs if j.job_id != job_id] + [record]
        self._write([r for r in state.reservations if r.job_id != job_id] + new,
                    _merge(_without(state.unavailable, drop_unavailable), unavailable), state, jobs)

    def update(self, change: Callable[[LedgerState], tuple | None],
               what: str, attempts: int = 20) -> LedgerState | None:
        """Read-modify-write through conflicts: `change(state)` returns the new entries, as
        (reservations, unavailable, records) or with the batch state fourth (or None: nothing to
        write). Returns the state the write was guarded by (None: nothing written)."""
        for attempt in write_attempts(attempts):
            state = self.snapshot()
            new = change(state)
            if new is None:
                return None
            try:
                self._write(new[0], new[1], state, new[2], batch=new[3] if len(new) > 3 else None)
                return state
            except LedgerConflict:
                time.sleep(backoff(attempt))
                continue
        raise LedgerConflict(f"could not {what}: every write conflicted for {WRITE_CONTENDED_SECONDS} s")

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
        for attempt in write_attempts(attempts):
            state = self.snapshot()
            mine = [r for r in state.reservations if r.job_id == job_id]
            jobs = [j for j in state.jobs if j.job_id != job_id]
            if not mine and len(jobs) == len(state.jobs):
                return []
            try:
                self._write([r for r in state.reservations if r.job_id != job_id], state.unavailable,
                            state, jobs)
                return mine
            except LedgerConflict:
                time.sleep(backoff(attempt))
                continue
        raise LedgerConflict(f"could not release job {job_id}: every write conflicted for {WRITE_CONTENDED_SECONDS} s")

    def _write(self, entries: list[Reservation], unavailable: Iterable[Unavailable], prev: LedgerState,
               jobs: Iterable[JobRecord], batch: Batch | None = None) -> None:
        """Write the whole ledger over `prev` (compare-and-swap on its version), compacted: what
        expired is pruned, each live reservation of `prev` that `entries` drops leaves a tombstone.
        `batch`: the new group-commit state (None: `prev`'s, kept)."""
        now = self.clock()
        data, _ = ledger_data(prev, entries, unavailable, jobs, now, batch)
        size = len(json.dumps(data).encode())
        if size > MAX_LEDGER_BYTES:
            parts = ", ".join(f"{len(json.loads(data[k]))} {what} ({len(data[k].encode()):,} bytes)"
                              for k, what in ((DATA_KEY, "reservations"), (JOBS_KEY, "job records"),
                                              (UNAVAILABLE_KEY, "unavailable marks"), (TOMBSTONES_KEY, "tombstones"))
                              if k in data)
            if BATCH_KEY in data:
                parts += (f", {len(json.loads(data[BATCH_KEY])['decided'])} batch answers "
                          f"({len(data[BATCH_KEY].encode()):,} bytes)")
            raise LedgerFull(
                f"ledger ConfigMap {self.namespace}/{self.name} would be {size:,} bytes, over the "
                f"{MAX_LEDGER_BYTES:,}-byte limit of a ConfigMap (1 MiB) even with expired entries pruned: {parts}. "
                f"The write was refused and nothing changed: too many jobs hold reservations or records in "
                f"this ledger at once; let some finish, or give groups of jobs their own ledger_namespace")
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/managed-by": "gpuboot"}},
                "data": data}
        try:
            if prev.version is None:
                self.kube.create_configmap(self.namespace, body)
            else:
                body["metadata"]["resourceVersion"] = prev.version
                self.kube.replace_configmap(self.namespace, body)
        except Conflict as exc:
            raise LedgerConflict(str(exc)) from None


def _key(r: Reservation) -> tuple[str, str, str]:
    return r.job_id, r.task, r.node


def ledger_data(prev: LedgerState, entries: Iterable[Reservation], unavailable: Iterable[Unavailable],
                jobs: Iterable[JobRecord], now: float, batch: Batch | None = None) -> tuple[dict[str, str], int]:
    """The ConfigMap data of the write after `prev` (pure), and that write's seq.

    Compaction: expired reservations, marks, records and tombstones are dropped (the seq of the
    newest tombstone dropped raises `tombstones_from`, see the module doc); a live reservation of
    `prev` that `entries` no longer has (same job, task and node) leaves a tombstone."""
    seq = prev.seq + 1
    kept = sorted((r for r in entries if r.expires_at > now), key=lambda r: (r.job_id, r.task))
    still = {_key(r) for r in kept}
    removed = [Tombstone(r.job_id, r.task, r.node, r.resources, seq, now + TOMBSTONE_SECONDS)
               for r in prev.reservations if r.expires_at > now and _key(r) not in still]
    tombstones, floor = [], prev.tombstones_from
    for t in (*prev.tombstones, *removed):
        if t.expires_at > now:
            tombstones.append(t)
        else:
            floor = max(floor, t.seq)
    tombstones.sort(key=lambda t: (t.seq, t.job_id, t.task))
    marks = sorted((u for u in unavailable if u.expires_at > now), key=lambda u: u.what)
    records = sorted((j for j in jobs if j.expires_at > now), key=lambda j: j.job_id)
    data = {DATA_KEY: json.dumps([r.to_json() for r in kept], sort_keys=True),
            META_KEY: json.dumps({"seq": seq, "tombstones_from": floor}, sort_keys=True)}
    if marks:
        data[UNAVAILABLE_KEY] = json.dumps([u.to_json() for u in marks], sort_keys=True)
    if records:
        data[JOBS_KEY] = json.dumps([j.to_json() for j in records], sort_keys=True)
    if tombstones:
        data[TOMBSTONES_KEY] = json.dumps([t.to_json() for t in tombstones], sort_keys=True)
    batch = (prev.batch if batch is None else batch).live(now)
    if batch.decided or batch.leader:
        data[BATCH_KEY] = json.dumps(batch.to_json(), sort_keys=True)
    return data, seq


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


QUEUE_KEY = "queue.json"
QUEUE_SHARDS = 8    # ConfigMaps the batch queue is spread over: a burst's appends rarely collide


class RequestQueue:
    """First placements waiting for a batch (gpuboot.lifecycle.batching), spread over QUEUE_SHARDS
    ConfigMaps named after the ledger (`<ledger>-queue-<i>`, so RBAC can name every one). A
    waiter appends to the shard its ticket hashes to (compare-and-swap on that shard only);
    the batch leader reads every shard. Entries expire; answers live in the ledger, so the
    queue is only ever a hint of who is waiting: losing an entry delays a job, never double-books."""

    def __init__(self, kube: KubeClient, namespace: str = "default", ledger: str = CONFIGMAP,
                 clock: Callable[[], float] = time.time) -> None:
        self.kube, self.namespace, self.clock = kube, namespace, clock
        self.shards = [f"{ledger}-queue-{i}" for i in range(QUEUE_SHARDS)]

    def shard_of(self, ticket: str) -> str:
        return self.shards[zlib.crc32(ticket.encode()) % len(self.shards)]

    def _read(self, name: str) -> tuple[list[Queued], str | None]:
        cm = self.kube.read_configmap(self.namespace, name)
        if cm is None:
            return [], None
        return ([Queued.from_json(d) for d in json.loads((cm.get("data") or {}).get(QUEUE_KEY) or "[]")],
                cm["metadata"]["resourceVersion"])

    def _change(self, name: str, change: Callable[[list[Queued]], list[Queued]]) -> None:
        """One compare-and-swap on shard `name` (LedgerConflict when it moved; the caller retries)."""
        entries, version = self._read(name)
        now = self.clock()
        new = [q for q in change(entries) if q.expires_at > now]
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/managed-by": "gpuboot"}},
                "data": {QUEUE_KEY: json.dumps([q.to_json() for q in new], sort_keys=True)}}
        try:
            if version is None:
                self.kube.create_configmap(self.namespace, body)
            else:
                body["metadata"]["resourceVersion"] = version
                self.kube.replace_configmap(self.namespace, body)
        except Conflict as exc:
            raise LedgerConflict(str(exc)) from None

    def add(self, entry: Queued) -> None:
        self._change(self.shard_of(entry.ticket), lambda qs: [q for q in qs if q.ticket != entry.ticket] + [entry])

    def holds(self, ticket: str) -> bool:
        return any(q.ticket == ticket and q.expires_at > self.clock() for q in self._read(self.shard_of(ticket))[0])

    def drop(self, tickets: Iterable[str], attempts: int = 5) -> None:
        """Take requests out of their shards, answered ones or a withdrawn wait (best effort: what
        stays expires, and a leader never places an answered ticket again)."""
        by_shard: dict[str, set[str]] = {}
        for t in tickets:
            by_shard.setdefault(self.shard_of(t), set()).add(t)
        for name, gone in by_shard.items():
            for attempt in range(attempts):
                try:
                    self._change(name, lambda qs: [q for q in qs if q.ticket not in gone])
                    break
                except LedgerConflict:
                    time.sleep(backoff(attempt))

    def waiting(self, answered: Iterable[str] = ()) -> list[Queued]:
        """Every live entry not answered yet, oldest first (queue order)."""
        now, done = self.clock(), set(answered)
        out = [q for name in self.shards for q in self._read(name)[0] if q.expires_at > now and q.ticket not in done]
        return sorted(out, key=lambda q: (q.expires_at, q.ticket))

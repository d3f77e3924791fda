"""The reservation ledger: capacity promised to jobs, kept in ConfigMaps sharded by node.

Why ConfigMaps: the API server's resourceVersion gives compare-and-swap on one object for
free. Every write is read-modify-write guarded by the version that was read; a 409 means
someone else wrote first and the caller re-reads and re-places. Entries carry an expiry so a
crashed run leaks nothing, and expired entries are pruned on every write.

Layout (format 2). One ConfigMap cannot hold 5,000 jobs (a reservation is ~220 bytes, a job
record 130-320, a tombstone ~230: format 1, everything in one object, filled 1 MiB near 2,000
jobs), and one object makes every placement conflict with every other. So:
- the root `gpuboot-reservations` holds the format and the shard count (`meta.json`), the
  offering marks (`unavailable.json`: offerings out of stock) and the group-commit state
  (`batch.json`, gpuboot.lifecycle.batching);
- shard `gpuboot-reservations-<k>` (k < SHARDS) holds the reservations, tombstones and node
  marks of the nodes whose name hashes to k, and the records of the jobs whose id hashes to k,
  with its own write counter `seq`.
A placement reads every object but writes only the shards of the nodes it books (and the job's
record's): two placements on nodes of different shards never conflict. Bookings stay tied to
their nodes: each booked Node names its ledger (`claim_nodes`), so a second ledger on the
same nodes is refused (SecondLedger, issue 35 #3).

The insufficient-capacity cache (`Unavailable`): offerings that ran out of stock (root) and
nodes that failed to boot or are being stopped (the node's shard). A node mark lives in the
same object as the node's reservations, so a placement that commits on a node after a mark
on it was written must have read that mark (the compare-and-swap on that shard guarantees
it), which is what lets a run stop a node it abandons without a race.

One record per job (`JobRecord`): the instances the job started (written *before*
StartInstances is called, so a worker killed right after the call still left the record) and
the nodes that failed for it. Every later try and every step of the job reads it from here,
not from an XCom of an earlier try: that is what lets a retry stop a node an earlier try
started, and never wait again on a node that already failed for it.

Tombstones and the write counters, per shard. Every write of a shard bumps its `seq` and
leaves a tombstone for each live reservation it removes (a release, a re-placement, a job
giving up), stamped with that write's seq and kept TOMBSTONE_SECONDS. A placer that re-places
against a cluster survey read after the ledger at `LedgerState.seq` (opaque: every shard's
seq) counts the tombstones of each shard newer than that shard's seq then as still reserved
(their pods may have been bound after its pod listing): see `gpuboot.lifecycle.booking.Booker`
for the argument, which holds shard by shard since a reservation lives in one shard for its
whole life. When a tombstone is pruned its shard raises `tombstones_from` past its seq, so a
placer whose survey predates a pruned tombstone knows it and reads the cluster again: the
safety does not rest on clocks agreeing.

Commits (`_write`). A write changes the objects whose content changes, each compare-and-swap on
its own version. It first writes the objects that gain something (a reservation, a node mark,
the batch state), each against the version the caller's plan was computed from, shards in
name order and the root last; a conflict on any of them takes back what this write added to
the ones already written, and raises LedgerConflict (the caller re-places). Then the objects
that only lose or renew entries (the job's old reservations, its record, marks dropped) are
re-read and rewritten until done: a removal never needs the version the plan read, and is
safe on its own.
- Why no node is promised twice: every reservation on a node, committed or mid-commit, is in
  that node's shard, and every addition there is a compare-and-swap against the version whose
  reservations the plan counted; the ledger serialises promises node by node as the single
  object did for all of them. A placement's commit compare-and-swaps the shards of the
  reservations it keeps unchanged too (`guard`): a place taken from the job meanwhile (by a
  preemption) fails the commit instead of leaving the job believing it holds it.
- What a reader sees mid-commit: part of the additions (counted as reserved, never as free)
  and the job's old reservations still there; so it counts more than is promised, never less.
  A batch's answers are in the root, written after every reservation they announce.
- A crash mid-commit: when several objects gain reservations, they are written with at most
  PROVISIONAL_SECONDS to live and extended to their full lifetime once all are in; what a
  crashed commit added thus expires within minutes (a crashed taking back likewise), and the
  job's next commit or release replaces or removes it earlier. Nothing is leaked beyond that,
  and no pod can be bound to a reservation its commit never confirmed (the caller creates pods
  only after `commit` returned). A crash after the additions leaves the job's old reservations,
  which its next commit or release removes (or they expire): more held, never less.

Migration (format 1, everything in the root, to format 2), in place on first use by this
version, by any process that reads a format-1 root (`migrate`), in three steps:
1. the root is rewritten (compare-and-swap) with its content unchanged, a migration tag, and a
   `seq` format-1 code cannot parse: from then on a format-1 process refuses to read or write
   the ledger (its error says to upgrade) rather than book without seeing the shards. A
   format-1 write that came first makes this write conflict: the migrator reads it and starts over;
2. each shard is written from the frozen root content, tagged; a shard already tagged is left
   as it is (another migrator did it, and it may be in use already), so several migrators at
   once write the same content once and never overwrite later writes;
3. the root is switched to format 2 (compare-and-swap on the step-1 version).
No reservation is lost: every format-1 write either precedes step 1 (and is in the frozen
content) or conflicts with it and is refused from then on. A reader reads the root before the
shards, so it never takes a half-migrated ledger for the shards.

Size. A ConfigMap holds at most 1 MiB: every write prunes what expired (reservations, marks,
records, tombstones), and a write that would leave an object larger than MAX_OBJECT_BYTES (well
below 1 MiB) is refused with `LedgerFull`, which names the object and says what fills it;
nothing is ever truncated silently.

Lifetime. The TTL of an entry exists only for crashed runs. A live run keeps what it holds
with `renew`: each step extends the job's reservations and record to cover its own longest
wait plus the launch before it starts waiting, so an entry of a live run cannot expire under
it (see `gpuboot.lifecycle.booking.reservation_ttl`). A renewal rewrites only entries still
there: it never brings back a reservation released meanwhile.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import random
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from itertools import chain

from gpuboot.core.model import ANNOTATION_LEDGER, Reservation, Unavailable, ledger_of
from gpuboot.core.resources import Resources
from gpuboot.exceptions import LedgerConflict, LedgerFull, SecondLedger
from gpuboot.hooks.kube import Conflict, KubeClient, Overloaded

log = logging.getLogger(__name__)

CONFIGMAP = "gpuboot-reservations"
DATA_KEY = "reservations.json"
UNAVAILABLE_KEY = "unavailable.json"
JOBS_KEY = "jobs.json"
TOMBSTONES_KEY = "tombstones.json"
META_KEY = "meta.json"
BATCH_KEY = "batch.json"
LABEL_LEDGER = "gpuboot.io/ledger"      # on every object of a ledger: its root's name
TOMBSTONE_SECONDS = 120         # longer than any survey a placer re-places against (booking.SURVEY_MAX_AGE_SECONDS)
MAX_OBJECT_BYTES = 800_000      # refused well before the API server's 1 MiB (data + metadata) per ConfigMap
MAX_LEDGER_BYTES = MAX_OBJECT_BYTES     # the name format 1 used
SHARDS = 64                     # shards of a new ledger (kept in its root; RBAC names each one)
FORMAT = 2
PROVISIONAL_SECONDS = 300       # additions of a commit over several objects live this long until all are in
MIGRATION_ATTEMPTS = 20
PARALLEL = 8                    # ledger objects read or written at once by one call
CLAIMS_PARALLEL = 16            # Nodes claimed at once (`claim_nodes`, `NodeClaims`: a 10,000-node batch claims ~150)
ROOT_SEQ_KEY = "root_seq"       # the root's own write counter (format 2)
MIGRATING_KEY = "migrating"     # the tag of a migration under way (root, steps 1-2)
MIGRATED_FROM_KEY = "migrated_from"     # a shard written by that migration
MIGRATED = ("this ledger is in format 2 (sharded), written by a newer gpuboot: upgrade gpuboot on this "
            "process; it refuses to book rather than miss the bookings in the shards")


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
    alone: bool = False     # the job holds reservations already: its waiter books on the single path

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "ticket": self.ticket, "plan": self.plan, "by": self.by,
                "expires_at": self.expires_at, **({"alone": True} if self.alone else {})}

    @classmethod
    def from_json(cls, d: dict) -> Decided:
        return cls(d["job_id"], d["ticket"], d["plan"], d["by"], float(d["expires_at"]), bool(d.get("alone")))


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

    def same_but_lease(self, other: Batch) -> bool:
        """The same leader and answers, the lease perhaps renewed: what only the leader's own renewal changes."""
        return self.leader == other.leader and self.decided == other.decided

    def answer(self, ticket: str) -> Decided | None:
        return next((d for d in self.decided if d.ticket == ticket), None)

    def to_json(self) -> dict:
        return {"decided": [d.to_json() for d in self.decided], "leader": self.leader, "lease_until": self.lease_until}

    @classmethod
    def from_json(cls, d: dict) -> Batch:
        return cls(tuple(Decided.from_json(x) for x in d.get("decided", ())), d.get("leader"),
                   float(d.get("lease_until") or 0.0))


@dataclass(frozen=True)
class Part:
    """The content of one ledger object (the root, or one shard), as read at one version."""

    reservations: tuple[Reservation, ...] = ()
    unavailable: tuple[Unavailable, ...] = ()
    jobs: tuple[JobRecord, ...] = ()
    tombstones: tuple[Tombstone, ...] = ()
    seq: int = 0               # writes of this object so far (its own counter)
    tombstones_from: int = 0   # every tombstone of this object with seq > this is still here
    batch: Batch = field(default=Batch())
    meta: tuple[tuple[str, object], ...] = ()     # other meta.json keys (format, shards, migration), kept as read

    @classmethod
    def from_data(cls, data: dict) -> Part:
        meta = json.loads(data.get(META_KEY) or "{}")
        seq = meta.pop(ROOT_SEQ_KEY) if ROOT_SEQ_KEY in meta else meta.pop("seq", 0)
        meta.pop("seq", None)
        return cls(tuple(Reservation.from_json(d) for d in json.loads(data.get(DATA_KEY) or "[]")),
                   tuple(Unavailable.from_json(d) for d in json.loads(data.get(UNAVAILABLE_KEY) or "[]")),
                   tuple(JobRecord.from_json(d) for d in json.loads(data.get(JOBS_KEY) or "[]")),
                   tuple(Tombstone.from_json(d) for d in json.loads(data.get(TOMBSTONES_KEY) or "[]")),
                   int(seq or 0), int(meta.pop("tombstones_from", 0)),
                   Batch.from_json(json.loads(data.get(BATCH_KEY) or "{}")), tuple(sorted(meta.items())))

    @property
    def format(self) -> int:
        return int(dict(self.meta).get("format") or 1)


@dataclass(frozen=True)
class LedgerState:
    """The ledger as read: every object's content and version (see the module doc, "Layout"),
    merged into one view (expired entries included). The shards are read on first use (`load`),
    after the root: a waiter polling for its batch answer reads the root only."""

    given_parts: Mapping[str, Part]
    given_versions: Mapping[str, str | None]
    root: str = CONFIGMAP
    load: Callable[[], tuple[dict[str, Part], dict[str, str | None]]] | None = field(
        default=None, compare=False, repr=False)

    @classmethod
    def empty(cls, root: str = CONFIGMAP) -> LedgerState:
        return cls({}, {}, root)

    @cached_property
    def _loaded(self) -> tuple[dict[str, Part], dict[str, str | None]]:
        if self.load is None:
            return dict(self.given_parts), dict(self.given_versions)
        parts, versions = self.load()
        return {**self.given_parts, **parts}, {**self.given_versions, **versions}

    @property
    def parts(self) -> dict[str, Part]:
        return self._loaded[0]

    @property
    def versions(self) -> dict[str, str | None]:
        return self._loaded[1]

    def _all(self, attr: str) -> tuple:
        return tuple(chain.from_iterable(getattr(self.parts[name], attr) for name in sorted(self.parts)))

    @cached_property
    def reservations(self) -> tuple[Reservation, ...]:
        return self._all("reservations")

    @cached_property
    def unavailable(self) -> tuple[Unavailable, ...]:
        return self._all("unavailable")

    @cached_property
    def jobs(self) -> tuple[JobRecord, ...]:
        return self._all("jobs")

    @cached_property
    def tombstones(self) -> tuple[Tombstone, ...]:
        return self._all("tombstones")

    @property
    def batch(self) -> Batch:
        return self.given_parts[self.root].batch if self.root in self.given_parts else Batch()

    @property
    def version(self) -> Versions | None:
        """Opaque: the version of every object read (None: no ledger yet). Pass it back to `commit`."""
        return Versions(tuple(sorted(self.versions.items()))) if self.versions.get(self.root) else None

    @property
    def seq(self) -> Seq:
        """Opaque: every shard's write counter. Pass it back to `released_since`; equal means unchanged."""
        return Seq(tuple(sorted((n, p.seq) for n, p in self.parts.items() if n != self.root)))

    def seq_of(self, shards: Mapping[str, int | None]) -> Seq | None:
        """A `seq` for `released_since` made of a seq per shard (None: some shard has none)."""
        if any(v is None for v in shards.values()):
            return None
        return Seq(tuple(sorted((n, int(v)) for n, v in shards.items() if v is not None)))

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

    def released_since(self, seq: Seq, job_id: str) -> list[Reservation] | None:
        """Reservations of other jobs removed by writes after `seq`, as reservations to count (see
        gpuboot.lifecycle.booking), shard by shard; None when some of them may have been pruned or a
        shard went back (read the cluster again)."""
        then = dict(seq.shards)
        out: list[Reservation] = []
        for name, part in self.parts.items():
            if name == self.root:
                continue
            s = then.get(name, 0)
            if part.tombstones_from > s or part.seq < s:
                return None
            out += [t.as_reservation() for t in part.tombstones if t.seq > s and t.job_id != job_id]
        if any(name not in self.parts for name in then):
            return None
        return out


@dataclass(frozen=True)
class Versions:
    """Opaque to callers: (object, resourceVersion) of every object of one snapshot."""

    objects: tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class Seq:
    """Opaque to callers: (shard, seq) of every shard of one snapshot."""

    shards: tuple[tuple[str, int], ...]


class ReservationLedger:
    """Live reservations of every job: root ConfigMap `gpuboot-reservations` of `namespace` and its
    shards `gpuboot-reservations-<k>` (module doc, "Layout")."""

    def __init__(self, kube: KubeClient, namespace: str = "default", name: str = CONFIGMAP,
                 clock: Callable[[], float] = time.time, shards: int = SHARDS) -> None:
        self.kube, self.namespace, self.name, self.clock, self.shards = kube, namespace, name, clock, shards
        self._cache: dict[str, tuple[str | None, Part]] = {}     # shard -> (version, content) last parsed

    @property
    def identity(self) -> str:
        return f"{self.namespace}/{self.name}"

    def claim_nodes(self, nodes: Iterable[dict]) -> None:
        """Before a booking on them: mark each Node as booked through this ledger (ANNOTATION_LEDGER, first
        come, a compare-and-swap on the Node), or raise SecondLedger when one names another: its bookings
        are in a ledger this one never reads (issue 35 #3). The Nodes as read are checked first, so a
        refusal seen there writes nothing; then the unclaimed ones are claimed CLAIMS_PARALLEL at once (a
        gang's nodes; a batch leader claims as it places, `NodeClaims`: one after the other, a batch's
        ~150 claims on a large fleet took 3.5 s). Each claim is its Node's own compare-and-swap, so
        doing them at once changes nothing any one of them decides; a claim left behind by a refusal met
        later only names this ledger on a Node it did not book, which the serial loop did as well."""
        nodes = list(nodes)
        for node in nodes:
            self._refuse_second(node)
        claims = NodeClaims(self, nodes)
        claims.add(n["metadata"]["name"] for n in nodes)
        claims.wait()

    def claims_as_placed(self, nodes: Sequence[dict]) -> NodeClaims:
        """Claims started while a batch is placed, plan by plan (`NodeClaims`), of these Nodes as read."""
        return NodeClaims(self, nodes)

    def _claim(self, node: dict) -> None:
        """One unclaimed Node (as `claim_nodes` read it) named after this ledger, by compare-and-swap."""
        name = node["metadata"]["name"]
        while True:
            try:
                self.kube.merge_patch_node(name, {"metadata": {"annotations": {ANNOTATION_LEDGER: self.identity},
                                                               "resourceVersion": node["metadata"].get("resourceVersion")}})
                return
            except Conflict:        # the Node changed since it was read (perhaps claimed): read it again
                node = self.kube.get_node(name)
            if ledger_of(node) == self.identity:
                return
            self._refuse_second(node)

    def _refuse_second(self, node: dict) -> None:
        owner, name = ledger_of(node), node["metadata"]["name"]
        if owner is not None and owner != self.identity:
            raise SecondLedger(
                f"node {name} is booked through ledger {owner}, this deployment's is {self.identity}: two "
                f"gpuboot deployments with different ledgers on the same nodes would promise the same GPUs "
                f"twice, and one's scale-down would stop a node the other booked. Nothing was booked. Give "
                f"every deployment on these nodes the same ledger_namespace, or keep their nodes apart "
                f"(node_selector); a node moved for good: kubectl annotate node {name} {ANNOTATION_LEDGER}-")

    # ------------------------------------------------------------------ where entries live
    def shard_names(self, count: int | None = None) -> list[str]:
        return [f"{self.name}-{k}" for k in range(self.shards if count is None else count)]

    def object_of_node(self, node: str, count: int) -> str:
        return _shard(self.name, node, count)

    def object_of_job(self, job_id: str, count: int) -> str:
        return _shard(self.name, "job:" + job_id, count)

    def _split(self, entries: Iterable[Reservation], unavailable: Iterable[Unavailable], jobs: Iterable[JobRecord],
               count: int) -> dict[str, tuple[list, list, list]]:
        """Entries by the object that holds them: a reservation and a node mark with its node's shard, a job
        record with its job's, an offering mark in the root."""
        out: dict[str, tuple[list, list, list]] = {}
        for r in entries:
            out.setdefault(self.object_of_node(r.node, count), ([], [], []))[0].append(r)
        for u in unavailable:
            out.setdefault(self.object_of_node(u.node, count) if u.node else self.name, ([], [], []))[1].append(u)
        for j in jobs:
            out.setdefault(self.object_of_job(j.job_id, count), ([], [], []))[2].append(j)
        return out

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> LedgerState:
        """The root, then every shard (in that order: see "Migration"); migrates a format-1 ledger first."""
        for _ in range(MIGRATION_ATTEMPTS):
            root = self.kube.read_configmap(self.namespace, self.name)
            if root is None:
                return LedgerState.empty(self.name)
            part = Part.from_data(root.get("data") or {})
            if part.format < FORMAT or dict(part.meta).get(MIGRATING_KEY):
                self.migrate(root)
                continue
            names = self.shard_names(int(dict(part.meta)["shards"]))
            return LedgerState({self.name: part}, {self.name: root["metadata"]["resourceVersion"]}, self.name,
                               lambda: self._read_shards(names))
        raise LedgerConflict(f"ledger {self.identity}: its migration to format {FORMAT} kept being interrupted")

    def record_of(self, job_id: str, state: LedgerState, now: float) -> JobRecord | None:
        """The job's live record as `state` would give it, reading only the shard that holds it when `state`
        has not read its shards (a waiter of a burst must not read the whole ledger)."""
        root = state.given_parts.get(self.name)
        if root is None or state.load is None or "_loaded" in state.__dict__ or root.format < FORMAT:
            return state.record(job_id, now)
        name = self.object_of_job(job_id, int(dict(root.meta)["shards"]))
        part = self._parsed(name, self.kube.read_configmap(self.namespace, name))
        return next((j for j in part.jobs if j.job_id == job_id and j.expires_at > now), None)

    def _read_shards(self, names: list[str]) -> tuple[dict[str, Part], dict[str, str | None]]:
        read: dict[str, dict | None] = {}

        def get(name: str) -> None:
            read[name] = self.kube.read_configmap(self.namespace, name)

        _each(get, names, raising=True)
        versions = {n: cm["metadata"]["resourceVersion"] if cm else None for n, cm in read.items()}
        return {n: self._parsed(n, read[n]) for n in names}, versions

    def _parsed(self, name: str, cm: dict | None) -> Part:
        """The shard's content, parsed once per version (a snapshot mostly finds shards unchanged)."""
        version = cm["metadata"]["resourceVersion"] if cm else None
        cached = self._cache.get(name)
        if cached is not None and version is not None and cached[0] == version:
            return cached[1]
        part = Part.from_data((cm or {}).get("data") or {})
        self._cache[name] = (version, part)
        return part

    def sizes(self) -> dict[str, int]:
        """Bytes of the data of each ledger object that exists (benches, and the size checks' tests)."""
        root = self.kube.read_configmap(self.namespace, self.name)
        if root is None:
            return {}
        count = int(dict(Part.from_data(root.get("data") or {}).meta).get("shards") or 0)
        found = {self.name: root, **{n: self.kube.read_configmap(self.namespace, n) for n in self.shard_names(count)}}
        return {n: len(json.dumps(cm.get("data") or {}).encode()) for n, cm in found.items() if cm is not None}

    def read(self) -> tuple[list[Reservation], Versions | None]:
        """All reservations (expired ones included) and the version they were read at (None: no ledger yet)."""
        state = self.snapshot()
        return list(state.reservations), state.version

    def live(self, now: float | None = None) -> list[Reservation]:
        now = self.clock() if now is None else now
        return [r for r in self.read()[0] if r.expires_at > now]

    def live_unavailable(self, now: float | None = None) -> list[Unavailable]:
        return self.snapshot().live_unavailable(self.clock() if now is None else now)

    # ------------------------------------------------------------------ writing
    def commit(self, job_id: str, reservations: Iterable[Reservation], expected_version: Versions | None,
               unavailable: Iterable[Unavailable] = (), record: JobRecord | None = None,
               drop_unavailable: Iterable[Unavailable] = (), state: LedgerState | None = None) -> None:
        """Replace `job_id`'s entries with `reservations` (and its record with `record`, when
        given), add the `unavailable` marks and remove `drop_unavailable`, only if every object
        it adds to is still at `expected_version` (the version the placement was computed from);
        else LedgerConflict with nothing added. `state`: the ledger as read at that version
        (spares a read). What it only removes or rewrites follows (module doc, "Commits")."""
        new = list(reservations)
        if any(r.job_id != job_id for r in new) or (record is not None and record.job_id != job_id):
            raise ValueError(f"commit for job {job_id!r} got entries of another job")
        if state is None or state.version != expected_version:
            state = self.snapshot()
        if expected_version is None:       # placed on no ledger: every object that exists now moved
            moved = [n for n, v in state.versions.items() if v is not None]
        else:
            moved = [n for n, v in expected_version.objects if state.versions.get(n) != v]
        jobs = list(state.jobs) if record is None else _put(state.jobs, record)
        # the shards of every reservation the plan holds are compare-and-swapped, even where it keeps one
        # unchanged (the job re-placed where it already held): a place taken from it meanwhile (a
        # preemption) must fail the commit, as an addition that no longer fits does
        count = int(dict(state.parts[self.name].meta)["shards"]) if self.name in state.parts else SHARDS
        self._write([r for r in state.reservations if r.job_id != job_id] + new,
                    _merge(_without(state.unavailable, drop_unavailable), unavailable), state, jobs, moved=moved,
                    guard={self.object_of_node(r.node, count) for r in new})

    def update(self, change: Callable[[LedgerState], tuple | None],
               what: str, attempts: int = 20) -> LedgerState | None:
        """Read-modify-write until done: `change(state)` returns the new entries, as (reservations,
        unavailable, records) or with the batch state fourth, or None once there is nothing left to
        write. Each object is compare-and-swapped on its own, so a change that read several objects
        (a record as long as the reservations it holds) is read again after its write and written
        again until the ledger as read needs nothing more. Returns the state the last write was
        guarded by (None: nothing written)."""
        wrote = None
        for attempt in write_attempts(attempts):
            state = self.snapshot()
            new = change(state)
            if new is None:
                return wrote
            try:
                self._write(new[0], new[1], state, new[2], batch=new[3] if len(new) > 3 else None)
                wrote = state
            except LedgerConflict:
                wrote = state       # some objects may be written already: the next round writes the rest
                time.sleep(backoff(attempt))
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
            if rec == state.record(job_id, now):
                return None
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
        removed: dict[tuple, Reservation] = {}

        def change(state: LedgerState):
            mine = [r for r in state.reservations if r.job_id == job_id]
            removed.update((_key(r), r) for r in mine)
            jobs = [j for j in state.jobs if j.job_id != job_id]
            if not mine and len(jobs) == len(state.jobs):
                return None
            return [r for r in state.reservations if r.job_id != job_id], list(state.unavailable), jobs

        try:
            self.update(change, f"release job {job_id}", attempts)
        except LedgerConflict:
            raise LedgerConflict(f"could not release job {job_id}: every write conflicted for "
                                 f"{WRITE_CONTENDED_SECONDS} s") from None
        return list(removed.values())

    def _write(self, entries: list[Reservation], unavailable: Iterable[Unavailable], prev: LedgerState,
               jobs: Iterable[JobRecord], batch: Batch | None = None, moved: Sequence[str] = (),
               guard: Iterable[str] = ()) -> None:
        """Make the ledger hold these entries, over `prev` (module doc, "Commits"): the objects whose
        content changes, each compacted (expired entries pruned, tombstones for what is dropped).
        Objects that gain a reservation or a mark, and the root when `batch` changes it, are written
        first, each a compare-and-swap on its version in `prev` (LedgerConflict, with what was added
        taken back, when one moved, or when one is in `moved`); then the objects that only lose or
        renew entries, re-read and re-applied until written (a release never needs the version
        the caller read). `batch`: the new group-commit state (None: `prev`'s, kept). `guard`: objects
        compare-and-swapped as the ones that gain, even when their content is unchanged (a placement's)."""
        now = self.clock()
        if prev.version is None:    # no ledger when the plan was made: valid only on a ledger still empty
            self._create(now)
            prev = self.snapshot()
            if prev.version is None or prev.batch != Batch() or any(
                    prev.versions[n] is not None for n in prev.parts if n != self.name) or prev.unavailable:
                raise LedgerConflict("the ledger was created and written by another process meanwhile")
        changes = {}
        for name, (res, marks, recs) in self._touched(prev, entries, unavailable, jobs).items():
            if name not in prev.parts:
                raise ValueError(f"entries for an object this ledger does not have: {name}")
            change = Change.between(prev.parts[name], res, marks, recs)
            if not change.empty:
                changes[name] = change
        if batch is not None and batch != prev.batch:
            changes[self.name] = replace(changes.get(self.name, Change()), batch=batch)
        guard = set(guard) if prev.parts.get(self.name, Part()).format >= FORMAT else set()
        for name in guard:
            changes.setdefault(name, Change())
        # what promises or fences capacity, a job record (one writer's read-modify-write), the batch
        # state; offering marks in the root are hints
        strict = [n for n, c in changes.items()
                  if (c.adds or c.put_jobs or c.drop_jobs or n in guard) and (n != self.name or c.batch is not None)]
        if any(n in moved for n in strict):
            raise LedgerConflict(f"ledger objects {sorted(set(strict) & set(moved))} moved since they were read")
        self._add_all(prev, strict, changes, now)
        _each(lambda n: self._apply_fresh(n, changes[n]), [n for n in changes if n not in strict], raising=True)

    def _touched(self, prev: LedgerState, entries: Iterable[Reservation], unavailable: Iterable[Unavailable],
                 jobs: Iterable[JobRecord]) -> dict[str, tuple[list, list, list]]:
        """The new content of each object the new entries differ from `prev` in. Entries the caller
        took from `prev` as they were are the same objects: only the others are placed in their
        shards (a write of one job costs the job's entries, not the whole ledger's)."""
        entries, unavailable, jobs = list(entries), list(unavailable), list(jobs)
        count = int(dict(prev.parts[self.name].meta)["shards"])
        kept = {id(x) for x in (*entries, *unavailable, *jobs)}
        touched: set[str] = set()
        for name, part in prev.parts.items():
            if any(id(x) not in kept for x in (*part.reservations, *part.unavailable, *part.jobs)):
                touched.add(name)
        known = {id(x) for part in prev.parts.values() for x in (*part.reservations, *part.unavailable, *part.jobs)}
        fresh = self._split([r for r in entries if id(r) not in known], [u for u in unavailable if id(u) not in known],
                            [j for j in jobs if id(j) not in known], count)
        touched |= set(fresh)
        out = {}
        for name in touched:
            part = prev.parts.get(name, Part())
            add = fresh.get(name, ([], [], []))
            out[name] = ([r for r in part.reservations if id(r) in kept] + add[0],
                         [u for u in part.unavailable if id(u) in kept] + add[1],
                         [j for j in part.jobs if id(j) in kept] + add[2])
        return out

    def _add_all(self, prev: LedgerState, names: list[str], changes: dict[str, Change], now: float) -> None:
        """Write the objects that gain entries, each against its version in `prev`: those that only
        add first (side by side), then the one with the job's record, the root last; on a conflict
        take back what was added (module doc, "Commits"). Several objects: the reservations are
        written with at most PROVISIONAL_SECONDS left, then extended once all are in."""
        several = len(names) > 1
        rank = {n: 2 if n == self.name else 1 if (changes[n].put_jobs or changes[n].drop_jobs) else 0 for n in names}
        done: list[str] = []

        def write(name: str) -> None:
            change = changes[name].provisional(now) if several else changes[name]
            if name == self.name:
                self._put_root(prev.parts[name], change, now)
            else:
                self._cas(name, prev.parts[name], prev.versions.get(name), change, now)

        for step in (0, 1, 2):
            outcomes = _each(write, sorted(n for n in names if rank[n] == step))
            done += [n for n, error in outcomes if error is None]
            errors = [error for _, error in outcomes if error is not None]
            if any(isinstance(e, LedgerConflict) for e in errors):
                _each(lambda n: self._apply_fresh(n, changes[n].taken_back(now), must=False), done)
                raise next(e for e in errors if isinstance(e, LedgerConflict))
            if errors:
                raise errors[0]         # not a conflict (the worker is going down): what it wrote expires
        if several:
            _each(lambda n: self._apply_fresh(n, changes[n].extension()),
                  [n for n in done if changes[n].provisional(now) != changes[n]], raising=True)

    def put_batch(self, state: LedgerState, batch: Batch) -> None:
        """The group-commit state alone (a lease taken, renewed or given up), in one compare-and-swap of the
        root at the version `state` read: LedgerConflict when the root moved meanwhile (another took the
        lease, or answered). It reads no shard and writes no other object: a lease touches nothing else,
        and a hundred waiters trying for a free lease must each cost one write, not a ledger read and
        retries (the loser looks again at its next poll)."""
        root = state.given_parts.get(self.name)
        if root is None or root.format < FORMAT:        # no ledger yet, or one to migrate: the full write
            return self._write(list(state.reservations), state.unavailable, state, state.jobs, batch=batch)
        self._cas(self.name, root, state.given_versions.get(self.name), Change(batch=batch), self.clock())

    def _put_root(self, prev: Part, change: Change, now: float) -> None:
        """The root's batch state, if it is still the one `prev` read (else LedgerConflict): a write of
        the root that left the batch alone (an offering mark), or only renewed its lease (the placer's
        lease thread, `BatchPlacer.renew`: the same leader, the same answers), is no reason to refuse.
        Refusing a renewal took back a whole batch whenever a round outlasted a third of the lease."""
        for attempt in range(MIGRATION_ATTEMPTS):
            cm = self.kube.read_configmap(self.namespace, self.name)
            part = Part.from_data((cm or {}).get("data") or {})
            if cm is None or not part.batch.same_but_lease(prev.batch) or part.format < FORMAT:
                raise LedgerConflict(f"the batch state in {self.identity} changed since it was read")
            try:
                return self._cas(self.name, part, cm["metadata"]["resourceVersion"], change, now)
            except LedgerConflict:
                time.sleep(backoff(attempt))
        raise LedgerConflict(f"the root of ledger {self.identity} kept changing")

    def _apply_fresh(self, name: str, change: Change, must: bool = True) -> None:
        """Apply `change` to the object as it is now, through conflicts (for what needs no version:
        removals, renewals, records, a taking back)."""
        for attempt in write_attempts(20):
            cm = self.kube.read_configmap(self.namespace, name)
            part = Part.from_data((cm or {}).get("data") or {})
            try:
                self._cas(name, part, cm["metadata"]["resourceVersion"] if cm else None, change, self.clock())
                return
            except LedgerConflict:
                time.sleep(backoff(attempt))
        if must:
            raise LedgerConflict(f"could not write ledger object {self.namespace}/{name}: every write conflicted "
                                 f"for {WRITE_CONTENDED_SECONDS} s")

    def _cas(self, name: str, prev: Part, version: str | None, change: Change, now: float) -> None:
        data = object_data(change.applied(prev), prev, now)
        self._check_size(name, data)
        self._put(name, data, version)

    def _put(self, name: str, data: dict[str, str], version: str | None) -> None:
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/managed-by": "gpuboot", LABEL_LEDGER: self.name}},
                "data": data}
        try:
            if version is None:
                self.kube.create_configmap(self.namespace, body)
            else:
                body["metadata"]["resourceVersion"] = version
                self.kube.replace_configmap(self.namespace, body)
        except Conflict as exc:
            raise LedgerConflict(str(exc)) from None

    def _check_size(self, name: str, data: dict[str, str]) -> None:
        size = len(json.dumps(data).encode())
        if size <= MAX_OBJECT_BYTES:
            return
        parts = ", ".join(f"{len(json.loads(data[k]))} {what} ({len(data[k].encode()):,} bytes)"
                          for k, what in ((DATA_KEY, "reservations"), (JOBS_KEY, "job records"),
                                          (UNAVAILABLE_KEY, "unavailable marks"), (TOMBSTONES_KEY, "tombstones"))
                          if k in data)
        if BATCH_KEY in data:
            parts += (f", {len(json.loads(data[BATCH_KEY])['decided'])} batch answers "
                      f"({len(data[BATCH_KEY].encode()):,} bytes)")
        raise LedgerFull(
            f"ledger ConfigMap {self.namespace}/{name} would be {size:,} bytes, over gpuboot's "
            f"{MAX_OBJECT_BYTES:,}-byte limit per ledger object (kept well below the 1 MiB a ConfigMap may hold) "
            f"even with expired entries pruned: {parts}. The write was refused and nothing changed: too many "
            f"jobs hold reservations or records on the nodes of this shard at once; let some finish, or keep "
            f"groups of jobs on separate nodes with a ledger_namespace each")

    def _create(self, now: float) -> None:
        """A new ledger: its root, in format 2 (a 409 means another process created it first)."""
        with contextlib.suppress(LedgerConflict):
            self._put(self.name, root_data(Part(), self.shards, now), None)

    # ------------------------------------------------------------------ migration
    def migrate(self, root: dict) -> None:
        """Move a format-1 ledger (everything in the root) into shards, in place (module doc, "Migration")."""
        part = Part.from_data(root.get("data") or {})
        meta = dict(part.meta)
        version = root["metadata"]["resourceVersion"]
        if not meta.get(MIGRATING_KEY):     # 1. fence the format-1 writers out: they cannot parse this root
            data = {**(root.get("data") or {}),
                    META_KEY: json.dumps({"seq": MIGRATED, "tombstones_from": part.tombstones_from,
                                          ROOT_SEQ_KEY: part.seq, MIGRATING_KEY: uuid.uuid4().hex,
                                          "shards": self.shards}, sort_keys=True)}
            try:
                self._put(self.name, data, version)
            except LedgerConflict:
                return                      # a format-1 write or another migrator got there first: read again
            return
        count, tag, now = int(meta["shards"]), str(meta[MIGRATING_KEY]), self.clock()
        wanted = self._split(part.reservations, part.unavailable, part.jobs, count)
        tombs: dict[str, list[Tombstone]] = {}
        for t in part.tombstones:
            tombs.setdefault(self.object_of_node(t.node, count), []).append(t)
        for name in self.shard_names(count):   # 2. every shard, once (a shard with this tag is done)
            res, marks, recs = wanted.get(name, ([], [], []))
            shard = Part(tuple(res), tuple(marks), tuple(recs), tuple(tombs.get(name, ())), part.seq,
                         part.tombstones_from, meta=((MIGRATED_FROM_KEY, tag),))
            self._migrate_shard(name, shard, tag)
        new_root = Part(unavailable=tuple(wanted.get(self.name, ([], [], []))[1]), batch=part.batch, seq=part.seq)
        with contextlib.suppress(LedgerConflict):     # 3. the switch (another migrator may have made it)
            self._put(self.name, root_data(new_root, count, now), version)

    def _migrate_shard(self, name: str, shard: Part, tag: str) -> None:
        for _ in range(MIGRATION_ATTEMPTS):
            cm = self.kube.read_configmap(self.namespace, name)
            if cm is not None and dict(Part.from_data(cm.get("data") or {}).meta).get(MIGRATED_FROM_KEY) == tag:
                return
            try:
                self._put(name, shard_data(shard), cm["metadata"]["resourceVersion"] if cm else None)
                return
            except LedgerConflict:
                continue


@dataclass(frozen=True)
class Change:
    """What one write does to one object: entries put (new, or rewritten like a renewal) and
    dropped, and the new batch state (root only)."""

    put: tuple[Reservation, ...] = ()
    drop: frozenset = frozenset()             # reservation keys
    put_marks: tuple[Unavailable, ...] = ()
    drop_marks: frozenset = frozenset()
    put_jobs: tuple[JobRecord, ...] = ()
    drop_jobs: frozenset = frozenset()
    batch: Batch | None = None
    new_keys: frozenset = frozenset()         # keys of `put` the object did not hold (or held smaller): what it adds

    @classmethod
    def between(cls, old: Part, res: list[Reservation], marks: list[Unavailable], recs: list[JobRecord]) -> Change:
        before = {_key(r): r for r in old.reservations}
        after = {_key(r): r for r in res}
        jobs_before = {j.job_id: j for j in old.jobs}
        jobs_after = {j.job_id: j for j in recs}
        grown = {k for k, r in after.items() if k in before and before[k].resources != r.resources}
        return cls(put=tuple(r for k, r in after.items() if before.get(k) != r),
                   drop=frozenset(set(before) - set(after)),
                   put_marks=tuple(m for m in marks if m not in set(old.unavailable)),
                   drop_marks=frozenset(set(old.unavailable) - set(marks)),
                   put_jobs=tuple(j for i, j in jobs_after.items() if jobs_before.get(i) != j),
                   drop_jobs=frozenset(set(jobs_before) - set(jobs_after)),
                   new_keys=frozenset(set(after) - set(before)) | grown)

    @property
    def adds(self) -> bool:
        """Does it promise (a reservation) or fence (a mark) something new, or change the batch?"""
        return bool(self.new_keys or self.put_marks or self.batch is not None)

    @property
    def empty(self) -> bool:
        return not (self.put or self.drop or self.put_marks or self.drop_marks or self.put_jobs or self.drop_jobs
                    or self.batch is not None)

    def applied(self, part: Part) -> Part:
        """On `part` as it is now: a put that is not an addition (a renewal) only rewrites an entry
        still there, so a renewal never brings back a reservation released meanwhile."""
        res = {_key(r): r for r in part.reservations if _key(r) not in self.drop}
        res.update((_key(r), r) for r in self.put if _key(r) in self.new_keys or _key(r) in res)
        jobs = {j.job_id: j for j in part.jobs if j.job_id not in self.drop_jobs}
        jobs.update((j.job_id, j) for j in self.put_jobs)
        marks = _merge([u for u in part.unavailable if u not in self.drop_marks], self.put_marks)
        return replace(part, reservations=tuple(res.values()), unavailable=tuple(marks), jobs=tuple(jobs.values()),
                       batch=part.batch if self.batch is None else self.batch)

    def provisional(self, now: float) -> Change:
        """The added reservations living at most PROVISIONAL_SECONDS (a crash before `extension` frees them soon)."""
        put = tuple(replace(r, expires_at=min(r.expires_at, now + PROVISIONAL_SECONDS)) if _key(r) in self.new_keys
                    else r for r in self.put)
        return replace(self, put=put)

    def extension(self) -> Change:
        """Only the added reservations at their full lifetime (renews what `provisional` wrote, if still there)."""
        return Change(put=tuple(r for r in self.put if _key(r) in self.new_keys))

    def taken_back(self, now: float) -> Change:
        """Undo what this change added (its reservations and marks), nothing else."""
        return Change(drop=self.new_keys, drop_marks=frozenset(self.put_marks))


class NodeClaims:
    """`claim_nodes` for a batch, started as each plan is made rather than after the last one: the
    claims of a 10,000-node batch (~150 Nodes, ~0.9 s) then run while the next jobs are placed.
    The leader waits for them all (`wait`) before its commit, as before: every Node a commit books
    names this ledger first. A Node another ledger names stops the claims (none started after it)
    and `wait` raises SecondLedger; claims already made, or made for a batch placed again, only
    name this ledger on Nodes it did not book, which `claim_nodes` allows too."""

    def __init__(self, ledger: ReservationLedger, nodes: Sequence[dict]) -> None:
        self.ledger, self._nodes = ledger, nodes
        self._by_name: dict[str, dict] | None = None      # built at the first claim (an idle round claims none)
        self._asked: set[str] = set()
        self._refused: SecondLedger | None = None
        self._finished = False
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list = []

    def add(self, names: Iterable[str]) -> None:
        """Claim these Nodes (those not named after this ledger yet), in the background."""
        for name in names:
            if self._refused is not None or self._finished or name in self._asked:
                continue
            self._asked.add(name)
            if self._by_name is None:
                self._by_name = {n["metadata"]["name"]: n for n in self._nodes}
            node = self._by_name.get(name)
            if node is None or ledger_of(node) == self.ledger.identity:
                continue
            try:
                self.ledger._refuse_second(node)
            except SecondLedger as exc:
                self._refused = exc
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(CLAIMS_PARALLEL, thread_name_prefix="gpuboot-claim")
            self._pending.append(self._pool.submit(self.ledger._claim, node))

    def finish(self) -> None:
        """Wait for the claims under way; no more can be added."""
        self._finished = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def wait(self) -> None:
        """Once every claim is done: SecondLedger (or a claim's error) if any, else nothing."""
        self.finish()
        if self._refused is not None:
            raise self._refused
        for claim in self._pending:
            claim.result()


def _each(action: Callable[[str], object], names: Sequence[str], raising: bool = False, parallel: int = PARALLEL
          ) -> list[tuple[str, BaseException | None]]:
    """`action` on each name, up to `parallel` at once (the ledger's objects are independent: a commit
    over 40 shards costs a few round trips, not 40); each name's exception or None. `raising`: raise
    the first exception instead, once all are done."""
    if len(names) <= 1:
        outcomes = []
        for name in names:
            try:
                action(name)
                outcomes.append((name, None))
            except Exception as exc:   # returned to the caller, which decides
                outcomes.append((name, exc))
    else:
        def run(name: str) -> tuple[str, BaseException | None]:
            try:
                action(name)
                return name, None
            except Exception as exc:   # returned to the caller, which decides
                return name, exc
        with ThreadPoolExecutor(min(parallel, len(names))) as pool:
            outcomes = list(pool.map(run, names))
    if raising:
        for _, error in outcomes:
            if error is not None:
                raise error
    return outcomes


@lru_cache(maxsize=1 << 16)
def _shard(root: str, key: str, count: int) -> str:
    """The shard holding a node name (or 'job:' + a job id): stable across processes and versions."""
    return f"{root}-{zlib.crc32(key.encode()) % count}"


def _key(r: Reservation) -> tuple[str, str, str]:
    return r.job_id, r.task, r.node


def object_data(new: Part, prev: Part, now: float) -> dict[str, str]:
    """The ConfigMap data of one object's write after `prev` (pure).

    Compaction: expired reservations, marks, records and tombstones are dropped (the seq of the
    newest tombstone dropped raises `tombstones_from`, see the module doc); a live reservation of
    `prev` that `new` no longer has (same job, task and node) leaves a tombstone with this write's seq."""
    seq = prev.seq + 1
    kept = sorted((r for r in new.reservations if r.expires_at > now), key=lambda r: (r.job_id, r.task, r.node))
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
    marks = sorted((u for u in new.unavailable if u.expires_at > now), key=lambda u: u.what)
    records = sorted((j for j in new.jobs if j.expires_at > now), key=lambda j: j.job_id)
    meta = dict(new.meta)
    if meta.get("format"):
        meta.update({"seq": MIGRATED, ROOT_SEQ_KEY: seq, "tombstones_from": floor})
    else:
        meta.update({"seq": seq, "tombstones_from": floor})
    data = {DATA_KEY: json.dumps([r.to_json() for r in kept], sort_keys=True),
            META_KEY: json.dumps(meta, sort_keys=True)}
    if marks:
        data[UNAVAILABLE_KEY] = json.dumps([u.to_json() for u in marks], sort_keys=True)
    if records:
        data[JOBS_KEY] = json.dumps([j.to_json() for j in records], sort_keys=True)
    if tombstones:
        data[TOMBSTONES_KEY] = json.dumps([t.to_json() for t in tombstones], sort_keys=True)
    batch = new.batch.live(now)
    if batch.decided or batch.leader:
        data[BATCH_KEY] = json.dumps(batch.to_json(), sort_keys=True)
    return data


def root_data(root: Part, shards: int, now: float) -> dict[str, str]:
    """A format-2 root: its meta (the shard count; `seq` unparseable by format-1 code), offering marks, batch."""
    meta = tuple(sorted({**dict(root.meta), "format": FORMAT, "shards": shards}.items()))
    meta = tuple((k, v) for k, v in meta if k != MIGRATING_KEY)
    return object_data(replace(root, meta=meta), replace(root, reservations=()), now)


def shard_data(shard: Part) -> dict[str, str]:
    """A shard as migration writes it: its entries as they were, nothing pruned, its seq the old ledger's."""
    data = {DATA_KEY: json.dumps([r.to_json() for r in shard.reservations], sort_keys=True),
            META_KEY: json.dumps({**dict(shard.meta), "seq": shard.seq, "tombstones_from": shard.tombstones_from},
                                 sort_keys=True)}
    for key, items in ((UNAVAILABLE_KEY, shard.unavailable), (JOBS_KEY, shard.jobs), (TOMBSTONES_KEY, shard.tombstones)):
        if items:
            data[key] = json.dumps([x.to_json() for x in items], sort_keys=True)
    return data


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


LEGACY_QUEUE_KEY = "queue.json"        # the queue shards' compare-and-swap format (one list per shard): pruned
LEGACY_ANSWERS_KEY = "answers.json"
ENTRY_PREFIX, ANSWER_PREFIX = "q.", "a."   # a queue shard's keys: one per entry and one per answer's copy
LEAD_KEY = "lead.json"
QUEUE_SHARDS = 64   # ConfigMaps the batch queue is spread over; the leader reads them all, a waiter only its
                    # own. kube-apiserver applies a merge patch as a read-modify-write retried on every
                    # conflict, so k patches at once on one shard cost it ~k^2/2 attempts, each decoding
                    # the shard: a 1,000-job burst's appends at 32 shards (~31 each) were half its CPU for
                    # 14 s. 64 cut that fourfold (128 gained no more, and doubled the leader's idle reads)
LEAD_EVERYWHERE_SECONDS = 5.0   # a batch's publish copies the lead into every shard at least this often (a
                                # third of batching.LEASE_SECONDS, so no copy a waiter reads looks lapsed)
ANSWER_KEEP_SECONDS = 16.0   # a copy of an answer stays in its queue shard this long (two of a waiter's
                             # slowest polls, batching.POLL_MAX_SECONDS; later, it reads the ledger root, or
                             # queues again and its leader answers it again: every poll reads the whole shard,
                             # and kept for the answer's 120 s the copies made a 1,000-job burst's polls
                             # read 57 % more, and the burst slower)


@dataclass(frozen=True)
class Lead:
    """What the batch leader last committed, as it copies it into every queue shard: who leads, until
    when, and when it committed. Advisory: never newer than the ledger root it copies."""

    leader: str
    lease_until: float
    at: float

    def to_json(self) -> dict:
        return {"leader": self.leader, "lease_until": self.lease_until, "at": self.at}

    @classmethod
    def from_json(cls, d: dict) -> Lead:
        return cls(d["leader"], float(d["lease_until"]), float(d["at"]))


@dataclass(frozen=True)
class QueueShard:
    """One queue shard as read: the waits queued there, the answers copied there, the last lead."""

    entries: tuple[Queued, ...] = ()
    answers: tuple[Decided, ...] = ()
    lead: Lead | None = None
    version: str | None = None
    stale: frozenset[str] = frozenset()     # keys of what expired (the leader's next patch removes them)


def _queue_key(prefix: str, ticket: str) -> str:
    """A ConfigMap data key for a ticket (keys allow only [-._a-zA-Z0-9]; tickets hold a job id and ':')."""
    return prefix + hashlib.sha256(ticket.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Look:
    """A waiter's one read of its queue shard (`RequestQueue.look`)."""

    waits: bool                 # its entry is still there
    waiting: int                # how many requests wait in all (estimated from its shard)
    answer: Decided | None      # its answer's copy, once a batch decided it
    lead: Lead | None


class RequestQueue:
    """First placements waiting for a batch (gpuboot.lifecycle.batching), spread over QUEUE_SHARDS
    ConfigMaps named after the ledger (`<ledger>-queue-<i>`, so RBAC can name every one). A
    waiter adds its entry to the shard its ticket hashes to; the batch leader reads every shard.
    Entries expire; answers live in the ledger, so the queue is only ever a hint of who is waiting:
    losing an entry delays a job, never double-books.

    Why merge patches. Each entry, and each answer's copy, is a key of its own in the shard's data
    (`q.<hash of its ticket>`, `a.<...>`), added or removed by a JSON merge patch, which the API
    server applies to the object as it is: no read before, no resourceVersion, no conflict for the
    client. With compare-and-swap appends, 1,000 waiters queueing at once kept 32 shards contended for
    seconds, and half of them gave up. The API server still retries its own read-modify-write on each
    conflict, so patches of one shard at once cost it about the square of their number: hence
    QUEUE_SHARDS. Expired keys are removed by the leader's next patch of their shard.

    Why answers are copied here too. A waiter polls its shard anyway; the ledger root holds the
    burst's latest answers (up to 150 KB). So after committing a batch the leader moves each
    answered entry's `Decided` into its shard (kept ANSWER_KEEP_SECONDS) and copies its lease
    (`Lead`) into the shards it writes, and into every shard when it takes, renews or gives up the
    lease and every LEAD_EVERYWHERE_SECONDS: a waiter reads its answer, and sees that someone leads,
    without reading the root. The copy is written only after the root commit, so it never says more
    than the ledger: a lost copy sends the waiter to the root (its entry gone with no answer, the
    lead lapsed, or its wait given up), as before the copies.

    Why a lease's copies are written in the background (`publish_later`). A lease taken or renewed is copied
    into every shard, while a burst's waiters patch the same shards: on the real control plane, 1,000
    waiters queueing at once made those 64 patches take up to 96 s (504s after 60), and the placer's
    loop and its lease-keeping thread both waited on them, so the burst's first batch came minutes late.
    The same holds for a batch's answers' copies, written into the same shards: on the 10,000-node real
    plane a leader's first commit waited minutes on them. A leader goes on at once (`publish_later`);
    the copies follow, the latest lease only (older ones asked for meanwhile are dropped), and
    `wait_copied` lets a leader stepping down write its last copy after them."""

    def __init__(self, kube: KubeClient, namespace: str = "default", ledger: str = CONFIGMAP,
                 clock: Callable[[], float] = time.time) -> None:
        self.kube, self.namespace, self.clock = kube, namespace, clock
        self.shards = [f"{ledger}-queue-{i}" for i in range(QUEUE_SHARDS)]
        self._stale: dict[str, set[str]] = {}      # shard -> expired keys its last read found (pruned by `publish`)
        self._lead_everywhere_at = -math.inf       # when `publish` last copied the lead into every shard
        self._copies = threading.Condition()       # guards the five below (`publish_later`)
        self._answers_due: list[Decided] = []      # answers' copies still to write
        self._lead_due: Lead | None = None         # the lead to write with them (None: nothing to write)
        self._everywhere_due = False               # ... into every shard
        self._unwritten: set[str] = set()          # tickets whose answers' copies are not written yet
        self._copying = False                      # the writing thread runs
        self.unread: list[str] = []                # shards the last `waiting` could not read (turned away)

    def shard_of(self, ticket: str) -> str:
        return self.shards[zlib.crc32(ticket.encode()) % len(self.shards)]

    def _read(self, name: str) -> QueueShard:
        """A shard from the API server's watch cache (`KubeClient.read_configmap`, cached): a read that is
        behind shows an entry still waiting that was answered (the leader skips the tickets the ledger
        root answers, and a waiter polls again), an answer not yet copied, or no entry where a patch has
        just put one (the waiter then reads the root and queues it again): each only delays. A burst's
        thousand waiters and the leader's reads of every shard then cost no etcd read, which on the real
        control plane left the leader's first reads of a 1,000-job burst queued behind the waiters' patches."""
        return self._as_read(self.kube.read_configmap(self.namespace, name, cached=True))

    def _as_read(self, cm: dict | None) -> QueueShard:
        """A shard as read, or as a patch wrote it (the API server answers a patch with the object)."""
        if cm is None:
            return QueueShard()
        data, now = cm.get("data") or {}, self.clock()
        lead = json.loads(data.get(LEAD_KEY) or "null")
        entries = [Queued.from_json(json.loads(v)) for k, v in data.items() if k.startswith(ENTRY_PREFIX)]
        answers = [Decided.from_json(json.loads(v)) for k, v in data.items() if k.startswith(ANSWER_PREFIX)]
        stale = {_queue_key(ENTRY_PREFIX, q.ticket) for q in entries if q.expires_at <= now} | \
            {_queue_key(ANSWER_PREFIX, d.ticket) for d in answers if d.expires_at <= now} | \
            {k for k in (LEGACY_QUEUE_KEY, LEGACY_ANSWERS_KEY) if k in data}      # the compare-and-swap format's
        return QueueShard(tuple(sorted(entries, key=lambda q: q.expires_at)), tuple(answers),
                          Lead.from_json(lead) if lead else None, cm["metadata"]["resourceVersion"], frozenset(stale))

    def _patch(self, name: str, data: Mapping[str, str | None], attempts: int = 5) -> dict:
        """One merge patch of shard `name`'s data (None removes a key); the shard made when missing. The API
        server retries a patch's own conflicts, but may still answer 409 under heavy contention, or give up
        on a burst's thousand patches at once (429, or a 5xx such as 504 Timeout: the write may have landed
        or not, and a merge patch of the same keys is the same write again): tried again after a pause,
        LedgerConflict after `attempts` (a waiter's place step then defers, holding nothing). The shard as
        written."""
        body = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "gpuboot"}}, "data": dict(data)}
        answered = "409 Conflict"
        for attempt in range(attempts):
            try:
                written = self.kube.merge_patch_configmap(self.namespace, name, body)
                if written is not None:
                    return written
                return self.kube.create_configmap(self.namespace, {
                    "apiVersion": "v1", "kind": "ConfigMap", **body,
                    "metadata": {**body["metadata"], "name": name, "namespace": self.namespace},
                    "data": {k: v for k, v in data.items() if v is not None}})
            except Conflict:        # made meanwhile by another (then patch it), or a conflict the server gave up on
                answered = "409 Conflict"
            except Overloaded as exc:
                answered = str(exc)
            time.sleep(backoff(attempt))
        raise LedgerConflict(f"queue shard {self.namespace}/{name}: {attempts} writes answered {answered}")

    def add(self, entry: Queued) -> Look:
        """Queue (or renew) `entry`: one merge patch, which never conflicts. The patch's answer is the shard as
        written, so it is a look too: about how many wait (the waiter paces its polls by it), whether someone
        leads (the lead's copy: a waiter queueing needs no read of the ledger to know), its answer's copy."""
        written = self._patch(self.shard_of(entry.ticket),
                              {_queue_key(ENTRY_PREFIX, entry.ticket): json.dumps(entry.to_json(), sort_keys=True)})
        return self._look(entry.ticket, self._as_read(written))

    def look(self, ticket: str) -> Look:
        """The waiter's poll: one read of its ticket's shard."""
        return self._look(ticket, self._read(self.shard_of(ticket)))

    def _look(self, ticket: str, shard: QueueShard) -> Look:
        now = self.clock()
        live = [q for q in shard.entries if q.expires_at > now]
        answer = next((d for d in shard.answers if d.ticket == ticket and d.expires_at > now), None)
        return Look(any(q.ticket == ticket for q in live), len(live) * len(self.shards), answer, shard.lead)

    def publish(self, answers: Sequence[Decided], lead: Lead, attempts: int = 5, everywhere: bool = False) -> None:
        """After a batch's ledger commit: each answered entry out of its shard and a copy of its answer in,
        the expired keys the last reads found pruned, and `lead` copied (one merge patch per shard written,
        all at once; best effort, see the class doc: `attempts` tries each). The lead goes into every shard
        when there are no answers (a lease taken, renewed or given up) or the last such copy is
        LEAD_EVERYWHERE_SECONDS old; otherwise only into the shards written anyway: a lone job's batch
        patches one shard, not all of them (`everywhere`: into every shard in any case)."""
        now = self.clock()
        everywhere = everywhere or not answers or now - self._lead_everywhere_at >= LEAD_EVERYWHERE_SECONDS
        changes: dict[str, dict[str, str | None]] = {name: dict.fromkeys(self._stale.pop(name, ()))
                                                     for name in self.shards}
        for d in answers:
            kept = replace(d, expires_at=min(d.expires_at, now + ANSWER_KEEP_SECONDS))
            mine = changes[self.shard_of(d.ticket)]
            mine[_queue_key(ENTRY_PREFIX, d.ticket)] = None
            mine[_queue_key(ANSWER_PREFIX, d.ticket)] = json.dumps(kept.to_json(), sort_keys=True)
        written = [name for name in self.shards if everywhere or changes[name]]
        for name in written:
            changes[name][LEAD_KEY] = json.dumps(lead.to_json(), sort_keys=True)
        if everywhere:
            self._lead_everywhere_at = now

        for name, error in _each(lambda name: self._patch(name, changes[name], attempts), written):
            if error is not None:
                log.warning("batch answers' copies not written to %s (%s): its waiters read the ledger root", name,
                            error)

    def publish_later(self, answers: Sequence[Decided], lead: Lead) -> None:
        """`publish` in a background thread (class doc): what is asked while one is written is written
        together next (the answers of both, the latest lead, into every shard if either was a lease's
        copy alone). Until its copy is written, an answered ticket is left out of `waiting`, whatever its
        shard still says (the ledger root may have let its answer go by then)."""
        with self._copies:
            self._answers_due += answers
            self._unwritten |= {d.ticket for d in answers}
            self._lead_due, self._everywhere_due = lead, self._everywhere_due or not answers
            if self._copying:
                return
            self._copying = True
        threading.Thread(target=self._write_copies, name="gpuboot-queue-copies", daemon=True).start()

    def _write_copies(self) -> None:
        while True:
            with self._copies:
                answers, lead, everywhere = self._answers_due, self._lead_due, self._everywhere_due
                self._answers_due, self._lead_due, self._everywhere_due = [], None, False
                if lead is None:
                    self._copying = False
                    self._copies.notify_all()
                    return
            try:        # a lease's copy alone gets one try: the next renewal writes another
                self.publish(answers, lead, attempts=5 if answers else 1, everywhere=everywhere)
            except Exception as exc:  # best effort, as every copy: waiters read the root without it
                log.warning("the batch's copies were not written (%s: %s): waiters read the ledger root",
                            type(exc).__name__, exc)
            with self._copies:
                self._unwritten -= {d.ticket for d in answers}

    def wait_copied(self, timeout: float) -> bool:
        """Until the copies asked for are written (or `timeout` seconds): whether they are."""
        with self._copies:
            return self._copies.wait_for(lambda: not self._copying, timeout)

    def drop(self, tickets: Iterable[str], attempts: int = 5) -> None:
        """Take requests out of their shards, answered ones or a withdrawn wait (best effort: what
        stays expires, and a leader never places an answered ticket again)."""
        by_shard: dict[str, dict[str, str | None]] = {}
        for t in tickets:
            by_shard.setdefault(self.shard_of(t), {})[_queue_key(ENTRY_PREFIX, t)] = None
        for name, gone in by_shard.items():
            try:
                self._patch(name, gone, attempts)
            except LedgerConflict as exc:  # best effort: the entry expires
                log.info("could not drop %d queued request(s) from %s (%s)", len(gone), name, exc)

    def waiting(self, answered: Iterable[str] = ()) -> list[Queued]:
        """Every live entry not answered yet, oldest first (queue order): not in `answered` (the ledger
        root's answers) and without an answer's copy in its shard. The copy matters once the root has let
        the answer go (`kept_answers`): a waiter's renewal that crossed the answer brings its entry back,
        and placed again it would be answered `alone`, overwriting the copy its waiter has still to read.
        Such an entry is pruned by the next `publish`, like an expired one. A shard the API server turns
        away is left out (`unread`): its requests wait for the next round."""
        with self._copies:
            done = set(answered) | self._unwritten
        now = self.clock()
        read: dict[str, QueueShard] = {}
        self.unread = []
        for name, error in _each(lambda name: read.__setitem__(name, self._read(name)), self.shards):  # PARALLEL
            if isinstance(error, Overloaded):   # turned away (429) past the client's tries: its waiters wait a round
                log.info("queue shard %s not read this round (%s): its requests wait for the next", name, error)
                self.unread.append(name)
            elif error is not None:
                raise error
        out: list[Queued] = []
        self._stale = {}
        for name, shard in read.items():
            copied = {d.ticket for d in shard.answers}
            stale = set(shard.stale) | {_queue_key(ENTRY_PREFIX, q.ticket) for q in shard.entries if q.ticket in copied}
            if stale:
                self._stale[name] = stale
            out += [q for q in shard.entries if q.expires_at > now and q.ticket not in done and q.ticket not in copied]
        return sorted(out, key=lambda q: (q.expires_at, q.ticket))

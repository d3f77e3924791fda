"""A watch-fed view of the cluster, for the long-lived placer (`gpuboot.lifecycle.placer`).

Why. A full cluster read (`gpuboot.lifecycle.booking.survey`: LIST Nodes, LIST every active Pod,
DescribeInstances for every node) costs seconds of API reads on a large fleet (20 s on 10,000
nodes, docs/performance.md), and the batch leader paid it again for every batch. A process that
lives on keeps the Nodes and the active Pods by list + watch instead (one LIST each when it starts
and after a 410 Gone, then only the changes), and the ECS instances by DescribeInstances of the
nodes that changed (a new node, a new providerID, Ready flipped, a new bootID or cordon, a start
recorded in the ledger) plus all of them every INSTANCE_REFRESH_SECONDS. A placement in steady
state then reads no LIST.

Why the view may be stale and the commit stays safe. Nothing here decides: the plans made from
the view are committed by compare-and-swap on the ledger, as a survey's are, and the tombstone
rule of `gpuboot.lifecycle.booking` ("Bursts") is what makes a survey usable: it must be read
after ledger seq s0, and every reservation released after s0 is counted through its tombstone.
A watch has no "read after"; its equivalent is `covered_seq`, the one place that rule lives:
the pod stream has passed resourceVersion P (an event's, a BOOKMARK's or the list's), so the view
holds every pod write with resourceVersion <= P; the ledger writes this process saw are kept as
(resourceVersion, seq) pairs per ledger object; s0 is the seq of the newest of them at or below P.
A release at or before s0 was written (at some resourceVersion <= that write's <= P) only after
its pod was bound, so the binding's resourceVersion is smaller still and the view shows the pod:
rule (d). Releases after s0 are tombstones the ledger still holds or, when pruned, refused
(`LedgerState.released_since` is None) and the view waits for its stream to pass the ledger read
now (`Collection.wait_past`). This needs resourceVersions that order writes across kinds: on
Kubernetes they are etcd's revision, one counter for every object of the cluster (the API
conventions call them opaque; gpuboot relies on them being etcd revisions, as kube-apiserver
has always made them), and simcloud's API server keeps one counter for its whole store.
A version that is not an integer makes the view refuse (`ViewUnusable`) and the placer falls
back to full reads.

What a stale view may miss is what any survey misses between its read and the commit (pods not
made by gpuboot, node and instance state changes): a connected watch is behind by its delivery
lag; a disconnected one counts as read when it was last connected (`Basis.at`), so the age
limits of the single path and of the batch (SURVEY_MAX_AGE_SECONDS, VERDICT_MAX_AGE_SECONDS)
hold for it too: past SURVEY_MAX_AGE_SECONDS it gives no basis at all, and the leader reads the
cluster in full (a watch that keeps failing, or one this identity may not open, `NotPermitted`:
logged as an error naming the right to grant).

Passing a ledger write. A BOOKMARK carries the API server's watch cache version for its resource,
not etcd's: the pod cache learns ConfigMap (ledger) writes only from etcd progress notifications,
every 10 minutes unless asked. So when the pod stream must pass a ledger write it has not passed,
the view asks (`KubeClient.request_progress`: a consistent LIST of one pod brings the cache up to
now) and the next bookmark, at most WATCH_SECONDS away, passes it. Without the ask, a quiet real
cluster's busy verdict waited out WAIT_PAST_SECONDS and read in full (simcloud's bookmarks carried
its global version then, kinder than the real one; they now follow the cacher's rule).

The same rule keeps a quiet stream from falling out of the API server's history: a watch resumes
from the last version it saw, which on a quiet collection stops moving while every other write of
the cluster moves on (10,000 nodes' heartbeats: past the 75 s window in about a minute, and a 410
means a re-list of 80,000 pods). So a stream that has not moved for QUIET_SECONDS asks for
progress too before it re-opens its watch: one LIST of one object, and the next bookmark moves it.

The inventory. Placement reads joined views of every node (`gpuboot.lifecycle.booking.joined`),
which on 10,000 nodes and 80,000 pods take a second or more to build: too long to build again for
every batch of a burst, during which something on some nodes always changes (a claim is ignored:
`same_for_placement`; a node going NotReady, a pod starting or ending is not). So each collection
logs which nodes its changes touch (a Node's own name; a pod's node), under the lock its snapshot
is taken under, and the view builds again only the views of the nodes touched since its last build
(`rejoined`), when they are few: the others are as the last build made them, from the same objects.
Everything is built again after a re-list, a new ECS description, or REBUILD_SECONDS (states that
depend on the time, such as a boot's grace, move on without a write).

Reconnects. A watch ends every WATCH_SECONDS (the API server sends a BOOKMARK just before, so an
idle stream still tells how far it has come) and is re-opened from the last resourceVersion; a
dropped connection is resumed from there too, after a jittered backoff; a 410 Gone (compaction)
re-lists. A restarted placer starts with an empty view: one LIST per collection.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from gpuboot.core.inventory import node_condition, pod_is_active
from gpuboot.core.model import ANNOTATION_LEDGER, Reservation
from gpuboot.core.ports import Ecs
from gpuboot.exceptions import Gone, NotPermitted
from gpuboot.lifecycle.booking import (
    SURVEY_MAX_AGE_SECONDS,
    Basis,
    Survey,
    instance_id_of,
    joined,
    priced_types,
    rejoined,
)
from gpuboot.lifecycle.ledger import LedgerState
from gpuboot.lifecycle.pricing import PRICES, PriceCache

WATCH_SECONDS = 4               # a watch is re-opened this often; the API server sends a BOOKMARK 2 s before
                                # its end, so an idle pod stream says how far it has come every few seconds
                                # (what a busy verdict waits for: `ClusterView.basis(fresh=True)`)
RECONNECT_SECONDS = (0.2, 5.0)  # backoff after a dropped connection: first, longest (full jitter)
INSTANCE_REFRESH_SECONDS = 300  # every instance described again this often (changes outside the node signals)
WAIT_PAST_SECONDS = WATCH_SECONDS + 5   # how long a placement waits for the pod stream to pass a ledger write
QUIET_SECONDS = 30              # a stream that has not moved this long asks for progress (module doc)
TOUCHED_KEPT = 100_000         # changes whose touched nodes a collection keeps (`Collection.touched_since`)
PARTIAL_SHARE = 0.25            # views built again alone while at most this share of the nodes changed
REBUILD_SECONDS = 30            # an unchanged fleet's inventory is rebuilt this often (states depend on the
                                # clock: boot grace, settle windows); the single path re-uses a survey as long
START_SECONDS = 300             # the first lists of a starting view (10,000 nodes, 80,000 pods: ~30 s)


class ViewUnusable(Exception):
    """The view cannot say what it covers (no first list yet, or resourceVersions that are not integers)."""


def version_number(version: str | None) -> int:
    """A resourceVersion as the etcd revision it is (module doc); 0 for none (no object yet)."""
    if version is None:
        return 0
    try:
        return int(version)
    except ValueError:
        raise ViewUnusable(f"resourceVersion {version!r} is not an integer: this API server's versions are not "
                           f"etcd revisions, so a watch cannot say which ledger writes it covers; placements read "
                           f"the cluster in full instead") from None


def covered_seq(writes: Sequence[tuple[int, int]], passed: int) -> int | None:
    """The rule (module doc): the seq of the newest ledger write, of (resourceVersion, seq) pairs,
    that a pod stream at resourceVersion `passed` has passed; None if it has passed none of them."""
    seqs = [seq for version, seq in writes if version <= passed]
    return max(seqs) if seqs else None


class Collection:
    """One collection ("nodes" or "pods": the non-terminated ones) kept by list + watch in a thread."""

    def __init__(self, kube, kind: str, on_change: Callable[[dict | None, dict | None], None] | None = None,
                 log: logging.Logger | None = None, monotonic: Callable[[], float] = time.monotonic,
                 watch_seconds: int = WATCH_SECONDS, same: Callable[[dict, dict], bool] | None = None) -> None:
        self.kube, self.kind, self.on_change, self.same = kube, kind, on_change, same
        self.log = log or logging.getLogger(__name__)
        self.monotonic, self.watch_seconds = monotonic, watch_seconds
        self.items: dict[str, dict] = {}
        self.passed = -1                # the resourceVersion everything up to is held (-1: not listed yet)
        self.changes = 0                # bumped by every change placement reads (the view rebuilds its inventory
                                        # on one); `same` says which modifications are not
        self._touched: deque[tuple[int, tuple[str, ...] | None]] = deque(maxlen=TOUCHED_KEPT)  # (change, nodes)
        self.lists = self.resumes = self.gone = self.progress_asked = 0
        self.stale_since: float | None = None   # monotonic: disconnected since (None: connected)
        self.moved_at = monotonic()             # when `passed` last moved on (or it last asked for progress)
        self.cond = threading.Condition()

    def key(self, obj: dict) -> str:
        meta = obj.get("metadata") or {}
        return f"{meta.get('namespace', '')}/{meta.get('name')}" if self.kind == "pods" else str(meta.get("name"))

    def node_of(self, obj: dict | None) -> str | None:
        """The node a Node or a pod is on (what an inventory view of it depends on)."""
        if obj is None:
            return None
        return (obj.get("spec") or {}).get("nodeName") if self.kind == "pods" else (obj.get("metadata") or {}).get("name")

    def touched_since(self, since: int, until: int) -> set[str] | None:
        """The nodes the changes numbered since+1 .. until touched (`changes` of two snapshots); None when
        one of them was a re-list (it touched everything) or they are no longer all kept."""
        with self.cond:
            return _logged_since(self._touched, since, until)

    def snapshot(self) -> tuple[list[dict], int, int]:
        """The objects, the resourceVersion they are complete up to, and the change count: taken together,
        so that an inventory built from them is never filed under a later state (ClusterView._survey)."""
        with self.cond:
            return list(self.items.values()), self.passed, self.changes

    def wait_past(self, version: int, timeout: float, *, ask: bool = False) -> bool:
        """Until the stream has passed `version` (or `timeout` seconds): whether it has. `ask`: if it has
        not yet, ask the API server to bring its watch cache up to now first (`request_progress`): a
        BOOKMARK carries the cache's version, which a quiet collection's cache does not move on its own."""
        with self.cond:
            if self.passed >= version:
                return True
        if ask:
            self.ask_progress()
        with self.cond:
            return self.cond.wait_for(lambda: self.passed >= version, timeout)

    def ask_progress(self) -> None:
        """Have the API server's watch cache catch up (`KubeClient.request_progress`): a hint, so a
        failure is logged and the caller goes on."""
        try:
            self.kube.request_progress(self.kind)
            self.progress_asked += 1
        except Exception as exc:  # only a hint: the waits decide
            self.log.warning("cluster view: asking for %s progress failed (%s: %s)", self.kind,
                             type(exc).__name__, exc)

    def run(self, stop: threading.Event) -> None:
        """List, then watch from the list's version, until `stop`: resume on a dropped stream, re-list on 410."""
        version: str | None = None
        failures = 0
        while not stop.is_set():
            try:
                if version is None:
                    items, version = self.kube.list_versioned(self.kind)
                    self._replace(items, version)
                for kind, obj in self.kube.stream_events(self.kind, version, self.watch_seconds):
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    self._apply(kind, obj, version)
                    failures = 0
                    if stop.is_set():
                        return
                self._connected()
                if self.monotonic() - self.moved_at > QUIET_SECONDS:
                    self.moved_at = self.monotonic()    # at most one ask per QUIET_SECONDS
                    self.ask_progress()         # a quiet stream: its next bookmark moves it on (module doc)
            except Gone as exc:
                self.gone += 1
                self.log.info("cluster view: %s watch from %s is gone (%s); listing again", self.kind, version, exc)
                version = None
            except Exception as exc:  # a dropped connection, a 5xx, a timeout, a right missing: resume from `version`
                failures += 1
                self.resumes += 1
                with self.cond:
                    self.stale_since = self.stale_since or self.monotonic()
                pause = random.uniform(0, min(RECONNECT_SECONDS[1], RECONNECT_SECONDS[0] * 2 ** failures))
                if isinstance(exc, NotPermitted) and failures == 1:     # once a streak: it is tried again
                    self.log.error("cluster view: this identity may not watch %s (%s): the view stays as last read "
                                   "and, %.0f s on, placements read the cluster in full. Grant it list and watch on "
                                   "%s: the ClusterRole gpuboot-placer of deploy/kubernetes/rbac.yaml",
                                   self.kind, exc, SURVEY_MAX_AGE_SECONDS, self.kind)
                self.log.warning("cluster view: %s watch failed (%s: %s); resuming from %s in %.1f s", self.kind,
                                 type(exc).__name__, exc, version, pause)
                stop.wait(pause)

    def _connected(self) -> None:
        with self.cond:
            self.stale_since = None

    def _replace(self, items: Iterable[dict], version: str) -> None:
        fresh = {self.key(o): o for o in items if self.kind != "pods" or pod_is_active(o)}
        with self.cond:
            old, self.items = self.items, fresh
            self.passed, self.stale_since, self.moved_at = version_number(version), None, self.monotonic()
            self.lists += 1
            self.changes += 1
            self._touched.append((self.changes, None))
            self.cond.notify_all()
        if self.on_change is not None:
            for key in old.keys() | fresh.keys():
                before, after = old.get(key), fresh.get(key)
                if before is None or after is None or _version(before) != _version(after):
                    self.on_change(before, after)

    def _apply(self, kind: str, obj: dict, version: str) -> None:
        before = None
        with self.cond:
            if kind != "BOOKMARK":
                key = self.key(obj)
                before = self.items.pop(key, None)
                if kind != "DELETED" and (self.kind != "pods" or pod_is_active(obj)):
                    self.items[key] = obj
                if not (before is not None and key in self.items and self.same is not None and self.same(before, obj)):
                    self.changes += 1
                    self._touched.append((self.changes, tuple(filter(None, {self.node_of(before), self.node_of(obj)}))))
            if version_number(version) > self.passed:
                self.passed, self.moved_at = version_number(version), self.monotonic()
            self.stale_since = None
            self.cond.notify_all()
        if kind != "BOOKMARK" and self.on_change is not None:
            self.on_change(before, None if kind == "DELETED" else obj)


def _logged_since(log: deque[tuple[int, Iterable[str] | None]], since: int, until: int) -> set[str] | None:
    """What the entries numbered since+1 .. until of `log` ((number, names), numbered 1, 2, ... as they
    came) name together; None when one of them names everything (None) or the oldest are no longer kept."""
    if until <= since:
        return set()
    if not log or log[0][0] > since + 1:
        return None
    out: set[str] = set()
    for number, names in reversed(log):
        if number <= since:
            break
        if number > until:
            continue
        if names is None:
            return None
        out.update(names)
    return out


def _shard_writes(state: LedgerState) -> dict[str, tuple[int, int]]:
    """(resourceVersion, seq) of each shard as `state` read it: the tombstone rule holds shard by shard."""
    return {name: (version_number(state.versions.get(name)), part.seq)
            for name, part in state.parts.items() if name != state.root}


def same_for_placement(before: dict, after: dict) -> bool:
    """Whether two versions of a Node differ only where placement never looks: their resourceVersion,
    managedFields, and the ledger's own claim (ANNOTATION_LEDGER: a batch on 10,000 nodes claims ~150
    Nodes, and each claim rebuilt the whole inventory, 1.8 s, before the next batch)."""
    return _placement_part(before) == _placement_part(after)


def _placement_part(node: dict) -> dict:
    meta = dict(node.get("metadata") or {})
    meta.pop("resourceVersion", None)
    meta.pop("managedFields", None)
    meta["annotations"] = {k: v for k, v in (meta.get("annotations") or {}).items() if k != ANNOTATION_LEDGER}
    return {**node, "metadata": meta}


def _version(obj: dict) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


def _signals(node: dict | None) -> tuple:
    """What of a Node says its instance may have changed (module doc)."""
    if node is None:
        return ()
    status = node.get("status") or {}
    return (instance_id_of(node), node_condition(node).get("status"), (status.get("nodeInfo") or {}).get("bootID"),
            bool((node.get("spec") or {}).get("unschedulable")))


class ClusterView:
    """Nodes and active pods by watch, their ECS instances by DescribeInstances on change, and the
    ledger writes seen, for placements that read no LIST (module doc)."""

    def __init__(self, kube, ecs: Ecs, *, boot_grace_seconds: float = 900, prices: PriceCache = PRICES,
                 log: logging.Logger | None = None, monotonic: Callable[[], float] = time.monotonic,
                 watch_seconds: int = WATCH_SECONDS, instance_refresh_seconds: float = INSTANCE_REFRESH_SECONDS) -> None:
        self.ecs, self.boot_grace_seconds, self.prices = ecs, boot_grace_seconds, prices
        self.log = log or logging.getLogger(__name__)
        self.monotonic, self.instance_refresh_seconds = monotonic, instance_refresh_seconds
        self.nodes = Collection(kube, "nodes", self._node_changed, self.log, monotonic, watch_seconds,
                                same=same_for_placement)
        self.pods = Collection(kube, "pods", None, self.log, monotonic, watch_seconds)
        self._lock = threading.Lock()
        self._dirty: set[str] = set()           # instance ids to describe again
        self._instances: dict[str, dict] = {}
        self._types: dict[str, dict] = {}
        self._described_at = -float("inf")
        self._instance_changes = 0
        self._described: deque[tuple[int, frozenset[str] | None]] = deque(maxlen=TOUCHED_KEPT)  # (generation, ids)
        self._started: set[tuple[str, str]] = set()    # (node, instance) starts seen in ledger records
        self._writes: dict[str, list[tuple[int, int]]] = {}     # ledger shard -> its (resourceVersion, seq) seen
        self._built: tuple | None = None        # (key, monotonic of its last full build, survey): the inventory
        self.full_builds = 0                    # inventories built whole (the rest: only the touched nodes)
        self.describes = 0                      # DescribeInstances batches asked (the bench counts them)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ life
    def start(self, timeout: float = START_SECONDS) -> ClusterView:
        """Start both watches (once) and wait for their first lists."""
        for c in (self.nodes, self.pods) if not self._threads else ():
            t = threading.Thread(target=c.run, args=(self._stop,), name=f"gpuboot-view-{c.kind}", daemon=True)
            t.start()
            self._threads.append(t)
        for c in (self.nodes, self.pods):
            if not c.wait_past(0, timeout):
                raise ViewUnusable(f"cluster view: the first list of {c.kind} took over {timeout:.0f} s")
        return self

    def stop(self, timeout: float = WATCH_SECONDS + 5) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)

    # ------------------------------------------------------------------ the ledger's writes
    def note(self, ledger: str, state: LedgerState) -> None:
        """Keep a ledger state read (each shard's resourceVersion and seq, for `covered_seq`), and take the
        starts its records name as a change signal for their instances."""
        shards = _shard_writes(state)
        with self._lock:
            for name, write in shards.items():
                writes = self._writes.setdefault(name, [])
                if write not in writes:
                    writes.append(write)
                    writes.sort()
                covered = covered_seq(writes, self.pods.passed)     # older pairs than the newest covered are not needed
                if covered is not None:
                    writes[:] = [w for w in writes if w[1] >= covered]
            for record in state.jobs:
                for s in record.started:
                    if (s.node, s.instance_id) not in self._started:
                        self._started.add((s.node, s.instance_id))
                        self._dirty.add(s.instance_id)

    # ------------------------------------------------------------------ what placement reads
    def basis(self, ledger: str, state: LedgerState, now: float, *, fresh: bool = False,
              wait: float = WAIT_PAST_SECONDS) -> tuple[Basis, list[Reservation]] | None:
        """A survey from the view and the releases to count on top of `state`'s live reservations
        (module doc), or None when the view cannot give one in `wait` seconds, or has been disconnected for
        longer than a survey may be re-placed against (SURVEY_MAX_AGE_SECONDS: a watch that keeps failing, a
        right to watch missing): read the cluster in full.
        `fresh`: the pods must cover `state` itself (a busy or never verdict, or tombstones pruned)."""
        self.note(ledger, state)
        if self.monotonic() - self.read_at() > SURVEY_MAX_AGE_SECONDS:
            return None
        if fresh and not self._caught_up(state, wait):
            return None
        shards = _shard_writes(state)
        with self._lock:
            writes = {name: list(self._writes.get(name, ())) for name in shards}
        nodes = self.nodes.snapshot()
        pods = self.pods.snapshot()
        s0 = state.seq_of({name: covered_seq(w, pods[1]) for name, w in writes.items()})   # from this very snapshot
        released = state.released_since(s0, "") if s0 is not None else None
        if released is None:        # the stream is behind every write seen, or tombstones since were pruned
            if not self._caught_up(state, wait):
                return None
            pods = self.pods.snapshot()
            s0, released = state.seq, []
        seen = self._survey(nodes, pods, state.others("", now), now)
        return Basis(s0, seen, self.read_at(), frozenset(state.live_unavailable(now))), released

    def connected(self) -> bool:
        """Both watches connected (a re-list counts as connected: it is reading)."""
        return self.nodes.stale_since is None and self.pods.stale_since is None

    def read_at(self) -> float:
        """When the view was last known current (monotonic): now if both watches are connected."""
        stale = [s for s in (self.nodes.stale_since, self.pods.stale_since) if s is not None]
        return min(stale) if stale else self.monotonic()

    def _caught_up(self, state: LedgerState, wait: float) -> bool:
        if not self.connected():
            return False            # disconnected: read in full rather than wait on a stream that is not there
        return self.pods.wait_past(max((v for v, _ in _shard_writes(state).values()), default=0), wait, ask=True)

    def _survey(self, nodes: tuple[list[dict], int, int], pods: tuple[list[dict], int, int],
                reservations: list[Reservation], now: float) -> Survey:
        """The inventory of these snapshots: the last one built when it was built from the same objects as
        placement reads them (the change counts of the snapshots say so; `covered_seq` was taken on them)
        and is recent, else that one with the views of the nodes touched since built again (module doc,
        "The inventory"), else a whole new one. Its Nodes are these snapshots' own, which differ from those it was built from
        only where placement does not look (`same_for_placement`): a claim reads the Node as it is."""
        instances, types, generation = self._instances_of(nodes[0])
        key = (nodes[2], pods[2], generation)
        built = self._built
        if built is None or built[0] != key or self.monotonic() - built[1] > REBUILD_SECONDS:
            touched = self._touched_since(built, key, nodes[0])
            if touched is not None:     # the views of the nodes touched since built again, the rest kept
                built = (key, built[1], rejoined(built[2], touched, nodes[0], pods[0], instances, types, now,
                                                 self.boot_grace_seconds))
            else:
                began = self.monotonic()
                built = (key, began, joined(nodes[0], pods[0], instances, types, [], now, self.boot_grace_seconds))
                self.full_builds += 1
                self.log.info("cluster view: inventory of %d nodes built whole in %.2f s", len(nodes[0]),
                              self.monotonic() - began)
            self._built = built
        return dataclasses.replace(built[2], nodes=nodes[0]).recounted(reservations, now)

    def _touched_since(self, built: tuple | None, key: tuple[int, int, int], nodes: list[dict]) -> set[str] | None:
        """The nodes whose views must be built again to bring `built` to `key` (node and pod change counts,
        instance generation), or None to build them all: no build yet, new instances, a re-list or a
        change no longer logged, REBUILD_SECONDS since the last full build, or more than PARTIAL_SHARE
        of the fleet touched."""
        if built is None or self.monotonic() - built[1] > REBUILD_SECONDS:
            return None
        by_nodes = self.nodes.touched_since(built[0][0], key[0])
        by_pods = self.pods.touched_since(built[0][1], key[1])
        described = self._described_since(built[0][2], key[2])
        if by_nodes is None or by_pods is None or described is None:
            return None
        touched = by_nodes | by_pods
        if described:
            touched |= {n["metadata"]["name"] for n in nodes if instance_id_of(n) in described}
        return None if len(touched) > len(nodes) * PARTIAL_SHARE else touched

    def _described_since(self, since: int, until: int) -> set[str] | None:
        """The instances described again since generation `since` up to `until`; None if all of them were."""
        with self._lock:
            return _logged_since(self._described, since, until)

    def _node_changed(self, before: dict | None, after: dict | None) -> None:
        if after is not None and _signals(before) != _signals(after) and (iid := instance_id_of(after)):
            with self._lock:
                self._dirty.add(iid)

    def _instances_of(self, nodes: Sequence[dict]) -> tuple[list[dict], dict[str, dict], int]:
        """The nodes' instances, described again when a signal said so or every INSTANCE_REFRESH_SECONDS."""
        ids = {i for i in map(instance_id_of, nodes) if i}
        with self._lock:
            everything = self.monotonic() - self._described_at > self.instance_refresh_seconds
            wanted = ids if everything else (ids - self._instances.keys()) | (self._dirty & ids)
            self._dirty -= wanted
        if wanted:
            ordered = sorted(wanted)
            found = self.ecs.describe_instances(ordered)
            self.describes += -(-len(ordered) // 100)
            new_types = {i["InstanceType"] for i in found if i.get("InstanceType")} - self._types.keys()
            types = self.ecs.describe_instance_types(new_types) if new_types else {}
            with self._lock:
                for iid in wanted:
                    self._instances.pop(iid, None)
                self._instances.update({i["InstanceId"]: i for i in found})
                self._types.update(types)
                self._instance_changes += 1
                self._described.append((self._instance_changes, None if everything else frozenset(wanted)))
                if everything:
                    self._described_at = self.monotonic()
        with self._lock:
            instances = [self._instances[i] for i in sorted(ids) if i in self._instances]
            generation = self._instance_changes
        return instances, priced_types(self.ecs, instances, self._types, self.prices), generation

"""Bursts (issue 11), pure: re-placing after a conflict against the survey already read, the
tombstones that keep that safe, the ledger's compaction and size limit, and giving up for
contention with nothing held. In-memory cluster and ledger; no servers."""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import replace

import pytest

from gpuboot.core.inventory import backed_tasks, build_inventory, with_reservations
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import LABEL_JOB, LABEL_TASK, Reservation
from gpuboot.core.resources import Resources
from gpuboot.exceptions import EcsError
from gpuboot.hooks.kube import Conflict
from gpuboot.lifecycle.booking import SURVEY_MAX_AGE_SECONDS, Booker, LedgerContended
from gpuboot.lifecycle.ledger import (
    MAX_OBJECT_BYTES,
    SHARDS,
    TOMBSTONE_SECONDS,
    JobRecord,
    LedgerFull,
    Part,
    ReservationLedger,
    StartedNode,
    Tombstone,
    object_data,
)
from tests.builders import TYPES, instance, node, pod

NOW = 1_700_000_400.0
GPU = Resources.parse({"nvidia.com/gpu": 1})
JOB = {"image": "i", "command": ["true"], "gpus": 1, "cpu": "1", "memory": "1Gi"}


class Clock:
    def __init__(self, t: float = NOW):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Cluster:
    """Nodes, pods and ConfigMaps (resourceVersion compare-and-swap), ECS instances: in memory.
    `after_survey` runs once right after the first full read (what others do meanwhile)."""

    def __init__(self, names, clock: Clock):
        self.clock, self.lock = clock, threading.Lock()
        self.nodes = [node(n, heartbeat=NOW - 5) for n in names]
        self.instances = [instance(n, start=NOW - 3600) for n in names]
        self.pods: list[dict] = []
        self.cms, self.versions, self.version, self.conflicts = {}, {}, 0, 0
        self.surveys, self.after_survey = 0, None

    # KubeClient
    def list_nodes(self):
        return [dict(n) for n in self.nodes]

    def list_active_pods(self):
        return list(self.pods)

    def get_node(self, name):
        return next(dict(n) for n in self.nodes if n["metadata"]["name"] == name)

    def merge_patch_node(self, name, body):     # the ledger's mark on a node it books (annotations only)
        for n in self.nodes:
            if n["metadata"]["name"] == name:
                annotations = {**(n["metadata"].get("annotations") or {}), **body["metadata"]["annotations"]}
                n["metadata"] = {**n["metadata"], "annotations": annotations}
        return self.get_node(name)

    def read_configmap(self, namespace, name, cached=False):
        with self.lock:
            found = self.cms.get(name)
            return None if found is None else {**found, "metadata": {**found["metadata"],
                                                                     "resourceVersion": str(self.versions[name])}}

    def create_configmap(self, namespace, body):
        with self.lock:
            if self.conflicts:
                self.conflicts -= 1
                raise Conflict("injected")
            name = body["metadata"]["name"]
            if name in self.cms:
                raise Conflict("exists")
            self._store(name, body)

    def replace_configmap(self, namespace, body):
        with self.lock:
            if self.conflicts:
                self.conflicts -= 1
                raise Conflict("injected")
            name = body["metadata"]["name"]
            if body["metadata"]["resourceVersion"] != str(self.versions.get(name)):
                raise Conflict("stale")
            self._store(name, body)

    def _store(self, name, body):
        self.version += 1
        self.cms[name], self.versions[name] = body, self.version

    def largest(self) -> int:
        """Bytes of the largest ledger object's data."""
        return max(len(json.dumps(cm["data"])) for cm in self.cms.values())

    # EcsHook
    def describe_instances(self, ids):
        self.surveys += 1
        hook, self.after_survey = self.after_survey, None
        found = [i for i in self.instances if i["InstanceId"] in set(ids)]
        if hook:
            hook()
        return found

    def describe_instance_types(self, ids):
        return {t: TYPES[t] for t in ids if t in TYPES}

    def describe_price(self, instance_type, zone):
        raise EcsError("permanent", "InvalidInstanceType.ValueNotSupported", "no price here: ranked by GPUs")


def booker(cluster: Cluster, clock: Clock, **kw) -> Booker:
    return Booker(cluster, cluster, ReservationLedger(cluster, clock=clock), logging.getLogger("test"), clock=clock,
                  sleep=lambda s: None, monotonic=clock, **kw)


def spec(name: str) -> JobSpec:
    return JobSpec.from_dict({**JOB, "name": name})


def bound(job: str, node_name: str) -> dict:
    return pod(f"{job}-t", node_name, requests={"nvidia.com/gpu": 1, "cpu": "1", "memory": "1Gi"},
               labels={LABEL_JOB: job, LABEL_TASK: "main"})


def test_a_reservation_released_after_the_survey_still_counts_against_it():
    """X holds node a; while Y's placer works from its survey, X's pod is bound on a and X's
    reservation released. Y's commit conflicts; Y re-places against its old survey (no pod on a
    there) plus the new ledger (no reservation on a): only the tombstone keeps a taken."""
    clock = Clock()
    cluster = Cluster(["a", "b"], clock)
    b = booker(cluster, clock)
    assert b.book(spec("x"), "x").plan.assignments[0].node == "a"     # cheaper/first: a

    def x_binds_and_releases():
        cluster.pods.append(bound("x", "a"))
        ReservationLedger(cluster, clock=clock).release("x")

    cluster.after_survey = x_binds_and_releases
    y = booker(cluster, clock)
    booking = y.book(spec("y"), "y")
    assert booking.committed and [a.node for a in booking.plan.assignments] == ["b"]
    assert y.full_reads == 1                    # the conflict re-read the ledger only
    state = ReservationLedger(cluster, clock=clock).snapshot()
    assert [(t.job_id, t.node) for t in state.tombstones] == [("x", "a")]


def test_without_room_the_busy_verdict_is_made_on_a_fresh_survey():
    clock = Clock()
    cluster = Cluster(["a", "b"], clock)
    booker(cluster, clock).book(spec("x"), "x")

    def x_binds_and_releases_and_z_takes_b():
        cluster.pods.append(bound("x", "a"))
        ReservationLedger(cluster, clock=clock).release("x")
        ledger = ReservationLedger(cluster, clock=clock)
        ledger.commit("z", [Reservation("z", "main", "b", GPU, NOW + 600)], ledger.snapshot().version)

    cluster.after_survey = x_binds_and_releases_and_z_takes_b
    y = booker(cluster, clock)
    booking = y.book(spec("y"), "y")
    assert booking.plan.outcome.value == "busy" and not booking.committed
    assert y.full_reads == 2                    # the tombstone said busy; the cluster read again agreed (X's pod)


def test_a_survey_older_than_a_pruned_tombstone_or_the_age_bound_is_read_again():
    clock = Clock()
    cluster = Cluster(["a", "b"], clock)
    ledger = ReservationLedger(cluster, clock=clock)
    booker(cluster, clock).book(spec("x"), "x")
    before = ledger.snapshot().seq                                # opaque: every shard's write counter
    ledger.release("x")                                           # a tombstone in a's shard
    state = ledger.snapshot()
    assert state.released_since(before, "y") == [state.tombstones[0].as_reservation()]
    assert state.released_since(state.seq, "y") == [] and state.released_since(before, "x") == []   # own: not counted
    after = state.seq
    clock.t += TOMBSTONE_SECONDS + 1
    ledger.commit("other", [Reservation("other", "t", "a", GPU, NOW + 9999)], ledger.snapshot().version)  # prunes a's shard
    state = ledger.snapshot()
    assert state.tombstones == ()
    assert state.released_since(before, "y") is None              # it may have been pruned: re-survey
    assert state.released_since(after, "y") == []

    y = booker(cluster, clock, contended_seconds=300)

    def slow():
        clock.t += SURVEY_MAX_AGE_SECONDS + 1                     # the survey is too old once read
        cluster.conflicts = 1
    cluster.after_survey = slow
    assert y.book(spec("y"), "y").committed and y.full_reads == 2


def test_every_conflict_is_retried_with_jitter_until_the_budget_then_nothing_is_held():
    clock = Clock()
    cluster = Cluster(["a"], clock)
    pauses = []

    def sleep(s):
        pauses.append(s)
        clock.t += s

    b = Booker(cluster, cluster, ReservationLedger(cluster, clock=clock), logging.getLogger("t"), clock=clock,
               sleep=sleep, monotonic=clock, contended_seconds=10)
    cluster.conflicts = 10**6
    with pytest.raises(LedgerContended, match="nothing held"):
        b.book(spec("y"), "y")
    assert b.full_reads == 1 and len(pauses) > 5 and all(0 <= p <= 2.0 for p in pauses) and len(set(pauses)) > 1
    assert cluster.cms == {}                                      # nothing written
    cluster.conflicts = 3                                         # a short burst of 409s: placed through it
    assert b.book(spec("y"), "y").committed


def test_a_gang_re_placed_after_conflicts_is_committed_whole():
    clock = Clock()
    cluster = Cluster(["a", "b", "c"], clock)
    cluster.conflicts = 4
    gang = JobSpec.from_dict({**JOB, "name": "g", "replicas": 3})
    booking = booker(cluster, clock).book(gang, "g")
    assert booking.committed and len(booking.plan.assignments) == 3
    held = ReservationLedger(cluster, clock=clock).snapshot().held("g", NOW)
    assert sorted(r.node for r in held) == ["a", "b", "c"]


def test_counting_reservations_on_bare_views_is_the_full_inventory():
    nodes = [node(n, gpus=2, heartbeat=NOW - 5) for n in ("a", "b", "c")]
    insts = [instance(n, start=NOW - 60, itype="ecs.gn6i-c24g1.12xlarge") for n in ("a", "b", "c")]
    pods = [bound("x", "a"), pod("other", "b", requests={"cpu": "2"})]
    res = [Reservation("x", "main", "a", GPU, NOW + 60),            # backed by its pod: counted once
           Reservation("y", "main", "b", GPU, NOW + 60), Reservation("z", "main", "b", GPU, NOW + 60),
           Reservation("old", "main", "c", GPU, NOW - 1)]            # expired
    full = build_inventory(nodes, pods, insts, TYPES, res, NOW)
    bare = build_inventory(nodes, pods, insts, TYPES, [], NOW)
    assert with_reservations(bare, backed_tasks(pods), res, NOW) == full


def test_compaction_prunes_what_expired_and_tombstones_only_removed_reservations():
    r1, r2 = Reservation("a", "t", "n1", GPU, NOW + 100), Reservation("b", "t", "n2", GPU, NOW + 100)
    old_tomb = Tombstone("c", "t", "n3", GPU, 3, NOW - 1)
    prev = Part((r1, r2, Reservation("gone", "t", "n4", GPU, NOW - 5)), (), (JobRecord("a", NOW - 1),),
                (old_tomb,), seq=5, tombstones_from=1)
    renewed = Reservation("a", "t", "n1", GPU, NOW + 999)
    data = object_data(replace(prev, reservations=(renewed,)), prev, NOW)
    assert [d["job_id"] for d in json.loads(data["reservations.json"])] == ["a"]
    tombs = json.loads(data["tombstones.json"])
    assert [(t["job_id"], t["seq"]) for t in tombs] == [("b", 6)]       # b removed; a renewed, not removed
    assert json.loads(data["meta.json"]) == {"seq": 6, "tombstones_from": 3}
    assert "jobs.json" not in data                                       # the expired record pruned


def test_an_object_over_the_limit_is_refused_and_names_itself_and_its_cause():
    clock = Clock()
    cluster = Cluster(["a"], clock)
    ledger = ReservationLedger(cluster, clock=clock)
    ledger.commit("small", [Reservation("small", "t", "a", GPU, NOW + 100)], None)
    before = json.dumps(cluster.cms)
    big = JobRecord("big", NOW + 100, tuple(StartedNode(f"node-{i:05d}", f"i-{i:020d}", NOW, "b" * 36)
                                            for i in range(8000)))
    with pytest.raises(LedgerFull) as err:
        ledger.commit("big", [], ledger.snapshot().version, record=big)
    message = str(err.value)
    shard = ledger.object_of_job("big", SHARDS)
    assert f"ledger ConfigMap default/{shard} would be" in message and "1 MiB" in message
    assert f"{MAX_OBJECT_BYTES:,}" in message and "1 job records" in message and "refused" in message
    assert json.dumps(cluster.cms) == before                             # nothing written


def test_the_largest_burst_leaves_the_ledger_far_below_the_limit():
    """200 jobs placed and then all released inside the tombstone lifetime: the peak of the bench's
    largest burst, with every record and tombstone still there."""
    clock = Clock()
    cluster = Cluster([f"n{i:04d}" for i in range(200)], clock)
    ledger = ReservationLedger(cluster, clock=clock)
    for i in range(200):
        job = f"gb-{i:020d}"
        state = ledger.snapshot()
        ledger.commit(job, [Reservation(job, "main", f"n{i:04d}", GPU, NOW + 2000)], state.version,
                      record=JobRecord(job, NOW + 2000, (StartedNode(f"n{i:04d}", f"i-{i:020d}", NOW, "b" * 36),)),
                      state=state)
    peak = cluster.largest()
    for i in range(200):
        ledger.release(f"gb-{i:020d}")
    state = ledger.snapshot()
    assert len(state.tombstones) == 200 and state.reservations == () and state.jobs == ()
    after = cluster.largest()
    assert peak < MAX_OBJECT_BYTES / 50 and after < MAX_OBJECT_BYTES / 50     # spread over the shards
    clock.t += TOMBSTONE_SECONDS + 1
    ledger.commit("other", [Reservation("other", f"t{i}", f"n{i:04d}", GPU, NOW + 9999) for i in range(200)],
                  ledger.snapshot().version)                               # a write of each shard
    assert ledger.snapshot().tombstones == ()                              # prunes them

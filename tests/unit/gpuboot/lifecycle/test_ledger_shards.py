"""The sharded ledger (issue 33 part 2), on the in-memory ConfigMaps of tests/fakes.py: placements on
nodes of different shards never conflict, a gang across shards is written whole or taken back, a
commit that dies midway leaves only short-lived additions, a renewal never brings a released
reservation back, and a format-1 ledger is migrated in place with nothing lost while format-1
writers race it. tests/integration/test_ledger_shards.py races the same on both API servers."""
from __future__ import annotations

import threading
from collections import Counter

import pytest

from gpuboot.core.model import Reservation, Unavailable
from gpuboot.core.resources import Resources
from gpuboot.lifecycle.ledger import (
    CONFIGMAP,
    PROVISIONAL_SECONDS,
    Batch,
    Decided,
    JobRecord,
    LedgerConflict,
    ReservationLedger,
    StartedNode,
)
from tests.fakes import Clock, FakeCluster
from tests.shared import format1_add, nodes_in_distinct_shards, run_threads, same_shard_as

GPU = Resources.parse({"nvidia.com/gpu": 1})


def ledger_on(cluster: FakeCluster, clock: Clock) -> ReservationLedger:
    return ReservationLedger(cluster, clock=clock)


def res(job: str, node: str, until: float, task: str = "t") -> Reservation:
    return Reservation(job, task, node, GPU, until)


def test_placements_on_nodes_of_different_shards_never_conflict():
    clock, cluster = Clock(), FakeCluster()
    ledger = ledger_on(cluster, clock)
    x, y = nodes_in_distinct_shards(2)
    ledger.commit("seed", [res("seed", x, clock() + 600)], None)        # the ledger exists
    state = ledger.snapshot()
    until = clock() + 600
    ledger.commit("a", [res("a", x, until)], state.version, state=state)
    ledger.commit("b", [res("b", y, until)], state.version, state=state)   # x's shard moved, not y's
    with pytest.raises(LedgerConflict):                                     # same shard as a: refused
        ledger.commit("c", [res("c", same_shard_as(x), until)], state.version, state=state)
    assert sorted(r.job_id for r in ledger.live()) == ["a", "b", "seed"]


def test_a_gang_across_shards_is_taken_back_whole_when_one_shard_moved():
    clock, cluster = Clock(), FakeCluster()
    ledger = ledger_on(cluster, clock)
    x, y = nodes_in_distinct_shards(2)                  # x's shard is written first
    ledger.commit("seed", [res("seed", x, clock() + 600)], None)
    state = ledger.snapshot()
    assert state.reservations                           # the plan's view: every shard read now
    ledger.commit("other", [res("other", y, clock() + 600)], ledger.snapshot().version)   # y's shard moves
    with pytest.raises(LedgerConflict):
        ledger.commit("gang", [res("gang", x, clock() + 600, "r0"), res("gang", y, clock() + 600, "r1")],
                      state.version, state=state)
    after = ledger.snapshot()
    assert after.held("gang", clock()) == []                          # x's addition was taken back
    assert sorted(r.job_id for r in after.reservations) == ["other", "seed"]


def test_a_gang_across_shards_ends_with_full_lifetimes_and_a_crash_midway_frees_within_minutes():
    clock, cluster = Clock(), FakeCluster()
    ledger = ledger_on(cluster, clock)
    x, y, z = nodes_in_distinct_shards(3)
    until = clock() + 3600
    ledger.commit("gang", [res("gang", x, until, "r0"), res("gang", y, until, "r1")], None)
    assert {r.expires_at for r in ledger.snapshot().held("gang", clock())} == {until}

    class Died(Exception):
        pass

    state = ledger.snapshot()
    writes = []

    def dies_on_the_second(write):
        def wrapped(namespace, body):
            writes.append(body["metadata"]["name"])
            if len(writes) == 2:
                raise Died("the worker was killed mid-commit")
            return write(namespace, body)
        return wrapped

    cluster.create_configmap = dies_on_the_second(cluster.create_configmap)
    cluster.replace_configmap = dies_on_the_second(cluster.replace_configmap)
    with pytest.raises(Died):
        ledger.commit("crash", [res("crash", y, until, "r0"), res("crash", z, until, "r1")], state.version,
                      state=state)
    (left,) = ledger.snapshot().held("crash", clock())               # one shard written, the other not
    assert left.node in (y, z) and left.expires_at <= clock() + PROVISIONAL_SECONDS
    clock.now += PROVISIONAL_SECONDS + 1
    assert ledger.snapshot().held("crash", clock()) == [] and len(ledger.snapshot().held("gang", clock())) == 2


def test_a_renewal_never_brings_back_a_reservation_released_meanwhile():
    clock, cluster = Clock(), FakeCluster()
    ledger = ledger_on(cluster, clock)
    (x,) = nodes_in_distinct_shards(1)
    ledger.commit("j", [res("j", x, clock() + 60)], None)
    cluster.before_next_write(lambda: ledger_on(cluster, clock).release("j"))   # between the renewal's read and write
    ledger.renew("j", clock() + 3600)
    assert ledger.live() == []


def test_many_actors_on_distinct_shards_commit_without_a_conflict():
    """16 placements computed from one snapshot, each on a node of its own shard: all land, none refused."""
    clock, cluster = Clock(), FakeCluster()
    ledger = ledger_on(cluster, clock)
    nodes = nodes_in_distinct_shards(17)
    ledger.commit("seed", [res("seed", nodes[16], clock() + 600)], None)
    state = ledger.snapshot()
    assert state.reservations                           # every shard read now, before the actors start
    barrier, errors = threading.Barrier(16), []

    def place(i: int) -> None:
        try:
            barrier.wait()
            ledger_on(cluster, clock).commit(f"j{i}", [res(f"j{i}", nodes[i], clock() + 600)], state.version,
                                             state=state)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    refused = cluster.refused
    run_threads([threading.Thread(target=place, args=(i,)) for i in range(16)], 60)
    assert not errors and cluster.refused == refused
    assert len(ledger.live()) == 17


def format1_ledger(cluster: FakeCluster, now: float) -> dict:
    """A format-1 ledger as format-1 gpuboot wrote it: everything in one ConfigMap."""
    import json

    x, y = nodes_in_distinct_shards(2)
    content = {
        "reservations.json": [res("a", x, now + 600).to_json(), res("b", y, now + 600).to_json()],
        "unavailable.json": [Unavailable("NoStock", now + 600, instance_type="t", zone="z").to_json(),
                             Unavailable("not GPU-ready", now + 600, node=y, boot_id="b1").to_json()],
        "jobs.json": [JobRecord("a", now + 600, (StartedNode(x, "i-1", now, "b0"),), (("n9", "timeout"),)).to_json()],
        "tombstones.json": [{"job_id": "gone", "task": "t", "node": x, "resources": GPU.to_json(), "seq": 6,
                             "expires_at": now + 100}],
        "batch.json": Batch((Decided("c", "c:1", {"job_id": "c"}, "leader", now + 100),), "leader:1",
                            now + 10).to_json(),
        "meta.json": {"seq": 7, "tombstones_from": 2},
    }
    cluster.create_configmap("default", {"metadata": {"name": CONFIGMAP, "namespace": "default"},
                                         "data": {k: json.dumps(v) for k, v in content.items()}})
    return content


def test_a_format1_ledger_is_migrated_in_place_with_every_entry_and_format1_writers_refused():
    clock, cluster = Clock(), FakeCluster()
    before = format1_ledger(cluster, clock())
    state = ledger_on(cluster, clock).snapshot()
    assert sorted(r.to_json()["job_id"] for r in state.reservations) == ["a", "b"]
    assert {u.what for u in state.unavailable} == {"offering t in z", f"node {nodes_in_distinct_shards(2)[1]}"}
    assert [j.to_json() for j in state.jobs] == before["jobs.json"]
    assert [(t.job_id, t.seq) for t in state.tombstones] == [("gone", 6)]
    assert state.batch.to_json() == before["batch.json"]
    root = cluster.read_configmap("default", CONFIGMAP)
    assert "reservations.json" in root["data"] and '"format": 2' in root["data"]["meta.json"]
    with pytest.raises(ValueError, match="upgrade gpuboot"):          # a format-1 process refuses to book
        format1_add(cluster, res("late", "gpu-x", clock() + 600))


def test_migration_under_format1_writers_and_new_processes_at_once_loses_no_reservation():
    """4 format-1 writers keep booking (each on nodes of its own) while 8 new processes read and
    book: every format-1 write that landed is in the migrated ledger, every new booking too,
    and from the switch on the format-1 writers are refused."""
    clock, cluster = Clock(), FakeCluster()
    format1_add(cluster, res("old-start", "n-start", clock() + 600))
    barrier, errors = threading.Barrier(12), []
    landed: list[str] = []
    refused: Counter = Counter()
    new_nodes = nodes_in_distinct_shards(8, ordered=False)

    def old_writer(w: int) -> None:
        barrier.wait()
        for i in range(200):
            job = f"old-{w}-{i}"
            try:
                if format1_add(cluster, res(job, f"old-node-{w}-{i}", clock() + 600)):
                    landed.append(job)
            except ValueError as exc:
                refused[str(exc)[:40]] += 1
                return

    def new_process(i: int) -> None:
        try:
            barrier.wait()
            ledger = ledger_on(cluster, clock)
            for _ in range(50):
                state = ledger.snapshot()
                try:
                    ledger.commit(f"new-{i}", [res(f"new-{i}", new_nodes[i], clock() + 600)], state.version,
                                  state=state)
                    return
                except LedgerConflict:
                    continue
            raise AssertionError(f"new-{i} never committed")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    run_threads([threading.Thread(target=old_writer, args=(w,)) for w in range(4)]
                + [threading.Thread(target=new_process, args=(i,)) for i in range(8)], 120)
    assert not errors, errors
    held = Counter(r.job_id for r in ledger_on(cluster, clock).live())
    assert all(held[j] == 1 for j in ["old-start", *landed]), "a format-1 reservation was lost"
    assert all(held[f"new-{i}"] == 1 for i in range(8))
    assert sum(refused.values()) == 4                # every format-1 writer ended refused, loudly


def race_two_ledgers(claim) -> tuple[FakeCluster, list[ReservationLedger], Counter]:
    """Three actors of each of two ledgers claim the same 40 Nodes at once (`claim(ledger, nodes)`):
    every Node ends named by exactly one ledger, an actor whose call returned has every Node named
    after its own ledger, and one refused got SecondLedger naming its ledger. (cluster, ledgers, owners)."""
    from gpuboot.core.model import ANNOTATION_LEDGER
    from gpuboot.exceptions import SecondLedger
    from tests.builders import node

    kube = FakeCluster([node(f"n-{i}") for i in range(40)])
    ledgers = [ReservationLedger(kube, "team-a"), ReservationLedger(kube, "team-b")]
    outcome: dict[str, object] = {}

    def actor(name: str, ledger: ReservationLedger) -> None:
        try:
            claim(ledger, [kube.get_node(f"n-{i}") for i in range(40)])
            outcome[name] = "claimed"
        except SecondLedger as exc:
            outcome[name] = exc

    run_threads([threading.Thread(target=actor, args=(f"{k}-{j}", ledgers[k]), name=f"{k}-{j}")
                 for k in (0, 1) for j in range(3)], timeout=30)
    owners = Counter(kube.get_node(f"n-{i}")["metadata"]["annotations"][ANNOTATION_LEDGER] for i in range(40))
    assert sum(owners.values()) == 40 and set(owners) <= {x.identity for x in ledgers}
    for name, result in outcome.items():
        ledger = ledgers[int(name[0])]
        if result == "claimed":
            assert owners == {ledger.identity: 40}
        else:
            assert "is booked through ledger" in str(result) and ledger.identity in str(result)
    assert len(outcome) == 6
    return kube, ledgers, owners


def test_nodes_are_claimed_at_once_and_two_ledgers_racing_for_them_never_share_one():
    """A batch claims every Node it books that no ledger names yet, all at once (ReservationLedger.claim_nodes).
    Each claim is a compare-and-swap on its Node: racing another ledger's claims (and renewals of our own),
    every Node ends named by exactly one ledger, a call that returns has named every Node it was given
    after its own ledger, and one that meets another's Node raises SecondLedger, naming it."""
    from gpuboot.core.model import ANNOTATION_LEDGER
    from gpuboot.exceptions import SecondLedger
    from tests.builders import node

    kube, ledgers, owners = race_two_ledgers(lambda ledger, nodes: ledger.claim_nodes(nodes))
    assert {x.identity for x in ledgers} == {"team-a/gpuboot-reservations", "team-b/gpuboot-reservations"}

    before = {f"n-{i}": kube.get_node(f"n-{i}")["metadata"]["resourceVersion"] for i in range(40)}
    loser = next(x for x in ledgers if owners.get(x.identity, 0) < 40)
    kube.put_node(node("n-new"))
    with pytest.raises(SecondLedger, match="Nothing was booked"):
        loser.claim_nodes([kube.get_node("n-new"), *(kube.get_node(f"n-{i}") for i in range(40))])
    assert ANNOTATION_LEDGER not in (kube.get_node("n-new")["metadata"].get("annotations") or {})   # checked first
    assert {f"n-{i}": kube.get_node(f"n-{i}")["metadata"]["resourceVersion"] for i in range(40)} == before


def test_claims_made_as_a_batch_is_placed_race_like_claim_nodes_and_stop_at_another_ledgers_node():
    """NodeClaims (the batch leader's claims, started plan by plan while the rest is placed): six
    actors of two ledgers add the 40 Nodes in pieces, as plans come; every Node ends named by one
    ledger, a `wait` that returns means every Node added names its ledger, and one that met the other
    ledger's Node raises SecondLedger. Once refused, nothing added after is claimed."""
    from gpuboot.core.model import ANNOTATION_LEDGER
    from gpuboot.exceptions import SecondLedger
    from tests.builders import node

    def in_pieces(ledger: ReservationLedger, nodes: list[dict]) -> None:
        claims = ledger.claims_as_placed(nodes)
        for piece in range(0, 40, 5):                   # plan after plan
            claims.add(f"n-{i}" for i in range(piece, piece + 5))
        claims.wait()

    kube, ledgers, _ = race_two_ledgers(in_pieces)

    owner_of_0 = kube.get_node("n-0")["metadata"]["annotations"][ANNOTATION_LEDGER]
    other = next(x for x in ledgers if x.identity != owner_of_0)
    kube.put_node(node("n-new"))
    kube.put_node(node("n-after"))
    claims = other.claims_as_placed([kube.get_node(n) for n in ("n-new", "n-0", "n-after")])
    claims.add(["n-new"])
    claims.add(["n-0"])                                 # the first ledger's: refused
    claims.add(["n-after"])                             # after the refusal: never claimed
    with pytest.raises(SecondLedger, match="Nothing was booked"):
        claims.wait()
    assert ANNOTATION_LEDGER not in (kube.get_node("n-after")["metadata"].get("annotations") or {})
    assert kube.get_node("n-0")["metadata"]["annotations"][ANNOTATION_LEDGER] == owner_of_0

"""The sharded ledger (issue 33 part 2) on a real API server (simcloud's, and the real control plane
with --kube=real): many actors at once, conflicts only where they share a shard, gangs across
shards racing single placements without a GPU promised twice, a commit killed midway, and the
migration of a format-1 ledger while format-1 writers and new processes write."""
from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from gpuboot.core.model import Reservation
from gpuboot.core.resources import Resources
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.ledger import PROVISIONAL_SECONDS, LedgerConflict, ReservationLedger
from tests.shared import format1_add, nodes_in_distinct_shards, run_threads, same_shard_as

GPU = Resources.parse({"nvidia.com/gpu": 1})
UNTIL = 4e9


def res(job: str, node: str, task: str = "t", until: float = UNTIL) -> Reservation:
    return Reservation(job, task, node, GPU, until)


def test_actors_on_distinct_shards_never_conflict_and_on_one_shard_one_wins(cloud):
    """16 commits from one snapshot on nodes of 16 shards all land at once; 4 more from the same
    snapshot on one shard: exactly one lands, the others are refused."""
    ledger = ReservationLedger(KubeClient())
    nodes = nodes_in_distinct_shards(17, ordered=False)
    ledger.commit("seed", [res("seed", nodes[16])], None)
    state = ledger.snapshot()
    assert state.reservations                           # every shard read now, before the actors start
    shared = [same_shard_as(nodes[16])] * 4
    barrier, errors, refused = threading.Barrier(20), [], Counter()

    def commit(job: str, node: str) -> None:
        try:
            mine = ReservationLedger(KubeClient())
            barrier.wait()
            mine.commit(job, [res(job, node)], state.version, state=state)
        except LedgerConflict:
            refused[job.split("-", maxsplit=1)[0]] += 1
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    run_threads([threading.Thread(target=commit, args=(f"d-{i}", nodes[i])) for i in range(16)]
                + [threading.Thread(target=commit, args=(f"s-{i}", shared[i])) for i in range(4)], 120)
    assert not errors, errors
    assert refused == {"s": 3}                               # the distinct-shard commits: never refused
    held = Counter(r.job_id.split("-")[0] for r in ledger.live())
    assert held == {"d": 16, "s": 1, "seed": 1}


def test_gangs_across_shards_racing_single_placements_never_promise_a_gpu_twice(cloud):
    """8 two-node gangs and 8 single placements, each retrying through conflicts, on 12 one-GPU nodes
    spread over 12 shards: no node ever holds two reservations, and a gang holds both its nodes or none."""
    nodes = nodes_in_distinct_shards(12, ordered=False)
    ReservationLedger(KubeClient()).commit("seed", [], None)
    barrier, errors, placed = threading.Barrier(16), [], {}

    def actor(job: str, size: int, seed: int) -> None:
        rng = random.Random(seed)
        try:
            ledger = ReservationLedger(KubeClient())
            barrier.wait()
            for _ in range(200):
                state = ledger.snapshot()
                free = sorted(set(nodes) - {r.node for r in state.others(job, 0)})
                if len(free) < size:
                    return
                chosen = rng.sample(free, size)
                try:
                    ledger.commit(job, [res(job, n, f"r{i}") for i, n in enumerate(chosen)], state.version,
                                  state=state)
                    placed[job] = chosen
                    return
                except LedgerConflict:
                    continue
            raise AssertionError(f"{job}: still conflicting after 200 tries")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    run_threads([threading.Thread(target=actor, args=(f"gang-{i}", 2, i)) for i in range(8)]
                + [threading.Thread(target=actor, args=(f"one-{i}", 1, 100 + i)) for i in range(8)], 240)
    assert not errors, errors
    live = ReservationLedger(KubeClient()).live()
    per_node = Counter(r.node for r in live)
    assert max(per_node.values()) == 1 and len(live) == 12          # the fleet full, each GPU promised once
    per_job = Counter(r.job_id for r in live)
    assert all(per_job[j] == (2 if j.startswith("gang") else 1) for j in per_job)     # gangs whole
    assert {j: sorted(n) for j, n in placed.items()} == {
        j: sorted(r.node for r in live if r.job_id == j) for j in per_job}


class Killed(Exception):
    """The worker died here (raised instead of a write)."""


class DiesOnWrite(KubeClient):
    """A KubeClient whose `n`-th ConfigMap write kills the worker (nothing is sent)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def _die(self) -> None:
        self.left -= 1
        if self.left == 0:
            raise Killed("killed mid-commit")

    def create_configmap(self, namespace, body):
        self._die()
        return super().create_configmap(namespace, body)

    def replace_configmap(self, namespace, body):
        self._die()
        return super().replace_configmap(namespace, body)


def test_a_commit_killed_midway_leaves_additions_that_expire_within_minutes(cloud):
    x, y = nodes_in_distinct_shards(2)
    ReservationLedger(KubeClient()).commit("seed", [], None)
    dying = ReservationLedger(DiesOnWrite(2))
    with pytest.raises(Killed):
        dying.commit("gang", [res("gang", x, "r0"), res("gang", y, "r1")], dying.snapshot().version)
    ledger = ReservationLedger(KubeClient())
    (left,) = ledger.snapshot().held("gang", 0)
    assert left.node in (x, y) and left.expires_at <= ledger.clock() + PROVISIONAL_SECONDS    # one of the two
    ledger.commit("gang", [res("gang", x, "r0"), res("gang", y, "r1")], ledger.snapshot().version)   # its retry
    assert sorted((r.node, r.expires_at) for r in ledger.live()) == sorted([(x, UNTIL), (y, UNTIL)])


def test_migration_under_format1_writers_and_new_processes_loses_no_reservation(cloud):
    """A format-1 ledger on the API server; 3 format-1 writers keep booking while 6 new processes
    book at once: the first new read migrates it in place; every format-1 write that landed is
    kept, every format-1 writer is refused from the switch on, every new booking lands."""
    kube = KubeClient()
    assert format1_add(kube, res("old-start", "n-start"))
    barrier, errors, landed, refused = threading.Barrier(9), [], [], []
    new_nodes = nodes_in_distinct_shards(6, ordered=False)

    def old_writer(w: int) -> None:
        barrier.wait()
        mine = KubeClient()
        for i in range(500):
            try:
                if format1_add(mine, res(f"old-{w}-{i}", f"old-node-{w}-{i}")):
                    landed.append(f"old-{w}-{i}")
            except ValueError as exc:
                refused.append(str(exc))
                return

    def new_process(i: int) -> None:
        try:
            ledger = ReservationLedger(KubeClient())
            barrier.wait()
            for _ in range(100):
                state = ledger.snapshot()
                try:
                    return ledger.commit(f"new-{i}", [res(f"new-{i}", new_nodes[i])], state.version, state=state)
                except LedgerConflict:
                    continue
            raise AssertionError(f"new-{i} never committed")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    run_threads([threading.Thread(target=old_writer, args=(w,)) for w in range(3)]
                + [threading.Thread(target=new_process, args=(i,)) for i in range(6)], 240)
    assert not errors, errors
    held = Counter(r.job_id for r in ReservationLedger(KubeClient()).live())
    assert [j for j in ["old-start", *landed] if held[j] != 1] == [], "a format-1 reservation was lost"
    assert all(held[f"new-{i}"] == 1 for i in range(6))
    assert len(refused) == 3 and all("upgrade gpuboot" in m for m in refused)

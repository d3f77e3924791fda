"""The ledger at scale (issue 33 part 2): 5,000 jobs holding reservations at once on 10,000 nodes.

    .venv/bin/python -m bench.ledger_scale [--jobs 5000] [--nodes 10000] [--workers 16] [--json FILE]

Drives gpuboot.lifecycle.ledger.ReservationLedger directly (no placement, no cluster) on an
in-memory compare-and-swap ConfigMap store (each read and write atomic, resourceVersions as the
API server gives them). `workers` threads place the jobs at once, each as the place and start steps
do: read the ledger, pick free nodes (80% one node, 20% a gang of 2 to 8 across shards), commit
(compare-and-swap; a conflict re-reads and picks again), then write the job's record of the
instances it starts. Then every job is released at once (tombstones). Figures: the largest ledger
object at its peak and at the end (what the 1 MiB limit applies to), the conflicts per commit, and
what format 1 (one ConfigMap) would have held for the same jobs: bytes per reservation, record,
tombstone and batch answer, and the job count at which each fills 1 MiB alone.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins")]

MIB = 1 << 20


class MemoryStore:
    """ConfigMaps in memory with compare-and-swap on resourceVersion (gpuboot.core.ports.ConfigMapStore).
    The stored data dicts are never mutated (each write stores a new one), so reads share them."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.version = 0
        self.lock = threading.Lock()
        self.peak: dict[str, int] = {}      # object -> largest data it held (bytes)
        self.writes = 0

    def read_configmap(self, namespace: str, name: str) -> dict | None:
        return self.objects.get(name)

    def create_configmap(self, namespace: str, body: dict) -> dict:
        return self._store(body, None)

    def replace_configmap(self, namespace: str, body: dict) -> dict:
        return self._store(body, body["metadata"]["resourceVersion"])

    def _store(self, body: dict, expected: str | None) -> dict:
        from gpuboot.hooks.kube import Conflict

        name = body["metadata"]["name"]
        size = len(json.dumps(body["data"]).encode())
        with self.lock:
            held = self.objects.get(name)
            if (held is None) != (expected is None) or (held is not None and held["metadata"]["resourceVersion"]
                                                        != expected):
                raise Conflict(f"409 {name}")
            self.version += 1
            self.writes += 1
            stored = {"metadata": {**body["metadata"], "resourceVersion": str(self.version)}, "data": body["data"]}
            self.objects[name] = stored
            self.peak[name] = max(self.peak.get(name, 0), size)
            return stored

    def largest(self) -> tuple[str, int]:
        name = max(self.objects, key=lambda n: len(json.dumps(self.objects[n]["data"])))
        return name, len(json.dumps(self.objects[name]["data"]).encode())

    # the Node annotation a booking sets (claim_nodes) is not exercised here
    def get_node(self, name: str) -> dict:
        raise NotImplementedError

    def merge_patch_node(self, name: str, body: dict) -> dict:
        raise NotImplementedError


def entry_bytes() -> dict:
    """Bytes one entry of each kind takes in the ledger (its JSON, as stored), realistic names."""
    from gpuboot.core.model import Reservation
    from gpuboot.core.placement import Outcome, Plan
    from gpuboot.core.resources import Resources
    from gpuboot.lifecycle.ledger import Decided, JobRecord, StartedNode, Tombstone

    job = "gpu_job__manual__2026-12-06T06:20:55.123456+00:00__train"
    r = Reservation(job, "rank-0", "gpu-node-09999", Resources.parse({"nvidia.com/gpu": 1, "cpu": "8",
                                                                      "memory": "32Gi"}), 1_765_000_000.123)
    t = Tombstone(r.job_id, r.task, r.node, r.resources, 123_456, 1_765_000_000.1)
    rec = JobRecord(job, 1_765_000_000.1, (StartedNode("gpu-node-09999", "i-bp1abcdefghijklmnopq", 1_765_000_000.1,
                                                       "3f0e1c2a-1111-2222-3333-444455556666", "123456789"),))
    answer = Decided(job, f"{job}:0123456789ab", Plan(job, Outcome.FITS, "fits").to_json(), "place_3", 1_765_000_000.1)

    def size(x) -> int:
        return len(json.dumps(x.to_json(), sort_keys=True).encode()) + 2     # and its ", " in the list
    return {"reservation": size(r), "tombstone": size(t), "record": size(rec), "answer_min": size(answer)}


def run(jobs: int = 5000, nodes: int = 10_000, workers: int = 16, seed: int = 7, release: bool = True) -> dict:
    from gpuboot.core.model import Reservation
    from gpuboot.core.resources import Resources
    from gpuboot.exceptions import LedgerConflict
    from gpuboot.lifecycle.ledger import MAX_OBJECT_BYTES, ReservationLedger, StartedNode

    store = MemoryStore()
    clock = time.time
    names = [f"gpu-node-{i:05d}" for i in range(nodes)]
    gpu = Resources.parse({"nvidia.com/gpu": 1, "cpu": "8", "memory": "32Gi"})
    sizes = random.Random(seed)
    wanted = [1 if sizes.random() < 0.8 else sizes.randint(2, 8) for _ in range(jobs)]
    todo = list(range(jobs))
    lock = threading.Lock()
    counts = {"commits": 0, "conflicts": 0, "gangs_across_shards": 0, "one_object_conflicts": 0}
    errors: list[str] = []
    ReservationLedger(store).commit("bench-seed", [], None)        # the ledger exists (format 2)

    def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        ledger = ReservationLedger(store, clock=clock)
        while True:
            with lock:
                if not todo:
                    return
                n = todo.pop()
            job = f"gpu_job__manual__2026-12-06T06:{n // 60:02d}:{n % 60:02d}.{n:06d}+00:00__train"
            for _ in range(1000):
                seen = store.version
                state = ledger.snapshot()
                taken = {r.node for r in state.reservations}
                chosen: list[str] = []
                while len(chosen) < wanted[n]:
                    pick = names[rng.randrange(nodes)]
                    if pick not in taken and pick not in chosen:
                        chosen.append(pick)
                until = clock() + 3600
                if store.version != seen:       # some object was written since: format 1 (one object) refuses
                    with lock:
                        counts["one_object_conflicts"] += 1
                try:
                    ledger.commit(job, [Reservation(job, f"rank-{i}", node, gpu, until) for i, node in enumerate(chosen)],
                                  state.version, state=state)
                    break
                except LedgerConflict:
                    with lock:
                        counts["conflicts"] += 1
            else:
                errors.append(f"{job}: never committed")
                continue
            with lock:
                counts["commits"] += 1
                counts["gangs_across_shards"] += len({ledger.object_of_node(c, ledger.shards) for c in chosen}) > 1
            ledger.record_starts(job, [StartedNode(c, f"i-{abs(hash(c)) % 10**20:020d}", clock(),
                                                   "3f0e1c2a-1111-2222-3333-444455556666", "123456789")
                                       for c in chosen], clock() + 3600)

    began = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    placed_s = time.perf_counter() - began
    ledger = ReservationLedger(store)
    state = ledger.snapshot()
    held = len({r.job_id for r in state.reservations if r.job_id != "bench-seed"})
    per_node: dict[str, int] = {}
    for r in state.reservations:
        per_node[r.node] = per_node.get(r.node, 0) + 1
    largest_held = store.largest()
    format1 = len(json.dumps([r.to_json() for r in state.reservations]).encode()) + \
        len(json.dumps([j.to_json() for j in state.jobs]).encode())

    def release_all(chunk: list[str]) -> None:
        mine = ReservationLedger(store, clock=clock)
        for job in chunk:
            mine.release(job)

    jobs_held = sorted({r.job_id for r in state.reservations})
    began = time.perf_counter()
    rel = [threading.Thread(target=release_all, args=(jobs_held[w::workers],)) for w in range(workers)]
    for t in rel if release else ():
        t.start()
    for t in rel if release else ():
        t.join()
    released_s = time.perf_counter() - began
    peak_name = max(store.peak, key=store.peak.get)
    per = entry_bytes()
    return {
        "jobs": jobs, "nodes": nodes, "workers": workers, "shards": ledger.shards,
        "jobs_held_at_once": held, "reservations_held": len(state.reservations) - 0,
        "gpu_promised_twice": sum(1 for c in per_node.values() if c > 1),
        "commits": counts["commits"], "conflicts": counts["conflicts"],
        "conflicts_per_commit": round(counts["conflicts"] / max(1, counts["commits"]), 3),
        "one_object_conflicts": counts["one_object_conflicts"],     # the attempts one ConfigMap would have refused
        "gangs_across_shards": counts["gangs_across_shards"], "errors": errors[:5],
        "largest_object_while_held": {"name": largest_held[0], "bytes": largest_held[1]},
        "peak_object": {"name": peak_name, "bytes": store.peak[peak_name]},
        "peak_object_share_of_1mib": round(store.peak[peak_name] / MIB, 3),
        "limit_bytes": MAX_OBJECT_BYTES,
        "format1_bytes_for_the_same_jobs": format1,
        "entry_bytes": per,
        "format1_jobs_to_fill_1mib": {k: MIB // v for k, v in per.items()},
        "writes": store.writes, "place_seconds": round(placed_s, 1),
        "release_seconds": round(released_s, 1) if release else None,     # None: not run (--no-release)
    }


def line(result: dict) -> str:
    return (f"ledger: {result['jobs_held_at_once']:,} jobs held at once on {result['nodes']:,} nodes "
            f"({result['shards']} shards): largest object {result['peak_object']['bytes'] / 1024:.0f} KiB at its peak "
            f"({result['peak_object_share_of_1mib']:.0%} of 1 MiB; format 1 would need "
            f"{result['format1_bytes_for_the_same_jobs'] / MIB:.1f} MiB in one object), "
            f"{result['conflicts']} conflicts in {result['commits']:,} commits "
            f"({result['conflicts_per_commit']:.3f} per commit, {result['workers']} workers; one object would have "
            f"refused {result['one_object_conflicts']} of those attempts), "
            f"GPUs promised twice: {result['gpu_promised_twice']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ledger_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--no-release", action="store_true", help="stop once every job holds its reservations")
    p.add_argument("--json", default=str(REPO / "results" / "bench" / "ledger_scale.json"))
    args = p.parse_args(argv)
    result = run(args.jobs, args.nodes, args.workers, release=not args.no_release)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(line(result))
    print(f"format 1, bytes per entry {result['entry_bytes']}; jobs to fill 1 MiB with that entry alone "
          f"{result['format1_jobs_to_fill_1mib']}; wrote {args.json}")
    return 0 if not result["errors"] and not result["gpu_promised_twice"] else 1


if __name__ == "__main__":
    sys.exit(main())

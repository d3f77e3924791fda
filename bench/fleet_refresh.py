"""Bytes per minute one open GPU-fleet tab costs at 1,000 nodes: plain polls against conditional ones.

    .venv/bin/python -m bench.fleet_refresh [--nodes 1000] [--changes-per-minute 0,2,30] [--json FILE]

The page polls /gpuboot/api/fleet every 2 s (30 polls a minute). Before, each poll got the whole
fleet; now the page sends If-None-Match and an unchanged fleet answers 304 with no body. The
figures come from the real app (gpuboot.ui.fleet_api.create_app, Airflow's auth dependency
overridden) over HTTP in process, its cache re-surveying at every poll (the survey time and the
countdowns move, as they do every 3 s in production) from a synthetic 1,000-node fleet assembled by
gpuboot.ui.fleet_view; a "change" adds a reservation (what a job's placement does). Bytes are the
status line, headers and body as sent, uncompressed.
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins")]
if "airflow" not in sys.modules:     # the auth dependency imports Airflow: a throwaway home, never the user's
    _home = tempfile.mkdtemp(prefix="gpuboot-bench-airflow-")
    os.environ.setdefault("AIRFLOW_HOME", _home)
    os.environ.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{_home}/airflow.db")

POLLS_PER_MINUTE = 30      # fleet.html polls every 2 s


def fleet_of(n: int, now: float, reservations: int, booked_at: float) -> dict:
    """The page's JSON for `n` nodes (a third running and busy, a third running idle, a third stopped)
    surveyed at `now`, with `reservations` jobs booked at `booked_at`."""
    from gpuboot.core.inventory import build_inventory
    from gpuboot.core.model import Reservation
    from gpuboot.core.resources import Resources
    from gpuboot.ui.fleet_view import fleet_view
    from tests.builders import TYPES, instance, node, pod

    nodes, insts, pods = [], [], []
    for i in range(n):
        name, kind = f"gpu-{i:05d}", i % 3
        price = {"gpuboot.io/price-per-hour": "1.2"}
        if kind == 2:
            nodes.append(node(name, gpus=2, ready="Unknown", labels=price))
            insts.append(instance(name, "Stopped", gpus=2))
            continue
        nodes.append(node(name, gpus=2, heartbeat=now, labels=price))
        insts.append(instance(name, start=now - 3600, gpus=2))
        if kind == 0:
            pods.append(pod(f"train-{i}", name, requests={"nvidia.com/gpu": "1"}))
    live = [Reservation(f"gb-{j}", "train", f"gpu-{3 * j + 1:05d}", Resources({"nvidia.com/gpu": 1}), booked_at + 600)
            for j in range(reservations)]
    views = build_inventory(nodes, pods, insts, TYPES, live, now)
    return fleet_view(views, nodes, reservations=live, backed=(), marks=[], starts={}, instances={},
                      gpus_seen={}, now=now)


def wire_bytes(response) -> int:
    """What crossed the wire for one answer: status line, headers, body (no compression)."""
    head = f"HTTP/1.1 {response.status_code} {response.reason_phrase}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in response.headers.items()) + "\r\n"
    return len(head.encode()) + len(response.content)


def minute_of_polls(client, conditional: bool, changes: int, build) -> dict:
    """One minute of a tab that is open already: 30 polls, the fleet changing `changes` times, evenly spread."""
    from gpuboot.ui import fleet_api

    every = POLLS_PER_MINUTE / changes if changes else None
    total, statuses, reservations = 0, {200: 0, 304: 0}, 0
    fleet_api.CACHE._read = lambda: build(0)      # the tab is open already: it has the fleet as it is now
    fleet_api.CACHE.at = float("-inf")
    etag = client.get("/api/fleet").headers.get("etag")
    for poll in range(POLLS_PER_MINUTE):
        if every and poll % every < 1:
            reservations += 1
        fleet_api.CACHE._read = lambda r=reservations: build(r)      # a survey per poll: the clock moves
        fleet_api.CACHE.at = float("-inf")
        headers = {"If-None-Match": etag} if conditional and etag else {}
        response = client.get("/api/fleet", headers=headers)
        statuses[response.status_code] += 1
        total += wire_bytes(response)
        etag = response.headers.get("etag") or etag
    return {"bytes_per_minute": total, "answers_200": statuses[200], "answers_304": statuses[304]}


def run(nodes: int, changes: list[int]) -> dict:
    from fastapi.testclient import TestClient

    from gpuboot.ui import fleet_api

    app = fleet_api.create_app()
    for route in app.routes:                    # Airflow's login is not what is measured
        for dep in getattr(route, "dependant", None).dependencies if hasattr(route, "dependant") else ():
            app.dependency_overrides[dep.call] = lambda: None
    client = TestClient(app)
    started = time.time()
    def build(reservations: int) -> dict:
        return fleet_of(nodes, time.time(), reservations, started)

    fleet_api.CACHE._read = lambda: build(0)
    one = client.get("/api/fleet", headers={})
    # Airflow's API server gzips answers over 1 KB (its GZipMiddleware): the full answer as it sends it
    out = {"nodes": nodes, "full_answer_bytes": wire_bytes(one),
           "full_answer_gzip_bytes": len(gzip.compress(one.content, compresslevel=9)), "minutes": []}
    for c in changes:
        before = minute_of_polls(client, False, c, build)
        after = minute_of_polls(client, True, c, build)
        out["minutes"].append({"changes_per_minute": c, "before": before, "after": after})
    out["seconds"] = round(time.time() - started, 1)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--changes-per-minute", default="0,2,30")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = run(args.nodes, [int(x) for x in args.changes_per_minute.split(",")])
    print(f"{result['nodes']} nodes: one full answer {result['full_answer_bytes']:,} bytes, "
          f"{result['full_answer_gzip_bytes']:,} gzipped")
    print("| fleet changes / min | before: bytes / min / tab | after: bytes / min / tab | after: 200 / 304 |")
    print("| ---: | ---: | ---: | ---: |")
    for m in result["minutes"]:
        print(f"| {m['changes_per_minute']} | {m['before']['bytes_per_minute']:,} | {m['after']['bytes_per_minute']:,} "
              f"| {m['after']['answers_200']} / {m['after']['answers_304']} |")
    if args.json:
        from bench.common import write_json

        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

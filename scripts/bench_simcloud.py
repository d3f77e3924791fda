#!/usr/bin/env python
"""How fast the local cloud lists a large cluster, and how much memory it takes.

Starts `python -m simcloud serve` with NODES Running nodes (half GPU, half CPU) and
PODS_PER_NODE placeholder pods each (fleet option `pods_per_node`: bound, Running pods
without processes, namespace `bench`), then lists nodes and all pods through the
`kubernetes` client, both fully deserialized (what a caller gets) and raw
(`_preload_content=False`: the server's share), and prints the median of a few runs and
the server's resident memory.

    .venv/bin/python scripts/bench_simcloud.py [--nodes 2000] [--pods-per-node 10] [--runs 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simcloud.harness import SimCloud, small_fleet


def bench_fleet(nodes: int, pods_per_node: int) -> dict:
    half = nodes // 2
    fleet = small_fleet([
        {"name": "bench-gpu", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Running", "count": half},
        {"name": "bench-cpu", "instance_type": "ecs.g7.xlarge", "status": "Running", "count": nodes - half},
    ], pods_per_node=pods_per_node)
    fleet["timings"]["heartbeat_seconds"] = 60   # one heartbeat write per node per minute, as a quiet cluster
    return fleet


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def timed(fn, runs: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--pods-per-node", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="simcloud-bench-") as tmp:
        started = time.perf_counter()
        with SimCloud.start(bench_fleet(args.nodes, args.pods_per_node), Path(tmp), ready_timeout=600) as cloud:
            startup = time.perf_counter() - started
            v1 = cloud.core_v1()
            rss_idle = rss_mib(cloud.process.pid)
            figures = {"nodes": args.nodes, "pods": args.nodes * args.pods_per_node, "runs": args.runs,
                       "startup_seconds": round(startup, 2)}
            for what, call in (("list_nodes", v1.list_node),
                               ("list_pods_all_namespaces", v1.list_pod_for_all_namespaces)):
                seconds, result = timed(call, args.runs)
                raw_seconds, raw = timed(lambda: call(_preload_content=False).data, args.runs)
                figures[what] = {"items": len(result.items), "median_seconds": round(seconds, 3),
                                 "raw_median_seconds": round(raw_seconds, 3), "response_mib": round(len(raw) / 2**20, 1)}
            figures["server_rss_mib"] = {"after_start": round(rss_idle, 1),
                                         "after_lists": round(rss_mib(cloud.process.pid), 1)}

    print(f"simcloud bench: {figures['nodes']} nodes, {figures['pods']} pods "
          f"(started in {figures['startup_seconds']} s), median of {args.runs} runs")
    print(f"{'call':<28}{'items':>8}{'client s':>11}{'raw s':>9}{'MiB':>8}")
    for what in ("list_nodes", "list_pods_all_namespaces"):
        f = figures[what]
        print(f"{what:<28}{f['items']:>8}{f['median_seconds']:>11}{f['raw_median_seconds']:>9}{f['response_mib']:>8}")
    print(f"server RSS: {figures['server_rss_mib']['after_start']} MiB after start, "
          f"{figures['server_rss_mib']['after_lists']} MiB after the lists")
    print("client s = kubernetes client call incl. model deserialization; raw s = _preload_content=False")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

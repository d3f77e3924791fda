"""Readiness detection lag: GPUs registered in the local cloud -> the detector says "ready".

Boots N stopped 1-GPU nodes in simcloud (staggered) and, for each boot, runs side by
side in one asyncio loop:
- the product's `NodeGpuReadyTrigger` (its real `run()`: a watch on the one Node);
- real pollers at 5 s and 30 s: `get_node` on a fixed grid with a random phase, each
  read fed to the same `ReadinessTracker` the poke-mode `GpuReadySensor` uses.
The moment of registration is taken from a separate watch on all Nodes: the first
event, after the boot's zeroed count, whose allocatable nvidia.com/gpu is the real one.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from .common import local_cloud, stats

GPU = "nvidia.com/gpu"
T4 = "ecs.gn6i-c4g1.xlarge"
INTERVALS = (5.0, 30.0)
SETTLE = 5.0
# Short physical delays; heartbeat at the kubelet's default nodeStatusUpdateFrequency (10 s).
TIMINGS = {"start_seconds": 1.0, "boot_seconds": 2.0, "stale_seconds": 1.0, "device_plugin_seconds": 2.0,
           "heartbeat_seconds": 10.0, "stop_seconds": 1.0}


def _gpus(node: dict) -> int:
    raw = ((node.get("status") or {}).get("allocatable") or {}).get(GPU)
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


class Registrations:
    """Watches every Node; records when each started node's GPUs come back after the zeroing."""

    def __init__(self):
        self.started: set[str] = set()
        self.zeroed: set[str] = set()
        self.at: dict[str, float] = {}
        self.seen: set[str] = set()

    async def watch(self, conn_id: str) -> None:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
        from kubernetes_asyncio import client, watch

        async with AsyncKubernetesHook(conn_id=conn_id).get_conn() as api, watch.Watch() as w:
            async for event in w.stream(client.CoreV1Api(api).list_node, timeout_seconds=3600):
                node = event["raw_object"]
                name, now = node["metadata"]["name"], time.time()
                self.seen.add(name)
                if name not in self.started or name in self.at:
                    continue
                if _gpus(node) == 0:
                    self.zeroed.add(name)
                elif name in self.zeroed:
                    self.at[name] = now


async def _trigger(baseline: dict, deadline: float) -> float | None:
    from gpuboot.triggers import NodeGpuReadyTrigger

    async for event in NodeGpuReadyTrigger(baseline=baseline, deadline=deadline, settle_seconds=SETTLE).run():
        return time.time() if event.payload["status"] == "ready" else None
    return None


async def _poller(baseline: dict, interval: float, phase: float, deadline: float) -> float | None:
    from gpuboot.kube import AsyncKubeClient
    from gpuboot.readiness import BootBaseline, ReadinessTracker

    kube = AsyncKubeClient()
    tracker = ReadinessTracker(BootBaseline.from_json(baseline), settle_seconds=SETTLE)
    tick = baseline["start_requested_at"] + phase
    while tick < deadline:
        await asyncio.sleep(max(0.0, tick - time.time()))
        if tracker.observe(await kube.get_node(baseline["node"]), time.time()).ready:
            return time.time()
        tick += interval
    return None


async def _boot(name: str, delay: float, registrations: Registrations, rng: random.Random) -> dict:
    from gpuboot.ecs import EcsHook
    from gpuboot.inventory import parse_provider_id
    from gpuboot.kube import AsyncKubeClient

    await asyncio.sleep(delay)
    node = await AsyncKubeClient().get_node(name)
    instance_id = parse_provider_id(node["spec"]["providerID"])[1]
    baseline = {"node": name, "start_requested_at": time.time(),
                "boot_id_before": node["status"]["nodeInfo"]["bootID"], "gpus_needed": 1}
    registrations.started.add(name)
    await asyncio.to_thread(EcsHook().start_instances, [instance_id])
    deadline = baseline["start_requested_at"] + 120
    detectors = {"trigger (watch)": _trigger(baseline, deadline)}
    for interval in INTERVALS:
        detectors[f"poll {interval:g}s"] = _poller(baseline, interval, rng.uniform(0, interval), deadline)
    fired = dict(zip(detectors, await asyncio.gather(*detectors.values())))
    return {"node": name, "start_requested_at": baseline["start_requested_at"],
            "registered_at": registrations.at.get(name), "fired_at": fired}


async def _run(count: int, stagger: float, seed: int) -> list[dict]:
    registrations = Registrations()
    watcher = asyncio.create_task(registrations.watch("kubernetes_default"))
    names = [f"gpu-{i}" for i in range(count)]
    while not set(names) <= registrations.seen:      # the watch has listed every node
        if watcher.done():
            watcher.result()
        await asyncio.sleep(0.05)
    rng = random.Random(seed)
    try:
        return await asyncio.gather(*(_boot(n, i * stagger / count, registrations, rng)
                                      for i, n in enumerate(names)))
    finally:
        watcher.cancel()


def run(workdir: Path, quick: bool = False, boots: int = 50, seed: int = 1) -> dict:
    from simcloud.testing import small_fleet

    count = min(boots, 8) if quick else boots
    fleet = small_fleet([{"name": "gpu", "instance_type": T4, "status": "Stopped", "count": count}],
                        timings=TIMINGS)
    with local_cloud(fleet, workdir / "cloud"):
        results = asyncio.run(_run(count, stagger=min(30.0, count * 0.6), seed=seed))
    detectors = list(results[0]["fired_at"])
    lags = {d: [r["fired_at"][d] - r["registered_at"] for r in results
                if r["fired_at"][d] is not None and r["registered_at"] is not None] for d in detectors}
    return {
        "boots": count, "settle_seconds": SETTLE, "timings": TIMINGS,
        "lag_seconds": {d: stats(v) for d, v in lags.items()},
        "lag_minus_settle_seconds": {d: stats([x - SETTLE for x in v]) for d, v in lags.items()},
        "fired_before_registration": {d: sum(1 for x in v if x < 0) for d, v in lags.items()},
        "missed": {d: sum(1 for r in results if r["fired_at"][d] is None) for d in detectors},
        "registration_unseen": sum(1 for r in results if r["registered_at"] is None),
        "notes": [
            "Registration time: a separate watch on all Nodes, first real GPU count after the boot's zero.",
            "Pollers are real (get_node on a fixed grid, random phase in [0, interval)), same ReadinessTracker "
            f"and settle window ({SETTLE:g} s) as the poke-mode GpuReadySensor; all detectors run in one process.",
            f"kubelet heartbeat every {TIMINGS['heartbeat_seconds']:g} s (kubelet default nodeStatusUpdateFrequency).",
        ],
        "per_boot": results,
    }

"""Readiness detection lag: GPUs registered in the local cloud -> the detector says "ready".

Boots N stopped 1-GPU nodes in simcloud (staggered) and, for each boot, runs side by
side in one asyncio loop:
- the product's `NodeGpuReadyTrigger` (its real `run()`: a watch on the one Node from the
  resourceVersion read before the start), which sees the kubelet's zero and so fires on the
  **fast path** (no window);
- pollers at 5 s and 30 s on a fixed grid with a random phase which, like the poke-mode
  `GpuReadySensor`, replay the Node's writes since their last read (a short watch from it)
  into the same `ReadinessTracker` (fast path too, late by up to one interval);
- a poller every 5 s that only reads the Node (no replay, as after a re-list), which misses
  the zero whenever no read lands on it and must then take the **fallback** window;
- "window only", the rule before the reset was required, as a control.
Every fire records its path (`evidence["path"]`). The moment of registration is taken from
a separate watch on all Nodes: the first event, after the boot's zeroed count, whose
allocatable nvidia.com/gpu is the real one. Each scenario is a fresh local cloud: the seed's
"stale-first" boot order, the same with the kubelet's reset 10 s late (far past the settle
window), and the real kubelet's order. A detector firing before the registration is an
early fire: the pod would fail admission.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import aiohttp

from .common import local_cloud, stats

GPU = "nvidia.com/gpu"
T4 = "ecs.gn6i-c4g1.xlarge"
INTERVALS = (5.0, 30.0)
SETTLE = 5.0
FALLBACK = 20.0       # the bench's fallback window (the product's default is 60 s): longer than any stale phase here
READ_ONLY = "poll 5s, reads only"
SCENARIOS = {
    "stale-first": {},
    "stale-first, reset 10 s late": {"gpu_reset_delay_seconds": {"*": 10}},
    "kubelet order": {"boot_order": {"*": "kubelet"}},
}
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


async def _trigger(baseline: dict, deadline: float, window_only: bool = False) -> tuple[float, str] | None:
    from gpuboot.core.readiness import BootBaseline, ReadinessTracker
    from gpuboot.triggers.gpu_ready import NodeGpuReadyTrigger

    class WindowTracker(ReadinessTracker):
        """Blind to the kubelet's zero: every count must hold for the window (the path reads "fallback")."""

        def _note_resets(self, boot_id, counts) -> None:
            return None

    class WindowOnly(NodeGpuReadyTrigger):
        """The rule before the reset was required: fresh, Ready and the count held for the window."""

        def make_tracker(self, continuous: bool):
            return WindowTracker(BootBaseline.from_json(self.baseline), settle_seconds=SETTLE,
                                 fallback_seconds=SETTLE, continuous=False)

    cls = WindowOnly if window_only else NodeGpuReadyTrigger
    async for event in cls(baseline=baseline, deadline=deadline, settle_seconds=SETTLE,
                           fallback_seconds=FALLBACK).run():
        at = time.time()
        return (at, event.payload["evidence"].get("path")) if event.payload["status"] == "ready" else None
    return None


async def _poller(baseline: dict, interval: float, phase: float, deadline: float,
                  replay: bool = True) -> tuple[float, str] | None:
    """Judge the Node every `interval` s; `replay`: feed every write since the last read (as the
    poke-mode sensor does), else only the Node as it is at each read (the zero is then often missed)."""
    from gpuboot.core.readiness import BootBaseline, ReadinessTracker
    from gpuboot.hooks.kube import AsyncKubeClient, Gone

    kube = AsyncKubeClient()
    version = baseline["resource_version_before"]
    tracker = ReadinessTracker(BootBaseline.from_json(baseline), settle_seconds=SETTLE, fallback_seconds=FALLBACK,
                               continuous=replay)
    latest = None
    tick = baseline["start_requested_at"] + phase
    while tick < deadline:
        await asyncio.sleep(max(0.0, tick - time.time()))
        try:
            if not replay:
                states = [await kube.get_node(baseline["node"])]
            else:
                try:
                    states = [obj async for _, obj in kube.watch_node(baseline["node"], version, 1)]
                except Gone:
                    tracker.lost_continuity("410 Gone")
                    states = [await kube.get_node(baseline["node"])]
        except (TimeoutError, OSError, aiohttp.ClientError):   # a loaded machine: try at the next tick
            tick += interval
            continue
        if states:
            latest, version = states[-1], states[-1]["metadata"]["resourceVersion"]
        elif latest is None:
            latest = await kube.get_node(baseline["node"])
        verdict = None
        for state in states or [latest]:
            verdict = tracker.observe(state, time.time())
        if verdict.ready:
            return time.time(), verdict.evidence.get("path")
        # as the sensor does: look again when a window may complete, not only on the grid
        wait = tracker.next_check_in(time.time())
        tick = min(tick + interval, time.time() + wait) if wait is not None else tick + interval
    return None


async def _boot(name: str, delay: float, registrations: Registrations, rng: random.Random) -> dict:
    from gpuboot.core.inventory import parse_provider_id
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.hooks.kube import AsyncKubeClient

    await asyncio.sleep(delay)
    node = await AsyncKubeClient().get_node(name)
    instance_id = parse_provider_id(node["spec"]["providerID"])[1]
    baseline = {"node": name, "start_requested_at": time.time(),
                "boot_id_before": node["status"]["nodeInfo"]["bootID"], "gpus_needed": 1,
                "resource_version_before": node["metadata"]["resourceVersion"]}
    registrations.started.add(name)
    await asyncio.to_thread(EcsHook().start_instances, [instance_id])
    deadline = baseline["start_requested_at"] + 120
    detectors = {"trigger (watch)": _trigger(baseline, deadline),
                 "window only (old rule)": _trigger(baseline, deadline, window_only=True)}
    for interval in INTERVALS:
        detectors[f"poll {interval:g}s"] = _poller(baseline, interval, rng.uniform(0, interval), deadline)
    detectors[READ_ONLY] = _poller(baseline, 5.0, rng.uniform(0, 5.0), deadline, replay=False)
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


def _scenario(workdir: Path, count: int, seed: int, faults: dict) -> dict:
    from simcloud.harness import small_fleet

    fleet = small_fleet([{"name": "gpu", "instance_type": T4, "status": "Stopped", "count": count}],
                        timings=TIMINGS, faults=faults)
    with local_cloud(fleet, workdir):
        results = asyncio.run(_run(count, stagger=min(30.0, count * 0.6), seed=seed))
    detectors = list(results[0]["fired_at"])

    def lags(detector: str, path: str | None = None) -> list[float]:
        return [r["fired_at"][detector][0] - r["registered_at"] for r in results
                if r["fired_at"][detector] is not None and r["registered_at"] is not None
                and (path is None or r["fired_at"][detector][1] == path)]
    paths = {d: sorted({r["fired_at"][d][1] for r in results if r["fired_at"][d] is not None}) for d in detectors}
    return {
        "faults": faults,
        "lag_seconds": {d: stats(lags(d)) for d in detectors},
        "lag_seconds_by_path": {d: {p: stats(lags(d, p)) for p in paths[d]} for d in detectors},
        "fired_before_registration": {d: sum(1 for x in lags(d) if x < 0) for d in detectors},
        "fired_before_registration_by_path": {d: {p: sum(1 for x in lags(d, p) if x < 0) for p in paths[d]}
                                              for d in detectors},
        "missed": {d: sum(1 for r in results if r["fired_at"][d] is None) for d in detectors},
        "registration_unseen": sum(1 for r in results if r["registered_at"] is None),
        "per_boot": results,
    }


def run(workdir: Path, quick: bool = False, boots: int = 50, seed: int = 1) -> dict:
    count = min(boots, 8) if quick else boots
    scenarios = {name: _scenario(workdir / f"cloud-{i}", count, seed, faults)
                 for i, (name, faults) in enumerate(SCENARIOS.items())}
    return {
        "boots": count, "settle_seconds": SETTLE, "fallback_seconds": FALLBACK, "timings": TIMINGS,
        "scenarios": scenarios,
        "notes": [
            "Registration time: a separate watch on all Nodes, first real GPU count after the boot's zero.",
            ("Paths: 'reset seen' = the fast path (every needed count seen at 0 after the start, then covering the "
            f"request: no window); 'fallback' = the zero was not seen, the count held for the fallback window "
            f"({FALLBACK:g} s here, 60 s by default)."),
            ("Pollers replay the Node's writes since their last read (a 1 s watch from it), like the poke-mode "
            f"GpuReadySensor, into the same ReadinessTracker; '{READ_ONLY}' reads the Node only (no replay, as "
            "after a re-list); all detectors run in one process."),
            f"kubelet heartbeat every {TIMINGS['heartbeat_seconds']:g} s (kubelet default nodeStatusUpdateFrequency).",
            ("window only (old rule) = the trigger with the rule before the reset was required (fresh status, "
            "Ready and the count held for the settle window), kept as a control: it fires early when the reset "
            "comes later than the window."),
            ("early = fired before the real count was registered (the pod would fail admission); missed = "
            "never fired within 120 s."),
        ],
    }

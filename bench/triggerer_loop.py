"""The triggerer's event loop while readiness triggers wait: how long did anything block it?

One triggerer runs every waiting job's trigger on one asyncio loop, so a trigger that blocks it
for a second delays every other job's readiness by a second. `probe()` runs N
`NodeGpuReadyTrigger`s at once in a fresh process (as a triggerer starts: nothing of the
Kubernetes clients imported yet) under asyncio's debug mode (slow_callback_duration = the
threshold; its "Executing ... took" warnings are kept) and times every callback the loop runs
twice: the CPU the loop thread spent in it (`time.thread_time`, less the garbage collector's
share, timed through `gc.callbacks`) and its wall time.

That CPU is the trigger's own work on the loop (imports, kubeconfig parsing, TLS contexts): what a
test can blame on the trigger. Wall time also counts the OS running other processes on a busy
2-core machine (CI saw a 0.225 s "callback" of the heartbeat below, whose code only sleeps), and a
full collection (0.2 s in this process, seen landing in a bare timer's callback) measures the
process's heap, not a call the trigger made. Both are reported; wall time counts as blocking only
past `WAIT_LIMIT`, the length of a real blocking wait (a synchronous API call on the loop).

A heartbeat measures how late the loop wakes it, as the triggerer's own "async thread was blocked"
watchdog does. The test (tests/integration/test_trigger_loop.py) fails on any blocking
callback; the bench part reports the worst while 100 triggers wait.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from .common import Sampler, local_cloud

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT = 0.01
WAIT_LIMIT = 1.0  # wall seconds: a blocking wait, not the OS scheduling another process


async def _heartbeat(worst: list[float], stop: asyncio.Event) -> None:
    """worst = [lag s, perf_counter when that sleep began, when it ended]."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        began, at = loop.time(), time.perf_counter()
        await asyncio.sleep(HEARTBEAT)
        lag = loop.time() - began - HEARTBEAT
        if lag > worst[0]:
            worst[:] = [lag, at, time.perf_counter()]


async def _run_all(specs: list[dict], threshold: float) -> dict:
    from gpuboot.triggers.gpu_ready import NodeGpuReadyTrigger

    asyncio.get_running_loop().slow_callback_duration = threshold
    worst, stop = [0.0, 0.0, 0.0], asyncio.Event()
    beat = asyncio.create_task(_heartbeat(worst, stop))
    began, cpu_began, perf_began = time.time(), time.thread_time(), time.perf_counter()

    async def one(spec: dict) -> dict:
        event = await NodeGpuReadyTrigger(**spec).run().__anext__()
        return {**{k: event.payload.get(k) for k in ("status", "node", "reason")}, "fired_after_s": time.time() - began}

    events = await asyncio.gather(*(one(s) for s in specs))
    loop_cpu = time.thread_time() - cpu_began
    stop.set()
    await beat
    return {"events": events, "heartbeat_worst_lag_s": round(worst[0], 4), "heartbeat_worst_window": worst[1:],
            "heartbeat_worst_at_s": round(worst[1] - perf_began, 3),
            "loop_cpu_s": round(loop_cpu, 3)}


def probe(specs: list[dict], threshold: float = 0.1, debug: bool = True) -> dict:
    """Run the triggers of `specs` (NodeGpuReadyTrigger keyword arguments) at once, in this process;
    every callback that used more than `threshold` s of loop-thread CPU or waited past WAIT_LIMIT,
    and the heartbeat's worst lag, with what the loop ran while the heartbeat waited that long.

    `debug` runs the loop in asyncio's debug mode, as the test does: it also checks that nothing
    calls the loop from another thread, but it records a stack for every callback scheduled, which
    costs the loop about 2 ms per trigger step here and so inflates a burst of steps (100 triggers
    firing together) well past what a triggerer, never in debug mode, spends."""
    slow: list[dict] = []
    warnings: list[str] = []
    run_handle = asyncio.events.Handle._run

    class DebugWarnings(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Executing"):
                warnings.append(record.getMessage()[:600])

    loop_thread, collected, gc_began = threading.get_ident(), [0.0], [0.0]

    def gc_timer(phase: str, info: dict) -> None:
        if threading.get_ident() == loop_thread:
            if phase == "start":
                gc_began[0] = time.thread_time()
            else:
                collected[0] += time.thread_time() - gc_began[0]

    # (began, wall s, callback) of every callback run: the callback, not its Handle, which in debug
    # mode carries a stack that would otherwise be kept alive (and walked by every collection)
    ran: list[tuple[float, float, object]] = []

    def timed_run(handle: asyncio.events.Handle) -> None:
        began, cpu, gc_cpu = time.perf_counter(), time.thread_time(), collected[0]
        run_handle(handle)
        wall, cpu, gc_cpu = time.perf_counter() - began, time.thread_time() - cpu, collected[0] - gc_cpu
        ran.append((began, wall, handle._callback))
        if wall > threshold:
            slow.append({"callback": repr(handle)[:600], "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                         "gc_s": round(gc_cpu, 4)})

    asyncio.events.Handle._run = timed_run  # every Handle and TimerHandle the loop runs (this process only)
    debug_warnings = DebugWarnings(logging.WARNING)
    logging.getLogger("asyncio").addHandler(debug_warnings)
    gc.callbacks.append(gc_timer)
    try:
        result = asyncio.run(_run_all(specs, threshold), debug=debug)
    finally:                                # a probe leaves the process as it found it
        asyncio.events.Handle._run = run_handle
        gc.callbacks.remove(gc_timer)
        logging.getLogger("asyncio").removeHandler(debug_warnings)
    blocking = [s for s in slow if s["cpu_s"] - s["gc_s"] > threshold or s["wall_s"] > WAIT_LIMIT]
    start, end = result.pop("heartbeat_worst_window")
    inside = [(wall, callback) for began, wall, callback in ran if start <= began <= end]
    by_kind: dict[str, list[float]] = {}
    for wall, callback in inside:
        by_kind.setdefault(_kind(callback), []).append(wall)
    result["worst_lag_window"] = {       # what the loop ran while the heartbeat waited its worst
        "callbacks": len(inside), "callbacks_wall_s": round(sum(w for w, _ in inside), 4),
        "by_kind": sorted(([k, len(v), round(sum(v), 4)] for k, v in by_kind.items()), key=lambda r: -r[2])[:8]}
    return {**result, "threshold_s": threshold, "wait_limit_s": WAIT_LIMIT, "slow_callbacks": slow,
            "blocking_callbacks": blocking, "debug_warnings": warnings,
            "worst_callback_cpu_s": max((s["cpu_s"] for s in slow), default=None),
            "worst_callback_wall_s": max((s["wall_s"] for s in slow), default=None),
            "worst_gc_s": max((s["gc_s"] for s in slow), default=None)}


def _kind(callback) -> str:
    """What a callback runs, without its arguments: a task's coroutine name, else the function's."""
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
    return getattr(callback, "__qualname__", repr(callback))[:120]


def probe_in_fresh_process(specs: list[dict], threshold: float = 0.1, timeout: float = 600,
                           debug: bool = True, warm: bool = False) -> dict:
    """`probe` in a new interpreter with this process's environment (connections included), the way
    a triggerer meets its first trigger: only Airflow's trigger base and the trigger module imported,
    and with `warm` gpuboot's warm-up done too, as the plugin does when a triggerer starts."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "plugins"), str(REPO)]))
    done = subprocess.run([sys.executable, "-m", "bench.triggerer_loop"], input=json.dumps(
        {"specs": specs, "threshold": threshold, "debug": debug, "warm": warm}), capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
        check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loop probe failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith('{"events"')))


def boot_specs(cloud, nodes: list[str], per_node: int, timeout: float, settle: float) -> list[dict]:
    """Start the stopped `nodes` (baselines read first, as the start step does) and return trigger
    arguments for `per_node` triggers on each."""
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.hooks.kube import KubeClient

    kube = KubeClient()
    before = {n: kube.get_node(n) for n in nodes}
    started = time.time()
    EcsHook().start_instances([cloud.instance_id(n) for n in nodes])
    specs = []
    for name, node in before.items():
        baseline = {"node": name, "start_requested_at": started, "gpus_needed": 1,
                    "boot_id_before": node["status"]["nodeInfo"]["bootID"],
                    "resource_version_before": node["metadata"]["resourceVersion"]}
        specs += [{"baseline": baseline, "deadline": started + timeout, "settle_seconds": settle}] * per_node
    return specs


T4 = "ecs.gn6i-c4g1.xlarge"


class PeakNodeWatches(Sampler):
    """The most Node watches the local cloud's API served at once inside `with` (sampled every
    0.1 s); those already open at the start (the harness's own) are left out of `now()` and `peak`."""

    def __init__(self, cloud):
        super().__init__()
        self.cloud, self.peak = cloud, 0
        self._base = self._open()

    def _open(self) -> int:
        return self.cloud.state().get("watches", {}).get("nodes", 0)

    def now(self) -> int:
        return self._open() - self._base

    def sample(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.now())


def run(workdir: Path, quick: bool = False, triggers: int = 100) -> dict:
    """`triggers` readiness triggers waiting at once on one loop (10 per booting node), three times:
    in a triggerer warmed by gpuboot.ui.warmup (as the plugin starts one), in a cold one (the first
    trigger imports the clients), and cold in asyncio's debug mode, as the test runs it (see `probe`)."""
    from simcloud.harness import small_fleet, wait_until

    triggers = 20 if quick else triggers
    per_node = 10
    count = max(1, triggers // per_node)
    modes = {"warm": (False, True), "cold": (False, False), "cold-debug": (True, False)}
    nodes = {mode: [f"gpu-{mode}-{i}" for i in range(count)] for mode in modes}
    fleet = small_fleet([{"name": n, "instance_type": T4, "status": "Stopped"} for names in nodes.values() for n in names],
                        timings={"start_seconds": 1.0, "boot_seconds": 3.0, "stale_seconds": 1.0,
                                 "device_plugin_seconds": 2.0})
    rows = []
    with local_cloud(fleet, workdir / "cloud") as cloud:
        def open_watches() -> int:
            return cloud.state().get("watches", {}).get("nodes", 0)

        idle = open_watches()            # the harness's own
        for mode, (debug, warm) in modes.items():
            wait_until(lambda: open_watches() <= idle, timeout=60, interval=0.1,
                       message="the last run's Node watches did not close")   # so each run counts only its own
            specs = boot_specs(cloud, nodes[mode], per_node, timeout=300, settle=5.0)
            with PeakNodeWatches(cloud) as watches:
                result = probe_in_fresh_process(specs, threshold=0.1, debug=debug, warm=warm)
            fired = [e["fired_after_s"] for e in result["events"]]
            rows.append({
                "loop": mode, "triggers": len(specs), "nodes": count,
                "ready": sum(e["status"] == "ready" for e in result["events"]),
                "blocking_callbacks": len(result["blocking_callbacks"]), "slow_callbacks": len(result["slow_callbacks"]),
                "worst_callback_cpu_s": result["worst_callback_cpu_s"],
                "worst_callback_wall_s": result["worst_callback_wall_s"], "worst_gc_s": result["worst_gc_s"],
                "heartbeat_worst_lag_s": result["heartbeat_worst_lag_s"], "loop_cpu_s": result.get("loop_cpu_s"),
                "peak_node_watches": watches.peak, "heartbeat_worst_at_s": result.get("heartbeat_worst_at_s"),
                "worst_lag_window": result.get("worst_lag_window"),
                "last_fired_after_s": round(max(fired), 2) if fired else None,
                "slowest": sorted(result["slow_callbacks"], key=lambda s: -s["cpu_s"])[:5]})
    return {"load_average_1m": round(os.getloadavg()[0], 1), "threshold_s": 0.1, "wait_limit_s": WAIT_LIMIT,
            "runs": rows}


if __name__ == "__main__":
    import airflow.triggers.base  # noqa: F401  (a triggerer has Airflow loaded before any trigger runs)

    import gpuboot.triggers.gpu_ready  # noqa: F401  (and the trigger's module, imported by its class path)

    request = json.loads(sys.stdin.read())
    if request["warm"]:
        from gpuboot.ui.warmup import warm
        warm()
    print(json.dumps(probe(request["specs"], request["threshold"], request["debug"])))

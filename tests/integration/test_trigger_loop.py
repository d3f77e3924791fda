"""NodeGpuReadyTrigger never blocks the triggerer's event loop.

A triggerer runs every waiting job's trigger on one loop: a trigger that blocks it for seconds
(the Kubernetes clients imported, the connection and kubeconfig read, TLS contexts built on the
loop) delays every other job's readiness by as much. The trigger runs here through a real boot in
the local cloud, in a fresh interpreter (as a triggerer meets its first trigger), under asyncio's
debug mode with slow_callback_duration=0.1 s, and with every loop callback timed: one that spends more than 0.1 s of the loop thread's CPU (garbage collection
aside), or waits more than a second, fails the test (bench/triggerer_loop.py says why CPU, not
wall time, below a second, and why not the collector's pauses)."""
from __future__ import annotations

import pytest

from bench.triggerer_loop import boot_specs, probe_in_fresh_process
from tests.integration.conftest import SETTLE_SECONDS


def test_the_readiness_trigger_never_blocks_the_loop_through_a_boot(cloud):
    specs = boot_specs(cloud, ["gpu-stop", "gpu2-stop"], per_node=2, timeout=120, settle=SETTLE_SECONDS)
    result = probe_in_fresh_process(specs, threshold=0.1)
    assert [e["status"] for e in result["events"]] == ["ready"] * 4, result["events"]
    assert result["blocking_callbacks"] == [], "\n".join(map(str, result["blocking_callbacks"]))
    # every debug-mode warning is a callback the probe timed (and judged above by its CPU)
    assert len(result["debug_warnings"]) <= len(result["slow_callbacks"]), result["debug_warnings"]


@pytest.mark.simcloud_only(reason="slows the API with k8s_latency_ms, a fault of simcloud's own API server")
def test_the_probe_catches_a_trigger_that_computes_or_waits_on_the_loop(cloud, monkeypatch):
    """The check above can fail: a trigger that burns 0.3 s of CPU on the loop, or makes a synchronous
    Kubernetes call there (the local cloud answering after 1.2 s), is caught."""
    import time

    from bench.triggerer_loop import probe
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.triggers.gpu_ready import NodeGpuReadyTrigger

    kube = KubeClient()             # built here: the trigger below only waits on its call

    class Fired:
        payload = {"status": "ready", "node": "gpu-stop", "reason": ""}

    async def computes(self):
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        yield Fired()

    async def waits(self):
        kube.get_node("gpu-stop")   # the bug this catches: a blocking API call on the loop
        yield Fired()

    spec = {"baseline": {"node": "gpu-stop"}, "deadline": 0}
    for run, field, latency_ms in ((computes, "cpu_s", 0), (waits, "wall_s", 1200)):
        monkeypatch.setattr(NodeGpuReadyTrigger, "run", run)
        cloud.set_faults(k8s_latency_ms=latency_ms)
        try:
            blocking = probe([spec], threshold=0.1)["blocking_callbacks"]
        finally:
            cloud.set_faults(k8s_latency_ms=0)
        assert len(blocking) == 1 and blocking[0][field] > 0.25, (run.__name__, blocking)

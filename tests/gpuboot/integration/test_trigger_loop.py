"""NodeGpuReadyTrigger never blocks the triggerer's event loop.

A triggerer runs every waiting job's trigger on one loop: a trigger that blocks it for seconds
(the Kubernetes clients imported, the connection and kubeconfig read, TLS contexts built on the
loop) delays every other job's readiness by as much. The trigger runs here through a real boot in
the local cloud, in a fresh interpreter (as a triggerer meets its first trigger), under asyncio's
debug mode with slow_callback_duration=0.1 s: any "Executing ... took" warning fails the test."""
from __future__ import annotations

from bench.triggerer_loop import boot_specs, probe_in_fresh_process

from .conftest import SETTLE_SECONDS


def test_the_readiness_trigger_never_blocks_the_loop_through_a_boot(cloud):
    specs = boot_specs(cloud, ["gpu-stop", "gpu2-stop"], per_node=2, timeout=120, settle=SETTLE_SECONDS)
    result = probe_in_fresh_process(specs, threshold=0.1)
    assert [e["status"] for e in result["events"]] == ["ready"] * 4, result["events"]
    assert result["slow_callbacks"] == [], "\n".join(result["slow_callbacks"])

"""Warms the triggerer: the Kubernetes clients NodeGpuReadyTrigger needs are imported before the
trigger runner is forked, so no trigger pays for them.

Importing them takes seconds (the provider's hooks pull in `kubernetes`, and kubernetes_asyncio
its models). Left to the first trigger of a fresh triggerer, that import lands after the trigger
has started, so the first run fires seconds after its GPUs are registered while the following
runs fire at once: a node already up when the job chose it, or a boot shorter than the import,
would wait for it. Done here, before the first trigger, nobody waits.

Airflow calls `on_starting` listeners while it builds a component's Job, before the triggerer
forks its runner (a bare fork on Linux, so the runner inherits every imported module). The
import runs in that call, not in a thread: a fork while another thread holds an import lock
leaves the child deadlocked on it. Other components (scheduler, dag-processor, API server) are
left alone; they would only carry the memory.

After the import the warm-up freezes the process's objects for the garbage collector (`warm`).
"""
from __future__ import annotations

import gc
import sys
import time

from airflow.listeners import hookimpl


def is_triggerer(argv: list[str]) -> bool:
    """`airflow triggerer ...`, as Airflow's CLI, the compose file and the Helm chart start it."""
    return len(argv) > 1 and argv[1] == "triggerer"


def warm() -> float:
    """Import the triggers' clients, then freeze what the process holds; return the seconds it took.

    Freezing (gc.freeze, after a collection) moves every object alive now out of the collector's
    reach. They are the loaded modules, classes and configuration, alive as long as the process.
    Left in, each full collection would walk them all, holding the loop (or the GIL) while every
    trigger waits: the loop's worst lag (`make bench BENCH_ARGS="--parts triggerer"`,
    docs/performance.md). Frozen, a collection walks only what was made since. Python's docs
    recommend the same before a fork, which this is: the runner forked after it shares the pages."""
    from gpuboot.hooks.kube import import_async_clients

    began = time.monotonic()
    import_async_clients()
    gc.collect()
    gc.freeze()
    return time.monotonic() - began


@hookimpl
def on_starting(component) -> None:
    if not is_triggerer(sys.argv):
        return
    component.log.info("gpuboot: Kubernetes clients for the readiness trigger imported (and the heap frozen "
                       "for the garbage collector) in %.1fs", warm())

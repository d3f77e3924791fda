"""A placer's idle cost (issue 33): what one placer leading an empty queue asks of the control plane.

The local cloud's CPU (the `python -m simcloud serve` process and every process under it: on the real
backend kube-apiserver, etcd, the scheduler and the controller-manager) is measured over a quiet window
on a 100-node fleet, first with no placer, then with a placer leading (`gpuboot.lifecycle.placer`, in
this process: its own CPU is this process's). The difference is the placer's cost to the control
plane: its polls of the queue shards and the ledger root every second, of the ledger's shards every
few seconds, its lease renewals and its watches. Linux only (/proc).
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from .common import export_connections, local_cloud
from .cpu import tree_cpu
from .placement_cost import fleet

NODES = 100
def _share(root: int, seconds: float) -> tuple[float, float]:
    """(the cloud's CPU, this process's CPU) over `seconds`, each in % of one core."""
    cloud0, me0, t0 = tree_cpu(root), time.process_time(), time.monotonic()
    time.sleep(seconds)      # the measured window itself: nothing to wait for
    wall = time.monotonic() - t0
    return round(100 * (tree_cpu(root) - cloud0) / wall, 1), round(100 * (time.process_time() - me0) / wall, 1)


def run(workdir: Path, quick: bool = False) -> dict:
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.booking import Booker
    from gpuboot.lifecycle.ledger import QUEUE_SHARDS, RequestQueue, ReservationLedger
    from gpuboot.lifecycle.placer import Placer
    from gpuboot.lifecycle.view import ClusterView
    from simcloud.harness import wait_until

    window = 20.0 if quick else 60.0
    with local_cloud(fleet(NODES), workdir / "cloud", ready_timeout=600) as cloud:
        root = cloud.process.pid
        # the placer as the ServiceAccount deploy/kubernetes/rbac.yaml makes for it, queued by flowcontrol.yaml
        # where the API server has priority and fairness: as deployed, and as the burst bench runs it
        export_connections(cloud.placer_connections())
        flow_control = cloud.apply_flow_control()
        time.sleep(window / 4)          # let the fleet's start-up writes pass before the first window
        without, _ = _share(root, window)
        log = logging.getLogger("bench.placer_idle")
        kube, ecs = KubeClient(), EcsHook()
        ledger = ReservationLedger(kube)
        placer = Placer(Booker(kube, ecs, ledger, log), ClusterView(kube, ecs, log=log), name="idle")
        stop = threading.Event()
        thread = threading.Thread(target=placer.run, args=(stop,), daemon=True)
        thread.start()
        try:
            # leading (its view started) and the lease's first copies written: every queue shard made
            queue = RequestQueue(kube)
            wait_until(lambda: ledger.snapshot().batch.led_by(time.time()) == placer.me
                       and all(kube.read_configmap(queue.namespace, name) for name in queue.shards), timeout=120,
                       message="the placer leading, its queue shards made")
            with_placer, placer_cpu = _share(root, window)
        finally:
            stop.set()
            thread.join(30)
    return {"nodes": NODES, "window_s": window, "placer_as": "ServiceAccount gpuboot-placer",
            "flow_control": flow_control, "queue_shards": QUEUE_SHARDS, "ledger_shards": ledger.shards,
            "cloud_cpu_pct_without_placer": without, "cloud_cpu_pct_with_placer": with_placer,
            "placer_cost_to_cloud_pct": round(with_placer - without, 1), "placer_cpu_pct": placer_cpu}

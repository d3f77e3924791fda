"""The placer: a long-lived process that leads every batch from a watch-fed view of the cluster.

Where placement decisions live. Place steps are Airflow tasks in short-lived worker processes;
a view fed by watches needs a process that outlives them. The placer is that process, run next to
the triggerer (`python -m gpuboot.lifecycle.placer`, docs/operations.md): it holds the batch lease
of `gpuboot.lifecycle.batching` for as long as it lives and answers every queued first placement
from its `gpuboot.lifecycle.view.ClusterView`, so a placement in steady state reads no LIST.
The place steps do not change: they queue, wait for an answer and log it (or defer on
contention) as they did; when no placer runs they lead themselves with full reads, as before.
Not in the triggerer itself: a trigger belongs to one deferred task, is re-created by whichever
triggerer picks it up, and runs on one event loop shared by every trigger, where seconds of
placement CPU on a 10,000-node fleet would delay every readiness watch.

Several placers (HA). Each keeps its own view; one holds the lease (a compare-and-swap on the
ledger), the others check it every LEASE_CHECK_SECONDS and one of them takes it over when it
expires (a placer killed or partitioned: PLACER_LEASE_SECONDS). Two placers can never both commit a batch
on the same ledger state: each batch write is compare-and-swapped against the ledger it was
planned from, the lease only says who should try.

Keeping the lease. A thread renews it when less than two thirds of it are left (one small write of
the ledger root, and its copy in the queue shards: `BatchPlacer.renew`), whatever the placer is
doing: one round of a batch on 10,000 nodes (its view re-listing 80,000 pods after a 410, every
instance described again) can take longer than the lease, and a lapsed lease hands the queue to a
place step, which leads with full reads of the cluster. A placer's lease is twice a place step's
(PLACER_LEASE_SECONDS): on the real control plane a thousand waiters queueing at once made one
renewal take 15-17 s, and a lease lapsed then sent place steps to lead with full reads under that
same load (343 of 1,000 jobs failed on 504s in one run); a dead placer costs its waiters 30 s. A
renewal races a batch commit harmlessly: both are compare-and-swaps of the root, and a commit
meeting a root that only its own renewal changed goes through (`ReservationLedger._put_root`). The thread renews only while the placer's loop comes round (within
STUCK_SECONDS): a placer stuck for good lets its lease lapse, and its waiters, who wait only while
a lease is live, elect another. A placer starved of CPU for
longer than the lease still loses it: it says so.

A restart. A new placer lists Nodes and pods once (its view is empty), then leads; a placer that
restarts while holding the lease waits for it to expire (its identity is new).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import threading
import uuid

from gpuboot.lifecycle.batching import LEASE_CHECK_SECONDS, LEASE_SECONDS, BatchPlacer, latest_per_job
from gpuboot.lifecycle.booking import Booker
from gpuboot.lifecycle.view import ClusterView

POLL_SECONDS = 1.0          # how often the lease holder looks at the queue when idle (every queue shard: 64 GETs)
NOTE_SECONDS = LEASE_CHECK_SECONDS  # and, when idle, at the ledger's shards for its view (64 GETs): a write the
                                    # view does not note only makes its next basis count more releases
PLACER_LEASE_SECONDS = 2 * LEASE_SECONDS    # a placer's lease (module doc, "Keeping the lease")
RENEW_SECONDS = LEASE_SECONDS / 5   # how often the lease thread looks (it renews at two thirds left)
STUCK_SECONDS = 120         # a placer whose loop has not come round for this long lets its lease lapse


class Placer:
    """Lead the batches of `booker`'s ledger from `view` until stopped (module doc)."""

    def __init__(self, booker: Booker, view: ClusterView, name: str | None = None,
                 poll_seconds: float = POLL_SECONDS) -> None:
        self.booker, self.view, self.poll_seconds = booker, view, poll_seconds
        self.me = f"placer-{name or socket.gethostname()}-{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.batcher = BatchPlacer(booker, None, PLACER_LEASE_SECONDS)   # type: ignore[arg-type]  # no spec read
        self.log = booker.log
        self.led = False        # held the lease at the last look

    def run(self, stop: threading.Event) -> None:
        """Start the view, then lead whenever the lease is free or ours; stand by while another holds it."""
        b, ledger = self.booker, self.booker.ledger
        self.view.start()
        keeper = threading.Thread(target=self._keep_lease, args=(stop,), name="gpuboot-placer-lease", daemon=True)
        keeper.start()
        self.view.basis(ledger.name, ledger.snapshot(), b.clock())    # instances described, inventory built
        self.log.info("placer %s: view ready (%d nodes, %d pods); leading ledger %s", self.me,
                      len(self.view.nodes.items), len(self.view.pods.items), ledger.identity)
        noted = -math.inf
        while not stop.is_set():
            self.batcher.alive_at = b.monotonic()
            try:
                state = ledger.snapshot()
                now = b.clock()
                leader = state.batch.led_by(now)
                if leader not in (None, self.me):
                    if self.led or self.batcher.lost_to:
                        self.log.warning("placer %s: %s leads now (our lease ran out: was this process starved "
                                         "of CPU, or the API server too slow to renew it, for %.0f s?); standing by",
                                         self.me, leader, self.batcher.lease_seconds * 2 / 3)
                    self.led, self.batcher.lost_to = False, None
                    # standing by: another placer (or a place step) leads; look again when its lease would lapse
                    stop.wait(min(LEASE_CHECK_SECONDS, max(0.1, state.batch.lease_until - now + 0.1)))
                    continue
                self.led = leader == self.me
                taking = leader is None or state.batch.lease_until - now < self.batcher.lease_seconds * 2 / 3
                if taking and not self.batcher._take_lease(state, self.me):
                    continue                            # someone wrote meanwhile: look again
                if latest_per_job(self.batcher.queue.waiting(d.ticket for d in state.batch.decided)):
                    # the read it leads from, unless taking the lease has just moved the root past it
                    self.batcher.lead(self.me, view=self.view, stay=True, state=None if taking else state)
                    continue
                if b.monotonic() - noted >= NOTE_SECONDS:
                    self.view.note(ledger.name, state)  # idle: the view keeps up with the ledger's writes
                    noted = b.monotonic()
                stop.wait(self.poll_seconds)
            except Exception:  # the loop outlives any one failure (API down, ECS throttled): log and go on
                self.log.exception("placer %s: a round failed; trying again", self.me)
                stop.wait(LEASE_CHECK_SECONDS)
        keeper.join(RENEW_SECONDS + 5)
        self.view.stop()

    def _keep_lease(self, stop: threading.Event) -> None:
        """Renew the lease while this placer holds it and its loop comes round (module doc, "Keeping the lease")."""
        while not stop.wait(RENEW_SECONDS):
            if self.booker.monotonic() - self.batcher.alive_at > STUCK_SECONDS:
                continue
            began = self.booker.monotonic()
            try:
                self.batcher.renew(self.me)
            except Exception as exc:  # the next look tries again; the loop reports lasting failures
                self.log.warning("placer %s: renewing the lease failed (%s: %s)", self.me, type(exc).__name__, exc)
            took = self.booker.monotonic() - began
            if took > RENEW_SECONDS:
                self.log.warning("placer %s: renewing the lease took %.1f s (the API server is slow, or this process "
                                 "starved of CPU): it lapses after %.0f s", self.me, took, self.batcher.lease_seconds)


def main(argv: list[str] | None = None) -> int:
    """`python -m gpuboot.lifecycle.placer`: a placer on the Airflow connections named."""
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.ledger import ReservationLedger

    p = argparse.ArgumentParser(prog="python -m gpuboot.lifecycle.placer", description=__doc__.split("\n")[0])
    p.add_argument("--kubernetes-conn-id", default="kubernetes_default")
    p.add_argument("--ecs-conn-id", default="alibaba_ecs_default")
    p.add_argument("--ledger-namespace", default="default", help="the place steps' ledger_namespace")
    p.add_argument("--boot-grace-seconds", type=float, default=900)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("gpuboot.placer")
    kube, ecs = KubeClient(args.kubernetes_conn_id), EcsHook(args.ecs_conn_id)
    booker = Booker(kube, ecs, ReservationLedger(kube, args.ledger_namespace), log,
                    boot_grace_seconds=args.boot_grace_seconds)
    view = ClusterView(kube, ecs, boot_grace_seconds=args.boot_grace_seconds, log=log)
    stop = threading.Event()
    try:
        Placer(booker, view).run(stop)
    except KeyboardInterrupt:
        stop.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

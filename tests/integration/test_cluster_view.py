"""The watch-fed cluster view and the placer (gpuboot.lifecycle.view, gpuboot.lifecycle.placer) on the
local cloud's API server through the real client: the view follows pod writes, covers the ledger
writes its pod stream has passed, re-lists after a compaction (open watches ended, resume answered
410 Gone), and a restarted placer (a new process: a new identity, an empty view) takes the lease
over once the dead one's expires and answers from its view with no full read, the placers acting as
the ServiceAccount deploy/kubernetes/rbac.yaml makes for them and the place step as the steps' one
(a right missing from either fails here).
tests/unit/gpuboot/lifecycle/test_view.py scripts the streams (staleness, dropped connections);
tests/stress/test_burst.py runs a burst through two placers, the leading one killed."""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from gpuboot.core.model import LABEL_JOB, LABEL_TASK
from gpuboot.exceptions import NotPermitted
from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.batching import book_first
from gpuboot.lifecycle.booking import Booker
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.lifecycle.placer import PLACER_LEASE_SECONDS, Placer
from gpuboot.lifecycle.view import ClusterView
from simcloud.harness import wait_until
from tests.unit.gpuboot.lifecycle.test_batching import spec

LOG = logging.getLogger("test-cluster-view")


def bound_pod(name: str, node: str, job: str, gpus: int = 1) -> dict:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {"cpu": "100m"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {LABEL_JOB: job, LABEL_TASK: "main"}},
            "spec": {"nodeName": node, "restartPolicy": "Never",
                     "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", "sleep 600"],
                                     "resources": {"requests": limits, "limits": limits}}]}}


def test_the_view_follows_writes_covers_the_ledger_and_relists_after_a_compaction(cloud):
    kube, ecs = KubeClient(), EcsHook()
    ledger = ReservationLedger(kube)
    view = ClusterView(kube, ecs, log=LOG).start(timeout=60)
    try:
        core = cloud.core_v1()
        core.create_namespaced_pod("default", bound_pod("a-main", "gpu-run", "a"))
        # Running: the kubelet has written its last status of the pod, so no pod write can land between the
        # ConfigMap below and the compaction and carry the pod stream past the compacted version (no 410)
        assert wait_until(lambda: (view.pods.items.get("default/a-main") or {}).get("status", {}).get("phase")
                          == "Running", timeout=30)
        ledger.release("nobody")                        # a ledger write after the pod's
        state = ledger.snapshot()
        basis, released = view.basis(ledger.name, state, time.time(), fresh=True)
        assert basis.seq == state.seq and released == []
        assert next(v for v in basis.survey.views if v.name == "gpu-run").free.gpus == 0
        lists = view.pods.lists
        core.create_namespaced_config_map("default", {"metadata": {"name": "after-the-pods"}})   # the store moves on
        cloud.compact()                                 # open watches end; resuming from before is 410 Gone
        core.create_namespaced_pod("default", bound_pod("b-main", "cpu-1", "b", gpus=0))
        assert wait_until(lambda: view.pods.lists > lists and "default/b-main" in view.pods.items, timeout=30)
        assert view.pods.gone >= 1 and "default/a-main" in view.pods.items
        core.delete_namespaced_pod("a-main", "default", grace_period_seconds=0)
        assert wait_until(lambda: "default/a-main" not in view.pods.items, timeout=30)
    finally:
        view.stop()


def placer(name: str, conn_id: str = "kubernetes_default") -> tuple[Placer, threading.Event, threading.Thread]:
    kube, ecs = KubeClient(conn_id), EcsHook()
    log = logging.getLogger(f"placer.{name}")
    p = Placer(Booker(kube, ecs, ReservationLedger(kube), log), ClusterView(kube, ecs, log=log), name=name)
    stop = threading.Event()
    thread = threading.Thread(target=p.run, args=(stop,), daemon=True)
    thread.start()
    return p, stop, thread


def acting_as(connections, conn_id: str, monkeypatch) -> str:
    """Airflow connection `conn_id`: the kubernetes_default of a ServiceAccount's connections file."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}",
                       json.dumps(json.loads(connections.read_text())["kubernetes_default"]))
    return conn_id


def test_a_restarted_placer_takes_the_lease_over_and_answers_from_its_view(cloud, monkeypatch):
    kube = KubeClient()
    ledger = ReservationLedger(kube)
    as_placer = acting_as(cloud.placer_connections(), "kubernetes_placer", monkeypatch)
    as_step = acting_as(cloud.gpuboot_connections(), "kubernetes_steps", monkeypatch)
    first, stop_first, thread = placer("first", as_placer)
    assert wait_until(lambda: ledger.snapshot().batch.led_by(time.time()) == first.me, timeout=60)
    stop_first.set()                                    # it dies holding the lease (no step-down)
    thread.join(30)
    dead_until = ledger.snapshot().batch.lease_until    # renewed at two thirds left: up to 30 s left
    second, stop_second, thread2 = placer("second", as_placer)
    try:
        assert wait_until(lambda: ledger.snapshot().batch.led_by(time.time()) == second.me, timeout=PLACER_LEASE_SECONDS + 30)
        taken_at = ledger.snapshot().batch.lease_until - PLACER_LEASE_SECONDS   # when it took (or renewed) it
        assert taken_at >= dead_until                   # not before the dead one's lease ran out
        steps_kube = KubeClient(as_step)
        step = Booker(steps_kube, EcsHook(), ReservationLedger(steps_kube), LOG)
        booking = book_first(step, spec("after-restart"), "after-restart")
        assert booking.plan.outcome.value == "fits", booking.plan.message
        assert step.full_reads == 0 and second.booker.full_reads == 0     # answered from the view
        # ... a view its watches kept (a watch the placer's ServiceAccount may not open fails and is retried,
        # which the answers alone would not show: the view then counts as read when it was listed)
        assert (second.view.nodes.resumes, second.view.pods.resumes) == (0, 0)
        assert ledger.snapshot().batch.answer is not None
    finally:
        stop_second.set()
        thread2.join(30)


def test_a_view_whose_identity_may_list_pods_but_not_watch_them_says_which_right_is_missing(cloud, monkeypatch,
                                                                                             caplog):
    """The place steps' ServiceAccount may list every pod (its full reads) but not watch them: a placer
    deployed under it by mistake gets 403 on the pod watch from the API server (simcloud's RBAC and the
    real one agree), which the hook names (`NotPermitted`) and the view logs as an error naming the right
    and the ClusterRole that grants it; the view stays disconnected (after a survey's age it gives no basis,
    tests/unit/gpuboot/lifecycle/test_view.py)."""
    kube = KubeClient(acting_as(cloud.gpuboot_connections(), "kubernetes_steps", monkeypatch))
    _, version = kube.list_versioned("pods")
    with pytest.raises(NotPermitted):
        next(iter(kube.stream_events("pods", version, 5)))
    view = ClusterView(kube, EcsHook(), log=LOG).start(timeout=60)
    try:
        assert wait_until(lambda: any("may not watch pods" in r.getMessage() and "gpuboot-placer" in r.getMessage()
                                      for r in caplog.records if r.levelno == logging.ERROR), timeout=30)
        assert not view.connected() and view.nodes.stale_since is None     # it may watch Nodes
    finally:
        view.stop()

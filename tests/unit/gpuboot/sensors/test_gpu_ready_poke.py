"""The wait step in poke mode (deferrable=False) on the in-memory fakes: each poke looks at the job
queue for the job's preemption record with the trigger's own PreemptionWatch, and a job preempted
while its node comes up is handed to its launch step as the deferred wait hands it."""
from __future__ import annotations

import logging

from airflow.sdk import PokeReturnValue

from gpuboot.core.placement import Outcome
from gpuboot.sensors.gpu_ready import GpuReadySensor, WaitState
from gpuboot.triggers.gpu_ready import PreemptionWatch
from tests.builders import step_context
from tests.fakes import T4X2, cloud
from tests.unit.gpuboot.lifecycle.test_preemption import LOW, boot_of, reserved, spec, turn


def test_a_poking_wait_learns_of_its_jobs_preemption_at_its_next_look_and_hands_the_job_to_launch(
        monkeypatch, capfd):
    c = cloud({"gpu2": ("Running", T4X2)})
    low = spec("low", **LOW)
    placed = turn(c, "low", low)
    assert placed.plan.outcome is Outcome.FITS
    up = boot_of(c, "low", low).ensure_up(placed.plan)                # its start step: the node was up
    sensor = GpuReadySensor(task_id="wait", baselines=up.baselines, job=low.to_dict(), plan=up.plan.to_json(),
                            deferrable=False, settle_seconds=600)     # never ready within this test
    monkeypatch.setattr(sensor, "kube", lambda: c.cluster)
    monkeypatch.setattr(c.cluster, "node_writes_since", lambda name, version: [], raising=False)   # none since
    sensor._start_poking(WaitState.of(up))
    ctx = step_context()
    assert sensor.poke(ctx) is False                                   # looked: not preempted; the node settles
    assert turn(c, "high", spec("high", priority_class="high")).plan.outcome is Outcome.FITS   # preempts "low"
    assert sensor.poke(ctx) is False                                   # not time to look at the queue again yet
    sensor._preemption.checked -= PreemptionWatch.POLL_SECONDS         # the trigger's 2 s have passed
    done = sensor.poke(ctx)
    assert isinstance(done, PokeReturnValue) and done.is_done and done.xcom_value == []
    out = capfd.readouterr().out                                       # the task log (Airflow's structlog)
    assert "job low was preempted by job high before its node(s) were up" in out
    assert "outranks low" in out and "its launch step requeues it (not failed)" in out
    assert ctx["ti"].pushed["plan"]["outcome"] == "busy"                # nothing more brought up
    assert reserved(c, "low") == [] and [r.job_id for r in c.ledger().live(c.clock())] == ["high"]


def test_a_poking_wait_that_cannot_read_the_queue_goes_on_with_its_node_reads(caplog):
    class Away:
        def read_configmap(self, namespace, name, cached=False):
            raise ConnectionError("connection refused")

    watch = PreemptionWatch(["default", "gpuboot-queue", "low"], "kubernetes_default")
    with caplog.at_level(logging.WARNING):
        assert watch.poked(Away(), 0.0, logging.getLogger("test")) is None
    assert "could not read the job queue default/gpuboot-queue (connection refused)" in caplog.text
    assert PreemptionWatch(None, "kubernetes_default").poked(Away(), 0.0, logging.getLogger("test")) is None




def test_a_poke_whose_version_expired_resumes_from_the_collections_version_not_the_nodes_own(monkeypatch):
    """A Node quiet for longer than the history: the poke's watch from the start's version is 410
    Gone, and the Node's own version (its last write, as old) would be Gone again at every later
    poke. The re-read takes the collection's version, where the next pokes' watches resume."""
    from gpuboot.hooks.kube import Gone

    c = cloud({"gpu2": ("Stopped", T4X2)})
    low = spec("low", **LOW)
    up = boot_of(c, "low", low).ensure_up(turn(c, "low", low).plan)     # its start step started the node
    sensor = GpuReadySensor(task_id="wait", baselines=up.baselines, job=low.to_dict(), plan=up.plan.to_json(),
                            deferrable=False, settle_seconds=600)     # never ready within this test
    kept: list[str] = []         # versions the server still keeps: the collection's, read from now on
    asked: list[str] = []
    read = c.cluster.node_to_watch

    def node_to_watch(name):
        node, version = read(name)
        kept.append(version)
        return node, version

    def node_writes_since(name, version):
        asked.append(version)
        if version not in kept:
            raise Gone("too old resource version")
        return []
    monkeypatch.setattr(sensor, "kube", lambda: c.cluster)
    monkeypatch.setattr(c.cluster, "node_to_watch", node_to_watch)
    monkeypatch.setattr(c.cluster, "node_writes_since", node_writes_since, raising=False)
    sensor._start_poking(WaitState.of(up))
    for _ in range(3):
        assert sensor.poke(step_context()) is False
    started_from = up.baselines[0]["resource_version_before"]
    assert started_from and len(kept) == 1 and asked == [started_from, kept[0], kept[0]], (asked, kept)

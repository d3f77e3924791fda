"""PowerWatch: how often the readiness trigger asks ECS whether the instance was stopped outside gpuboot;
PreemptionWatch: how soon it learns that its job was preempted."""
from __future__ import annotations

import asyncio

import pytest

from gpuboot.triggers.gpu_ready import PowerWatch, PreemptionWatch

T0 = 1_800_000_000.0
NODE = {"spec": {"providerID": "cn-hangzhou.i-abc"},
        "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}
READY = {**NODE, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture
def asked(monkeypatch) -> list[str]:
    calls: list[str] = []

    def status(watch):
        calls.append(watch.instance_id)
        return "Stopped"

    monkeypatch.setattr(PowerWatch, "_status", status)
    return calls


async def _node():
    return NODE


def test_ecs_is_not_asked_within_the_starts_grace_and_the_wait_is_never_zero_then(asked):
    watch = PowerWatch("ecs", T0, _node)
    assert watch.next_check_in(None, T0 + 1) == pytest.approx(PowerWatch.START_GRACE_SECONDS - 1)
    assert asyncio.run(watch.stopped_outside(None, T0 + 1)) is None and asked == []
    found = asyncio.run(watch.stopped_outside(None, T0 + PowerWatch.START_GRACE_SECONDS))   # no write yet: read it
    assert "i-abc is Stopped: stopped outside gpuboot" in found and asked == ["i-abc"]


def test_ecs_is_asked_often_while_the_node_is_not_ready_and_rarely_while_it_is(asked):
    watch = PowerWatch("ecs", None, _node)        # a node up when the job chose it: no start grace
    asyncio.run(watch.stopped_outside(READY, T0))
    assert watch.next_check_in(READY, T0) == PowerWatch.SLOW_SECONDS
    assert watch.next_check_in(NODE, T0) == PowerWatch.CHECK_SECONDS
    assert asyncio.run(watch.stopped_outside(NODE, T0 + 1)) is None and asked == ["i-abc"]


def test_without_an_ecs_connection_nothing_is_asked(asked):
    watch = PowerWatch(None, T0, _node)
    assert watch.next_check_in(NODE, T0 + 60) == float("inf")
    assert asyncio.run(watch.stopped_outside(NODE, T0 + 60)) is None and asked == []


def test_the_readiness_watch_learns_of_its_jobs_preemption_at_its_next_look_at_the_queue(monkeypatch):
    """PreemptionWatch on the fakes: the queue ConfigMap a real preemption wrote, read through the
    triggerer's shared read at most every POLL_SECONDS; no record, no event; no queue, no read."""
    from gpuboot.lifecycle.jobqueue import CONFIGMAP
    from gpuboot.triggers import gpu_ready
    from tests.fakes import T4X2, cloud
    from tests.unit.gpuboot.lifecycle.test_preemption import LOW, running, spec, turn

    c = cloud({"gpu2": ("Running", T4X2)})
    running(c, "low", spec("low", **LOW))
    reads: list[str] = []

    async def read_queue(conn, namespace, name, max_age):
        reads.append(name)
        return True, c.cluster.read_configmap(namespace, name)

    monkeypatch.setattr(gpu_ready, "read_queue", read_queue)
    watch = PreemptionWatch(["default", CONFIGMAP, "low"], "kubernetes_default")
    assert asyncio.run(watch.preempted(T0)) is None and reads == [CONFIGMAP]      # not preempted yet
    assert turn(c, "high", spec("high", priority_class="high")).plan.outcome.value == "fits"   # preempts "low"
    assert watch.next_check_in(T0 + 1) == pytest.approx(PreemptionWatch.POLL_SECONDS - 1)
    assert asyncio.run(watch.preempted(T0 + 1)) is None and len(reads) == 1        # not time to look yet
    record = asyncio.run(watch.preempted(T0 + PreemptionWatch.POLL_SECONDS))
    assert (record.job_id, record.by) == ("low", "high") and len(reads) == 2
    quiet = PreemptionWatch(None, "kubernetes_default")                            # the requeue's own waits
    assert quiet.next_check_in(T0) == float("inf") and asyncio.run(quiet.preempted(T0)) is None and len(reads) == 2

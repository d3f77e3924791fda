"""NodeGpuReadyTrigger against a real boot in the local cloud (stale -> 0 -> real GPUs).

The strong rule must not fire before the device plugin registered the real count (and,
having seen the kubelet's zero, fires then, on the fast path, with no window); a
deliberately weakened rule (Ready and GPU > 0) fires during the stale phase, and a GPU pod
bound at that moment fails admission, which is what proves the rule matters. The same
holds for each extended resource the job asks for: a rule watching only nvidia.com/gpu
commits a GPU-sharing pod (aliyun.com/gpu-mem) before its own plugin registered. The kubelet's reset may come long after the settle window,
in either boot order, and the watch may be cut and re-listed in the middle of the boot:
the trigger still never fires before the real count."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from gpuboot.core.readiness import READY, Readiness, Reason
from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import AsyncKubeClient, Gone, KubeClient
from gpuboot.triggers.gpu_ready import NodeGpuReadyTrigger
from simcloud.harness import SimCloud, small_fleet
from tests.integration.conftest import FLEET, expose_connections, wait_until
from tests.integration.conftest import SETTLE_SECONDS as SETTLE

NODE = "gpu-stop"


def gpus(node: dict, resource: str = "nvidia.com/gpu") -> str | None:
    return (node.get("status") or {}).get("allocatable", {}).get(resource)


def is_ready(node: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions") or [])


def instance_of(node: dict) -> str:
    return node["spec"]["providerID"].split(".", 1)[1]


class WeakTracker:
    """The first version's rule: Ready and allocatable GPU > 0, nothing else."""

    def lost_continuity(self, why: str) -> None:
        pass

    def observe(self, node: dict, now: float) -> Readiness:
        ok = is_ready(node) and int(gpus(node) or 0) > 0
        return Readiness(ok, (Reason(READY if ok else "Weak", "weak rule"),),
                         {"ready": is_ready(node), "gpus_allocatable": gpus(node)})

    def next_check_in(self, now: float) -> None:
        return None


class WeakTrigger(NodeGpuReadyTrigger):
    def make_tracker(self, continuous: bool):
        return WeakTracker()


def gpu_pod(name: str, node: str = NODE, resource: str = "nvidia.com/gpu", count: int = 1) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": node, "restartPolicy": "Never",
                     "containers": [{"name": "main", "image": "python:3.11",
                                     "command": ["python", "-c", "print('gpu ok')"],
                                     "resources": {"requests": {resource: str(count)},
                                                   "limits": {resource: str(count)}}}]}}


def pod_phase(kube: KubeClient, name: str) -> tuple[str, str | None]:
    status = kube.core.read_namespaced_pod(name, "default").status
    return status.phase, status.reason


async def boot_and_wait(trigger_cls, timeout: float = 30, settle: float = SETTLE, during_boot=None,
                        node: str = NODE, needs: dict | None = None, resource: str = "nvidia.com/gpu"):
    """Start the stopped node, run the trigger, and record every Node state seen meanwhile
    (the timeline's count is `resource`'s). `needs`: what the baseline asks for (default 1 GPU).

    `during_boot(timeline)`, if given, runs in a thread beside the trigger (e.g. to cut its watch)."""
    NODE = node
    needs = dict(needs or {"nvidia.com/gpu": 1})
    kube, watcher = KubeClient(), AsyncKubeClient()
    before, version_before = kube.node_to_watch(NODE)     # as the start step reads it
    timeline: list[tuple[float, bool, str | None, str]] = []
    recorded = [0]      # the newest resourceVersion the recorder has seen

    async def record():
        version = version_before
        while True:
            try:
                async with contextlib.aclosing(watcher.watch_node(NODE, version, 5)) as events:
                    async for _, node in events:
                        version = node["metadata"]["resourceVersion"]
                        recorded[0] = int(version)
                        timeline.append((time.time(), is_ready(node), gpus(node, resource),
                                         node["status"]["nodeInfo"]["bootID"]))
            except Gone:     # the test compacted the history: re-list (the recorder may miss writes then)
                version = None
            except Exception:   # the real API server restarting (compact) drops the connection: resume
                await asyncio.sleep(0.2)
                continue
            while version is None:
                try:
                    version = (await watcher.node_to_watch(NODE))[1]
                except Exception:
                    await asyncio.sleep(0.2)

    recorder = asyncio.create_task(record())
    started = time.time()
    outcome = await asyncio.to_thread(EcsHook().start_instances, [instance_of(before)])
    assert outcome[instance_of(before)].outcome == "done"
    trigger = trigger_cls(baseline={"node": NODE, "start_requested_at": started,
                                    "boot_id_before": before["status"]["nodeInfo"]["bootID"],
                                    "gpus_needed": needs.pop("nvidia.com/gpu", 0), "extended_needed": needs,
                                    "resource_version_before": version_before},
                          deadline=started + timeout, settle_seconds=settle)
    side = asyncio.create_task(asyncio.to_thread(during_boot, timeline)) if during_boot else None
    event = await trigger.run().__anext__()
    fired = time.time()
    # the fast path fires at the registering write itself: let the recorder's own watch reach it too
    seen_by_trigger = int((await watcher.get_node(NODE))["metadata"]["resourceVersion"])
    deadline = time.monotonic() + 15
    while recorded[0] < seen_by_trigger and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    recorder.cancel()
    await asyncio.gather(recorder, return_exceptions=True)
    if side is not None:
        await side
    return event.payload, fired, timeline, started


def test_trigger_waits_through_stale_and_zero_and_fires_on_the_fast_path(cloud):
    payload, fired, timeline, started = asyncio.run(boot_and_wait(NodeGpuReadyTrigger))
    assert payload["status"] == "ready", payload
    zero_seen = [t for t, _, g, _ in timeline if g == "0" and t > started]
    assert zero_seen and zero_seen[0] < fired, "must not fire before the kubelet zeroed the stale count"
    registered = min(t for t, _, g, _ in timeline if g == "1" and t > zero_seen[0])
    assert_not_before(fired, registered)
    # the zero was seen: no settle window held (how soon it fires is measured by `make bench`)
    evidence = payload["evidence"]
    assert (evidence["path"], evidence["held_seconds"], evidence["continuous"]) == ("reset seen", 0.0, True)
    assert "fast path" in payload["reason"]
    kube = KubeClient()
    kube.core.create_namespaced_pod("default", gpu_pod("after-strong"))
    phase, reason = wait_until(lambda: pod_phase(kube, "after-strong")[0] in ("Succeeded", "Failed")
                               and pod_phase(kube, "after-strong"), timeout=20)
    assert (phase, reason) == ("Succeeded", None)


def test_a_node_stopped_longer_than_the_watch_history_is_still_watched_through_its_reset(tmp_path, monkeypatch):
    """The Node's own resourceVersion (its last write, long ago on a stopped node) is compacted: a
    watch from it is 410 Gone, and the zero would go unseen (the fallback window). The start step
    takes the collection's version at its read instead, so the watch sees the whole boot."""
    # simcloud keeps 8 s of history (the real server's compaction: 5 min), more than the ~2 s from
    # the start read to the trigger's watch here, and less than the Node has been quiet at the read.
    short = {**FLEET, "timings": {**FLEET["timings"], "watch_history_seconds": 8}}
    with SimCloud.start(short, tmp_path / "simcloud") as sim:
        expose_connections(sim.connections_file, monkeypatch)
        kube = KubeClient()

        def own_version_compacted() -> bool:
            if sim.kube == "real":
                # The real API server keeps no timed history: compact etcd (and restart it) at every
                # look, since a write after the last compaction (the node-lifecycle controller marking
                # the stopped Node unreachable, late on a loaded machine) gives the Node a newer version.
                sim.compact()
            try:
                kube.node_writes_since(NODE, kube.get_node(NODE)["metadata"]["resourceVersion"])
            except Gone:
                return True
            return False
        wait_until(own_version_compacted, timeout=60, interval=0.5)
        payload, fired, timeline, started = asyncio.run(boot_and_wait(NodeGpuReadyTrigger))
    assert payload["status"] == "ready", payload
    evidence = payload["evidence"]
    assert (evidence["path"], evidence["continuous"]) == ("reset seen", True), evidence
    assert_not_before(fired, stale_then_real(timeline, started))


def test_trigger_fires_when_the_fallback_window_ends_not_at_a_later_node_change(tmp_path, monkeypatch):
    """A trigger that joins after the registration (no resourceVersion: the zero went unseen) holds
    the fallback window; with heartbeats an hour apart no Node event follows, so the trigger must
    wake itself when the window completes instead of waiting for the deadline."""
    quiet = {**FLEET, "timings": {**FLEET["timings"], "heartbeat_seconds": 3600}}
    with SimCloud.start(quiet, tmp_path / "simcloud") as sim:
        expose_connections(sim.connections_file, monkeypatch)
        kube = KubeClient()
        before = kube.get_node(NODE)
        started = time.time()
        EcsHook().start_instances([instance_of(before)])
        # the kubelet's own view: the device plugin registered (the Node shows 1 before that too: stale)
        wait_until(lambda: next(n for n in sim.state()["nodes"] if n["name"] == NODE)["registered_gpus"] == 1
                   and is_ready(kube.get_node(NODE)), timeout=30)
        joined = time.time()
        trigger = NodeGpuReadyTrigger(baseline={"node": NODE, "start_requested_at": started,
                                                "boot_id_before": before["status"]["nodeInfo"]["bootID"],
                                                "gpus_needed": 1, "resource_version_before": None},
                                      deadline=started + 120, settle_seconds=1.0, fallback_seconds=3.0)
        event = asyncio.run(trigger.run().__anext__())
        fired = time.time()
    assert event.payload["status"] == "ready", event.payload
    assert event.payload["evidence"]["path"] == "fallback" and "warning" in event.payload["evidence"]
    assert fired >= joined + 3.0 - 0.1
    assert fired < started + 60, "fired at the deadline's end, not when the fallback window completed"


def test_weakened_rule_fires_on_the_stale_count_and_the_pod_fails_admission(cloud):
    payload, fired, timeline, started = asyncio.run(boot_and_wait(WeakTrigger))
    assert payload["status"] == "ready"
    assert not [t for t, _, g, _ in timeline if g == "0" and started < t < fired], "fired before the zero phase"
    kube = KubeClient()
    kube.core.create_namespaced_pod("default", gpu_pod("after-weak"))
    phase, reason = wait_until(lambda: pod_phase(kube, "after-weak")[0] in ("Succeeded", "Failed")
                               and pod_phase(kube, "after-weak"), timeout=20)
    assert (phase, reason) == ("Failed", "UnexpectedAdmissionError")


def test_trigger_times_out_with_what_it_last_saw(cloud):
    cloud.set_faults(device_plugin_never=[NODE])
    payload, fired, _, started = asyncio.run(boot_and_wait(NodeGpuReadyTrigger, timeout=5))
    assert payload["status"] == "timeout" and fired >= started + 5
    assert payload["node"] == NODE and payload["reason"]
    assert payload["evidence"], "the timeout must carry what was last seen"


def assert_gpu_pod_runs(name: str) -> None:
    kube = KubeClient()
    kube.core.create_namespaced_pod("default", gpu_pod(name))
    phase, reason = wait_until(lambda: pod_phase(kube, name)[0] in ("Succeeded", "Failed")
                               and pod_phase(kube, name), timeout=20)
    assert (phase, reason) == ("Succeeded", None)


# The recorder and the trigger are two watches on one loop: the same write reaches them a few ms
# apart (CI saw the trigger 5 ms ahead), so "fired before it was registered" allows that skew. An
# early fire here is a fire on the stale count, which ends at least 0.5 s before registration.
OBSERVER_SKEW = 0.25


def assert_not_before(fired: float, registered: float, what: str = "the real count was registered") -> None:
    assert fired >= registered - OBSERVER_SKEW, f"fired {registered - fired:.2f}s before {what}"


def stale_then_real(timeline, started) -> float:
    """When the real count was registered: the last 0 -> 1 after the start."""
    zeros = [t for t, _, g, _ in timeline if g == "0" and t > started]
    assert zeros, "the kubelet's reset must have happened"
    return min(t for t, _, g, _ in timeline if g == "1" and t > zeros[-1])


@pytest.mark.parametrize("order", ["stale-first", "kubelet"])
def test_a_reset_delayed_far_past_the_settle_window_never_fires_early(cloud, order):
    """settle_seconds=1 and the kubelet's zero 10 s late: the stale count is shown for ~10 s."""
    cloud.set_faults(gpu_reset_delay_seconds={NODE: 10}, boot_order={NODE: order})
    payload, fired, timeline, started = asyncio.run(boot_and_wait(NodeGpuReadyTrigger, timeout=60, settle=1.0))
    assert payload["status"] == "ready", payload
    registered = stale_then_real(timeline, started)
    assert_not_before(fired, registered)
    assert payload["evidence"]["path"] == "reset seen" and "warning" not in payload["evidence"]
    assert_gpu_pod_runs(f"after-late-reset-{order}")


def test_a_late_reset_with_a_device_plugin_that_never_registers_times_out(cloud):
    cloud.set_faults(gpu_reset_delay_seconds={NODE: 4}, device_plugin_never=[NODE])
    payload, _fired, timeline, _started = asyncio.run(boot_and_wait(NodeGpuReadyTrigger, timeout=12, settle=1.0))
    assert payload["status"] == "timeout", payload
    assert [g for _, ready, g, _ in timeline if ready][:1] == ["1"], "the stale count was shown while Ready"
    assert payload["evidence"]["gpus_allocatable"] == 0


def test_a_watch_relisted_in_the_middle_of_the_boot_never_fires_early(cloud):
    """The API server's history is compacted while the stale count shows (410 on resume):
    the trigger re-lists, can no longer prove it saw every write, and must still wait."""
    cloud.set_faults(gpu_reset_delay_seconds={NODE: 8})

    def cut_the_watch(timeline):
        wait_until(lambda: any(ready and g == "1" for _, ready, g, _ in timeline), timeout=30)
        cloud.compact()

    payload, fired, timeline, started = asyncio.run(boot_and_wait(NodeGpuReadyTrigger, timeout=60, settle=1.0,
                                                                  during_boot=cut_the_watch))
    assert payload["status"] == "ready", payload
    assert_not_before(fired, stale_then_real(timeline, started))
    assert not payload["evidence"]["continuous"], "the re-list must be known to the rule"
    assert_gpu_pod_runs("after-relist")


def test_triggers_waiting_on_one_node_share_its_watch_and_each_fires_on_the_reset(cloud):
    """A burst of jobs booting one node: their triggers (3 per node here, on one loop as in a
    triggerer) hold one watch per node between them, not one each (the API server's own count),
    and every one still fires on the fast path, after the GPUs really registered."""
    from bench.triggerer_loop import PeakNodeWatches, boot_specs

    async def first_event(spec):
        async for event in NodeGpuReadyTrigger(**spec).run():
            return event.payload

    async def run(specs):
        return await asyncio.gather(*(first_event(spec) for spec in specs))

    with PeakNodeWatches(cloud) as watches:
        specs = boot_specs(cloud, ["gpu-stop", "gpu2-stop"], per_node=3, timeout=60, settle=SETTLE)
        payloads = asyncio.run(run(specs))
        wait_until(lambda: watches.now() == 0, timeout=10)   # the last trigger out closed each
    assert [p["status"] for p in payloads] == ["ready"] * 6, payloads
    assert {p["evidence"]["path"] for p in payloads} == {"reset seen"}
    assert watches.peak == 2                           # two nodes, six triggers


def test_trigger_serializes_to_an_importable_path():
    trigger = NodeGpuReadyTrigger(baseline={"node": "n", "start_requested_at": None, "boot_id_before": None,
                                            "gpus_needed": 0}, deadline=1.0)
    path, kwargs = trigger.serialize()
    assert path == "gpuboot.triggers.gpu_ready.NodeGpuReadyTrigger"
    assert NodeGpuReadyTrigger(**kwargs).serialize() == (path, kwargs)


# --- every requested extended resource: GPU sharing's aliyun.com/gpu-mem ---------------------------------
SHARED = "gpu-share"
GPU_MEM = "aliyun.com/gpu-mem"
# nvidia.com/gpu registers first and gpu-mem device_plugin_seconds (3 s) later: a wide window for binding early
SHARE_FLEET = small_fleet([{"name": SHARED, "instance_type": "ecs.gn6i-c24g1.12xlarge", "status": "Stopped",
                            "labels": {"ack.node.gpu.schedule": "share"}}],
                          timings={"stale_seconds": 1.0, "device_plugin_seconds": 3.0})


@pytest.fixture
def shared_cloud(tmp_path, monkeypatch):
    with SimCloud.start(SHARE_FLEET, tmp_path / "simcloud") as sim:
        expose_connections(sim.connections_file, monkeypatch)
        yield sim


def run_pod(name: str, **kwargs) -> tuple[str, str | None]:
    kube = KubeClient()
    kube.core.create_namespaced_pod("default", gpu_pod(name, **kwargs))
    return wait_until(lambda: pod_phase(kube, name)[0] in ("Succeeded", "Failed") and pod_phase(kube, name),
                      timeout=20)


def test_a_gpu_mem_job_is_committed_only_after_gpu_mem_went_stale_zero_real(shared_cloud):
    payload, fired, timeline, started = asyncio.run(boot_and_wait(
        NodeGpuReadyTrigger, timeout=60, node=SHARED, needs={GPU_MEM: 8}, resource=GPU_MEM))
    assert payload["status"] == "ready", payload
    zeros = [t for t, _, g, _ in timeline if g == "0" and t > started]
    assert zeros, "the kubelet's reset of gpu-mem must have happened"
    registered = min(t for t, _, g, _ in timeline if g == "28" and t > zeros[-1])
    assert_not_before(fired, registered, "gpu-mem was registered")
    assert payload["evidence"]["allocatable"] == {GPU_MEM: 28} and payload["evidence"]["path"] == "reset seen"
    assert run_pod("mem-after-strong", node=SHARED, resource=GPU_MEM, count=8) == ("Succeeded", None)


def test_a_rule_watching_only_whole_gpus_commits_a_gpu_mem_pod_that_fails_admission(shared_cloud):
    """The control: the same boot judged on nvidia.com/gpu alone fires while gpu-mem still reads 0."""
    payload, _fired, _timeline, _started = asyncio.run(boot_and_wait(
        NodeGpuReadyTrigger, timeout=60, node=SHARED, needs={"nvidia.com/gpu": 1}, resource=GPU_MEM))
    assert payload["status"] == "ready", payload
    assert run_pod("mem-after-gpu-only", node=SHARED, resource=GPU_MEM, count=8) == \
        ("Failed", "UnexpectedAdmissionError")


def test_the_async_client_raises_the_status_an_error_answer_carries(cloud, monkeypatch):
    """kubernetes_asyncio checks a status only when it preloads the body; our raw reads check it
    themselves, so a 404 or 403 raises as from the sync client instead of reading as the object.
    As the product's ServiceAccount, whose pods/log right is in the job namespaces only."""
    from kubernetes_asyncio.client.exceptions import ApiException

    expose_connections(cloud.gpuboot_connections(), monkeypatch)

    async def status_of(call) -> int:
        try:
            await call
        except ApiException as exc:
            return exc.status
        raise AssertionError("no error raised")

    async def first_line(namespace, pod):
        async for line in AsyncKubeClient().pod_log(namespace, pod, "base"):
            return line

    async def check():
        kube = AsyncKubeClient()
        return (await status_of(kube.get_node("no-such-node")),
                await status_of(first_line("gpu-jobs", "no-such-pod")),
                await status_of(first_line("kube-system", "any")))       # pods/log: the job namespaces only

    assert asyncio.run(check()) == (404, 404, 403)

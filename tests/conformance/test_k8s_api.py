"""The local Kubernetes API through the official `kubernetes` and `kubernetes_asyncio` clients."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request

import kubernetes
import kubernetes_asyncio
import pytest
from kubernetes.client.rest import ApiException

from tests.conformance.k8s_harness import K8sServer, k8s, make_node, pod_body, start_server, wait_until  # noqa: F401

NS = "default"


def _status(err: ApiException) -> dict:
    return json.loads(err.body)


@pytest.mark.both_backends
def test_discovery_and_version(k8s: K8sServer):
    api_client = k8s.core_v1().api_client
    version = kubernetes.client.VersionApi(api_client).get_code()
    assert version.major == "1" and version.git_version.startswith("v1.")
    resources = {r.name: r for r in kubernetes.client.CoreV1Api(api_client).get_api_resources().resources}
    assert resources["pods"].namespaced and "watch" in resources["pods"].verbs and resources["pods"].short_names == ["po"]
    assert not resources["nodes"].namespaced and resources["nodes"].kind == "Node"
    assert {"pods/log", "pods/status", "pods/binding", "nodes/status"} <= set(resources)


@pytest.mark.both_backends
def test_configmap_crud_and_stale_update_conflict(k8s: K8sServer):
    v1 = k8s.core_v1()
    created = v1.create_namespaced_config_map(NS, {"metadata": {"name": "ledger", "labels": {"app": "gpuboot"}},
                                                   "data": {"reservations": "{}"}})
    assert created.metadata.uid and created.metadata.resource_version and created.metadata.creation_timestamp
    stale = v1.read_namespaced_config_map("ledger", NS)
    fresh = v1.read_namespaced_config_map("ledger", NS)
    fresh.data["reservations"] = '{"job-1": "gpu-a"}'
    replaced = v1.replace_namespaced_config_map("ledger", NS, fresh)
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)
    stale.data["reservations"] = '{"job-2": "gpu-a"}'
    with pytest.raises(ApiException) as err:
        v1.replace_namespaced_config_map("ledger", NS, stale)
    assert err.value.status == 409
    body = _status(err.value)
    assert body["reason"] == "Conflict" and body["kind"] == "Status"
    assert body["message"] == ('Operation cannot be fulfilled on configmaps "ledger": the object has been modified; '
                               "please apply your changes to the latest version and try again")
    assert v1.read_namespaced_config_map("ledger", NS).data["reservations"] == '{"job-1": "gpu-a"}'
    patched = v1.patch_namespaced_config_map("ledger", NS, {"data": {"extra": "1"}})
    assert patched.data == {"reservations": '{"job-1": "gpu-a"}', "extra": "1"}
    assert [c.metadata.name for c in v1.list_namespaced_config_map(NS, label_selector="app=gpuboot").items] == ["ledger"]
    v1.delete_namespaced_config_map("ledger", NS)
    with pytest.raises(ApiException) as err:
        v1.read_namespaced_config_map("ledger", NS)
    assert err.value.status == 404
    assert _status(err.value)["message"] == 'configmaps "ledger" not found'


def test_conflict_burst_fault_refuses_configmap_writes(k8s: K8sServer):
    v1 = k8s.core_v1()
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "cm"}, "data": {"a": "1"}})
    k8s.faults.k8s_conflict_burst = 2
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            v1.patch_namespaced_config_map("cm", NS, {"data": {"a": "2"}})
        assert err.value.status == 409 and _status(err.value)["reason"] == "Conflict"
    assert v1.patch_namespaced_config_map("cm", NS, {"data": {"a": "2"}}).data == {"a": "2"}
    assert k8s.faults.k8s_conflict_burst == 0


@pytest.mark.both_backends
def test_error_statuses_are_the_real_ones(k8s: K8sServer):
    v1 = k8s.core_v1()
    with pytest.raises(ApiException) as err:
        v1.read_namespaced_pod("nope", NS)
    assert err.value.status == 404 and _status(err.value)["message"] == 'pods "nope" not found'
    assert _status(err.value)["details"] == {"name": "nope", "kind": "pods"}
    v1.create_namespaced_pod(NS, pod_body("p"))
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod(NS, pod_body("p"))
    assert err.value.status == 409 and _status(err.value)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod(NS, {"metadata": {"name": "Bad_Name"}, "spec": {"containers": [{"name": "c"}]}})
    body = _status(err.value)
    assert err.value.status == 422 and body["reason"] == "Invalid"
    assert [c["field"] for c in body["details"]["causes"]] == ["metadata.name", "spec.containers[0].image"]
    assert body["message"].startswith('Pod "Bad_Name" is invalid: [metadata.name: Invalid value: "Bad_Name": ')
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod(NS, {"metadata": {"name": "noimage"}, "spec": {"containers": [{"name": "c"}]}})
    assert err.value.status == 422 and "spec.containers[0].image: Required value" in _status(err.value)["message"]
    with pytest.raises(ApiException) as err:
        v1.list_namespaced_pod(NS, field_selector="spec.bogus=1")
    assert err.value.status == 400 and _status(err.value)["message"] == "field label not supported: spec.bogus"
    with pytest.raises(ApiException) as err:
        v1.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"a": "b"}}}, _content_type="application/json")
    assert err.value.status == 415
    # protobuf bodies (kubectl 1.32's `create configmap` generator) are refused as unsupported, not misread
    request = urllib.request.Request(f"{k8s.url}/api/v1/namespaces/{NS}/configmaps", data=b"k8s\x00...",
                                     method="POST", headers={"Content-Type": "application/vnd.kubernetes.protobuf",
                                                             "Authorization": f"Bearer {k8s.admin_token}"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, context=k8s.ssl_context())
    # kube-apiserver decodes protobuf (this body is not: 400); simcloud decodes none, harsher: 415
    assert (http_err.value.code, json.loads(http_err.value.read())["reason"]) == \
        ((400, "BadRequest") if k8s.backend == "real" else (415, "UnsupportedMediaType"))
    with pytest.raises(ApiException) as err:     # pod specs are immutable beyond images/tolerations
        v1.patch_namespaced_pod("p", NS, {"spec": {"restartPolicy": "Always"}})
    assert err.value.status == 422 and "Forbidden: pod updates may not change fields" in _status(err.value)["message"]


@pytest.mark.both_backends
def test_node_and_namespace_crud_patch_flavours_and_status(k8s: K8sServer):
    v1 = k8s.core_v1()
    v1.create_namespace({"metadata": {"name": "ml"}})
    assert v1.read_namespace("ml").status.phase == "Active"
    node = v1.create_node(make_node("gpu-a", gpu=1))
    assert node.spec.provider_id == "cn-hangzhou.i-gpu-a"
    # strategic merge (the client's default for dicts): labels merge, taints list replaced
    v1.patch_node("gpu-a", {"metadata": {"labels": {"pool": "a100"}},
                            "spec": {"taints": [{"key": "gpu", "value": "true", "effect": "NoSchedule"}]}})
    # merge patch and JSON patch
    v1.patch_node("gpu-a", {"spec": {"unschedulable": True}}, _content_type="application/merge-patch+json")
    v1.patch_node("gpu-a", [{"op": "test", "path": "/metadata/labels/pool", "value": "a100"},
                            {"op": "add", "path": "/metadata/labels/zone", "value": "cn-hangzhou-k"}])
    node = v1.read_node("gpu-a")
    assert node.metadata.labels["pool"] == "a100" and node.metadata.labels["zone"] == "cn-hangzhou-k"
    assert node.metadata.labels["kubernetes.io/hostname"] == "gpu-a"
    # the node-lifecycle controller adds node.kubernetes.io/unschedulable to a cordoned node when it runs
    # (the real one here; simcloud's in its own tests): the user's taint is the one the patch wrote
    assert [t.key for t in node.spec.taints if t.key != "node.kubernetes.io/unschedulable"] == ["gpu"]
    assert node.spec.unschedulable is True
    with pytest.raises(ApiException) as err:
        v1.patch_node("gpu-a", [{"op": "test", "path": "/metadata/labels/pool", "value": "h100"}])
    assert err.value.status == 422
    # status subresource: conditions merge by type; a status write through the main resource is ignored
    v1.patch_node_status("gpu-a", {"status": {"conditions": [{"type": "Ready", "status": "False",
                                                              "reason": "KubeletNotReady"}],
                                              "allocatable": {"nvidia.com/gpu": "0"}}})
    v1.patch_node("gpu-a", {"status": {"allocatable": {"nvidia.com/gpu": "8"}}})
    node = v1.read_node_status("gpu-a")
    assert [(c.type, c.status) for c in node.status.conditions] == [("Ready", "False")]
    assert node.status.allocatable["nvidia.com/gpu"] == "0" and node.status.allocatable["cpu"] == "8"
    assert [n.metadata.name for n in v1.list_node(field_selector="metadata.name=gpu-a").items] == ["gpu-a"]
    assert v1.list_node(label_selector="pool notin (a100)").items == []
    v1.delete_node("gpu-a")
    assert v1.list_node().items == []
    v1.create_namespaced_config_map("ml", {"metadata": {"name": "inside"}})
    assert v1.delete_namespace("ml").kind == "Namespace"      # the Namespace itself, not a Status
    terminating = v1.read_namespace("ml")
    assert terminating.metadata.deletion_timestamp and terminating.spec.finalizers == ["kubernetes"]
    with pytest.raises(ApiException) as err:        # NamespaceLifecycle: no new content while it terminates
        v1.create_namespaced_config_map("ml", {"metadata": {"name": "x"}})
    assert err.value.status == 403 and _status(err.value)["message"] == (
        'configmaps "x" is forbidden: unable to create new content in namespace ml because it is being terminated')
    assert _status(err.value)["details"]["causes"] == [{"reason": "NamespaceTerminating", "field": "metadata.namespace",
                                                        "message": "namespace ml is being terminated"}]

    def gone() -> bool:
        try:
            v1.read_namespace("ml")
            return False
        except ApiException as missing:
            return missing.status == 404
    wait_until(gone, timeout=60, interval=0.5)      # its content deleted, then the namespace (~5 s)
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_config_map("ml", {"metadata": {"name": "x"}})
    assert err.value.status == 404 and _status(err.value)["message"] == 'namespaces "ml" not found'


def test_pods_selectors_paging_events_binding_and_graceful_delete(k8s: K8sServer):
    v1 = k8s.core_v1()
    for i in range(5):
        v1.create_namespaced_pod(NS, pod_body(f"p{i}", labels={"job": "train" if i % 2 else "eval",
                                                               "idx": str(i)}, node_selector={"none": "x"}))
    assert [p.metadata.name for p in v1.list_namespaced_pod(NS, label_selector="job=train").items] == ["p1", "p3"]
    assert [p.metadata.name for p in v1.list_namespaced_pod(NS, label_selector="job!=train,idx in (0,4)").items] \
        == ["p0", "p4"]
    assert len(v1.list_pod_for_all_namespaces(field_selector="status.phase=Pending").items) == 5
    # paging
    first = v1.list_namespaced_pod(NS, limit=2)
    assert [p.metadata.name for p in first.items] == ["p0", "p1"] and first.metadata.remaining_item_count == 3
    rest = v1.list_namespaced_pod(NS, limit=10, _continue=first.metadata._continue)
    assert [p.metadata.name for p in rest.items] == ["p2", "p3", "p4"] and not rest.metadata._continue
    # binding, once
    v1.create_namespaced_pod_binding("p0", NS, {"metadata": {"name": "p0"},
                                                "target": {"kind": "Node", "name": "gpu-a"}}, _preload_content=False)
    pod = v1.read_namespaced_pod("p0", NS)
    assert pod.spec.node_name == "gpu-a"
    assert [(c.type, c.status) for c in pod.status.conditions if c.type == "PodScheduled"] == [("PodScheduled", "True")]
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod_binding("p0", NS, {"target": {"kind": "Node", "name": "gpu-b"}},
                                         _preload_content=False)
    assert err.value.status == 409 and 'already assigned to node "gpu-a"' in _status(err.value)["message"]
    # events by field selector, as the pod operator asks for them
    k8s.on_loop(lambda: k8s.store.record_event(k8s.store.get("pods", NS, "p0"), "Pulled", "image pulled"))
    events = v1.list_namespaced_event(NS, field_selector="involvedObject.name=p0").items
    assert ("Pulled", "Pod", 1) in [(e.reason, e.involved_object.kind, e.count) for e in events]
    assert {e.involved_object.name for e in events} == {"p0"}
    # label patch as the pod operator does it
    v1.patch_namespaced_pod("p0", NS, {"metadata": {"labels": {"already_checked": "True"}}})
    assert v1.list_namespaced_pod(NS, label_selector="already_checked=True").items[0].metadata.name == "p0"
    # a bound, running pod deletes gracefully; the kubelet (here: the test) finishes it
    deleted = v1.delete_namespaced_pod("p0", NS, body={"gracePeriodSeconds": 5})
    assert deleted.metadata.deletion_timestamp and deleted.metadata.deletion_grace_period_seconds == 5
    k8s.on_loop(lambda: k8s.store.remove("pods", NS, "p0"))
    v1.delete_namespaced_pod("p1", NS)   # unbound: gone now
    assert [p.metadata.name for p in v1.list_namespaced_pod(NS).items] == ["p2", "p3", "p4"]


def test_pod_log_plain_and_followed(k8s: K8sServer):
    v1 = k8s.core_v1()
    v1.create_namespaced_pod(NS, pod_body("trainer", node_selector={"none": "x"}))
    with pytest.raises(ApiException) as err:
        v1.read_namespaced_pod_log("trainer", NS)
    assert err.value.status == 400 and "is waiting to start: ContainerCreating" in _status(err.value)["message"]
    k8s.on_loop(lambda: k8s.store.bind(NS, "trainer", "gpu-a"))
    lines = k8s.logs.lines.setdefault((NS, "trainer"), [])
    lines.extend([b"epoch 1 loss 0.9\n", b"epoch 2 loss 0.5\n"])
    # kubernetes 36 turns a preloaded log into "b'...'" (kubernetes-client/python#2596): read it raw, as the
    # pod operator does
    def read_log(**kwargs) -> str:
        return v1.read_namespaced_pod_log("trainer", NS, _preload_content=False, **kwargs).data.decode()
    assert read_log() == "epoch 1 loss 0.9\nepoch 2 loss 0.5\n"
    assert read_log(tail_lines=1, timestamps=True) == "2026-01-01T00:00:00.000000000Z epoch 2 loss 0.5\n"
    stream = v1.read_namespaced_pod_log("trainer", NS, follow=True, _preload_content=False)
    got = []
    for chunk in stream.stream(amt=1024):
        got.append(chunk)
        if len(got) == 2:
            lines.append(b"epoch 3 loss 0.1\n")
            k8s.on_loop(lambda: k8s.store.mutate("pods", NS, "trainer",
                                                 lambda p: p["status"].update(phase="Succeeded")))
    assert b"".join(got).decode().splitlines() == ["epoch 1 loss 0.9", "epoch 2 loss 0.5", "epoch 3 loss 0.1"]


@pytest.mark.both_backends
def test_watch_from_resource_version_delivers_exactly_later_events(k8s: K8sServer):
    v1 = k8s.core_v1()
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "before"}})
    rv = v1.list_namespaced_config_map(NS).metadata.resource_version
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "after", "labels": {"w": "1"}}})
    v1.patch_namespaced_config_map("before", NS, {"data": {"x": "1"}})
    v1.delete_namespaced_config_map("after", NS)
    started = time.monotonic()
    events = [(e["type"], e["object"].metadata.name) for e in kubernetes.watch.Watch().stream(
        v1.list_namespaced_config_map, NS, resource_version=rv, timeout_seconds=1)]
    assert events == [("ADDED", "after"), ("MODIFIED", "before"), ("DELETED", "after")]
    assert time.monotonic() - started < 5          # timeoutSeconds ended the stream
    # resourceVersion 0: the current objects as ADDED, with selectors applied
    events = [(e["type"], e["object"].metadata.name) for e in kubernetes.watch.Watch().stream(
        v1.list_namespaced_config_map, NS, resource_version="0", timeout_seconds=1, field_selector="metadata.name=before")]
    assert events == [("ADDED", "before")]


@pytest.mark.both_backends
def test_watch_sees_live_changes_through_label_selector_transitions(k8s: K8sServer):
    v1 = k8s.core_v1()
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "cm", "labels": {"state": "a"}}})
    rv = v1.list_namespaced_config_map(NS).metadata.resource_version

    def later():
        v1.patch_namespaced_config_map("cm", NS, {"metadata": {"labels": {"state": "b"}}})
        v1.patch_namespaced_config_map("cm", NS, {"metadata": {"labels": {"state": "a"}}})
    watch = kubernetes.watch.Watch()
    seen = []
    import threading
    threading.Timer(0.2, later).start()
    for event in watch.stream(v1.list_namespaced_config_map, NS, label_selector="state=a", resource_version=rv,
                              timeout_seconds=3):
        seen.append((event["type"], event["object"].metadata.labels["state"]))
        if len(seen) == 2:
            watch.stop()
    assert seen == [("DELETED", "a"), ("ADDED", "a")]   # leaving (as it last matched) / entering the selector


def test_watch_too_old_resource_version_is_410_gone(tmp_path):
    server = start_server(tmp_path, history_limit=5, scheduler=False)
    try:
        v1 = server.core_v1()
        rv = v1.list_namespaced_config_map(NS).metadata.resource_version
        for i in range(10):
            v1.create_namespaced_config_map(NS, {"metadata": {"name": f"c{i}"}})
        with pytest.raises(ApiException) as err:
            list(kubernetes.watch.Watch().stream(v1.list_namespaced_config_map, NS, resource_version=rv,
                                                 timeout_seconds=1))
        assert err.value.status == 410 and "Expired: too old resource version" in err.value.reason
    finally:
        server._stop()


def test_kubernetes_asyncio_watches_one_node_by_field_selector(k8s: K8sServer):
    k8s.add_node("gpu-a", gpu=1)
    k8s.add_node("gpu-b", gpu=1)

    async def watch_node() -> list[tuple[str, str, str]]:
        config = k8s.configure(kubernetes_asyncio.client.Configuration())
        async with kubernetes_asyncio.client.ApiClient(config) as api:
            v1 = kubernetes_asyncio.client.CoreV1Api(api)
            watch = kubernetes_asyncio.watch.Watch()
            seen = []
            async with watch.stream(v1.list_node, field_selector="metadata.name=gpu-a", timeout_seconds=5) as stream:
                async for event in stream:
                    node = event["object"]
                    seen.append((event["type"], node.metadata.name, node.status.allocatable.get("nvidia.com/gpu")))
                    if len(seen) == 1:
                        k8s.on_loop(lambda: [k8s.store.mutate("nodes", None, name, lambda n: n["status"]["allocatable"]
                                                              .update({"nvidia.com/gpu": "0"}))
                                             for name in ("gpu-b", "gpu-a")])
                    if len(seen) == 2:
                        watch.stop()
            return seen

    assert asyncio.run(watch_node()) == [("ADDED", "gpu-a", "1"), ("MODIFIED", "gpu-a", "0")]


def test_followed_log_of_a_quiet_container_streams_lines_as_they_come(k8s: K8sServer):
    import threading
    v1 = k8s.core_v1()
    v1.create_namespaced_pod(NS, pod_body("quiet", node_selector={"none": "x"}))
    k8s.on_loop(lambda: k8s.store.bind(NS, "quiet", "gpu-a"))
    lines = k8s.logs.lines.setdefault((NS, "quiet"), [])

    def speak():
        lines.append(b"warming up\n")
        k8s.on_loop(lambda: k8s.store.mutate("pods", NS, "quiet", lambda p: p["status"].update(phase="Succeeded")))
    threading.Timer(0.5, speak).start()    # later than the server waits before committing to 200
    stream = v1.read_namespaced_pod_log("quiet", NS, follow=True, _preload_content=False)
    assert stream.status == 200
    assert b"".join(stream.stream(amt=1024)) == b"warming up\n"


def test_the_log_cut_fault_ends_a_followed_stream_while_the_container_runs(k8s: K8sServer):
    v1 = k8s.core_v1()
    v1.create_namespaced_pod(NS, pod_body("cut", node_selector={"none": "x"}))
    k8s.on_loop(lambda: k8s.store.bind(NS, "cut", "gpu-a"))
    k8s.logs.lines.setdefault((NS, "cut"), []).append(b"epoch 1\n")
    k8s.faults.log_stream_cut_seconds = 0.5
    started = time.monotonic()
    stream = v1.read_namespaced_pod_log("cut", NS, follow=True, _preload_content=False)
    assert stream.status == 200
    assert b"".join(stream.stream(amt=1024)) == b"epoch 1\n"     # ended, though nothing ended the pod
    assert time.monotonic() - started >= 0.5
    assert v1.read_namespaced_pod("cut", NS).status.phase != "Succeeded"
    k8s.faults.log_stream_cut_seconds = 0.0


def test_latency_fault_and_deletecollection(k8s: K8sServer):
    v1 = k8s.core_v1()
    for i in range(3):
        v1.create_namespaced_config_map(NS, {"metadata": {"name": f"r{i}", "labels": {"kind": "reservation"}}})
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "keep"}})
    k8s.faults.k8s_latency_ms = 300
    started = time.monotonic()
    v1.delete_collection_namespaced_config_map(NS, label_selector="kind=reservation")
    assert time.monotonic() - started >= 0.3
    k8s.faults.k8s_latency_ms = 0
    assert [c.metadata.name for c in v1.list_namespaced_config_map(NS).items] == ["keep"]


def test_watch_bookmarks_carry_the_watch_caches_version(k8s: K8sServer, monkeypatch):
    import simcloud.kube.api
    monkeypatch.setattr(simcloud.kube.api, "BOOKMARK_EVERY", 0.1)    # an idle watch gets a bookmark soon
    v1 = k8s.core_v1()
    before = v1.list_namespaced_config_map(NS).metadata.resource_version
    current = v1.create_namespaced_config_map("kube-system", {"metadata": {"name": "cm"}}).metadata.resource_version
    watch = kubernetes.watch.Watch()
    events = []
    for event in watch.stream(v1.list_namespaced_config_map, NS, resource_version=before,
                              allow_watch_bookmarks=True, timeout_seconds=5, deserialize=False):
        events.append((event["type"], event["object"]["metadata"]["resourceVersion"]))
        watch.stop()
    assert events == [("BOOKMARK", current)]       # a ConfigMap write this watch does not select, passed


def bookmarks(list_fn, rv: str, timeout: int) -> list[int]:
    """The resourceVersion of every BOOKMARK a watch of `list_fn` from `rv` gets (it must get nothing else)."""
    seen = []
    for event in kubernetes.watch.Watch().stream(list_fn, NS, resource_version=rv, allow_watch_bookmarks=True,
                                                 timeout_seconds=timeout, deserialize=False):
        assert event["type"] == "BOOKMARK", event
        seen.append(int(event["object"]["metadata"]["resourceVersion"]))
    return seen


@pytest.mark.both_backends
def test_a_quiet_watch_passes_other_resources_writes_only_after_a_consistent_list(k8s: K8sServer):
    """kube-apiserver's watch cache of a resource learns that resource's writes, and other resources'
    only from etcd's progress notifications (every 10 min unless asked; a consistent LIST asks). So a
    BOOKMARK never passes a ConfigMap write on a quiet LimitRange watch until LimitRanges are listed:
    gpuboot's cluster view asks so when it must pass a ledger write (gpuboot.lifecycle.view)."""
    v1 = k8s.core_v1()
    start = v1.list_namespaced_limit_range(NS).metadata.resource_version
    elsewhere = int(v1.create_namespaced_config_map(NS, {"metadata": {"name": "another-resource"}})
                    .metadata.resource_version)
    assert bookmarks(v1.list_namespaced_limit_range, start, timeout=4) == []    # the cache stayed at `start`
    listed = int(v1.list_namespaced_limit_range(NS, limit=1).metadata.resource_version)
    assert listed >= elsewhere
    seen = bookmarks(v1.list_namespaced_limit_range, start, timeout=4)
    assert seen and seen[0] >= listed, seen     # the one just before the watch's timeout


@pytest.mark.both_backends
def test_paging_all_namespaces_reads_the_first_pages_snapshot_after_the_last_key(k8s: K8sServer):
    v1 = k8s.core_v1()
    mine = {"paging": "test"}       # not the kube-root-ca.crt a real controller publishes in every namespace
    for ns in ("team-a", "team-b"):
        v1.create_namespace({"metadata": {"name": ns}})
        for i in range(3):
            v1.create_namespaced_config_map(ns, {"metadata": {"name": f"c{i}", "labels": mine}})
    first = v1.list_config_map_for_all_namespaces(limit=4, label_selector="paging=test")
    assert [(c.metadata.namespace, c.metadata.name) for c in first.items] == [
        ("team-a", "c0"), ("team-a", "c1"), ("team-a", "c2"), ("team-b", "c0")]
    assert first.metadata.remaining_item_count is None       # never counted through a selector
    v1.delete_namespaced_config_map("c0", "team-b")        # the cursor's own object
    v1.create_namespaced_config_map("team-b", {"metadata": {"name": "c9", "labels": mine}})
    rest = v1.list_config_map_for_all_namespaces(limit=4, label_selector="paging=test",
                                                 _continue=first.metadata._continue)
    assert [(c.metadata.namespace, c.metadata.name) for c in rest.items] == [   # the first page's snapshot:
        ("team-b", "c1"), ("team-b", "c2")]                                     # c9 came after it
    assert not rest.metadata._continue
    assert rest.metadata.resource_version == first.metadata.resource_version   # a watch from it misses nothing
    with pytest.raises(ApiException) as err:
        v1.list_config_map_for_all_namespaces(limit=4, label_selector="paging=test", _continue="bm90LWEtdG9rZW4=")
    assert err.value.status == 400 and "continue key is not valid" in _status(err.value)["message"]


def _get_any_version(v1, name: str) -> dict:
    """GET with resourceVersion=0, as gpuboot's queue polls read (`KubeClient.read_configmap(cached=True)`)."""
    raw = v1.api_client.call_api("/api/v1/namespaces/{namespace}/configmaps/{name}", "GET",
                                 {"namespace": NS, "name": name}, [("resourceVersion", "0")],
                                 {"Accept": "application/json"}, auth_settings=["BearerToken"],
                                 _return_http_data_only=True, _preload_content=False)
    return json.loads(raw.data)


def _data_of_any_version(v1, name: str) -> dict | None:
    """Its data as a GET with resourceVersion=0 serves it; None while the cache has not seen it (404)."""
    try:
        return _get_any_version(v1, name)["data"]
    except ApiException as err:
        if err.status != 404:
            raise
        return None


@pytest.mark.both_backends
def test_a_get_of_any_version_is_a_version_written_and_catches_up_with_the_last(k8s: K8sServer):
    """resourceVersion=0 serves the object from the watch cache: perhaps behind the last write, never a
    version nobody wrote, and the last one once the cache caught up."""
    v1 = k8s.core_v1()
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "cached"}, "data": {"n": "0"}})
    for n in range(1, 6):
        v1.patch_namespaced_config_map("cached", NS, {"data": {"n": str(n)}})
        with contextlib.suppress(ApiException):     # 404: the cache has not seen the create yet
            assert int(_get_any_version(v1, "cached")["data"]["n"]) in range(n + 1)
    wait_until(lambda: _data_of_any_version(v1, "cached") == {"n": "5"}, timeout=10)
    assert _get_any_version(v1, "cached")["metadata"]["resourceVersion"] == \
        v1.read_namespaced_config_map("cached", NS).metadata.resource_version


def test_simcloud_serves_a_get_of_any_version_as_it_was_before_a_recent_write(k8s: K8sServer):
    """Harsher than kube-apiserver's cache (milliseconds behind): for CACHE_LAG_SECONDS after a write,
    resourceVersion=0 shows the object as it was before it, 404 after its create; then the last version."""
    from simcloud.kube.store import CACHE_LAG_SECONDS

    v1 = k8s.core_v1()
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "lagging"}, "data": {"n": "0"}})
    with pytest.raises(ApiException) as err:
        _get_any_version(v1, "lagging")
    assert err.value.status == 404
    assert v1.read_namespaced_config_map("lagging", NS).data == {"n": "0"}    # a plain GET: the last write
    wait_until(lambda: _data_of_any_version(v1, "lagging") == {"n": "0"}, timeout=CACHE_LAG_SECONDS + 5)
    v1.patch_namespaced_config_map("lagging", NS, {"data": {"n": "1"}})
    v1.patch_namespaced_config_map("lagging", NS, {"data": {"n": "2"}})
    assert _get_any_version(v1, "lagging")["data"] == {"n": "0"}     # behind both writes of the window
    wait_until(lambda: _data_of_any_version(v1, "lagging") == {"n": "2"}, timeout=CACHE_LAG_SECONDS + 5)

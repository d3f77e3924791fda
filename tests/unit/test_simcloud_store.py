"""The store: versions, conflicts, graceful pod deletion, watch history, events."""
import pytest

from simcloud.store import ApiError, Store

POD = {"metadata": {"name": "p", "namespace": "default"}, "spec": {"containers": [{"name": "c", "image": "img:1"}]}}


def test_versions_are_monotonic_and_stale_writes_conflict():
    store = Store()
    cm = store.create("configmaps", {"metadata": {"name": "ledger"}, "data": {"a": "1"}})
    assert cm["metadata"]["uid"] and cm["metadata"]["creationTimestamp"].endswith("Z")
    v1 = int(cm["metadata"]["resourceVersion"])
    updated = store.replace("configmaps", "default", "ledger", {**cm, "data": {"a": "2"}})
    assert int(updated["metadata"]["resourceVersion"]) > v1
    with pytest.raises(ApiError) as err:
        store.replace("configmaps", "default", "ledger", {**cm, "data": {"a": "3"}})
    assert err.value.code == 409 and err.value.reason == "Conflict"
    assert 'configmaps "ledger": the object has been modified' in err.value.message
    # a no-op write keeps the version, like the real server
    same = store.replace("configmaps", "default", "ledger", updated)
    assert same["metadata"]["resourceVersion"] == updated["metadata"]["resourceVersion"]


def test_create_errors_are_real_statuses():
    store = Store()
    store.create("pods", POD)
    with pytest.raises(ApiError) as err:
        store.create("pods", POD)
    assert (err.value.code, err.value.reason, err.value.message) == (409, "AlreadyExists", 'pods "p" already exists')
    with pytest.raises(ApiError) as err:
        store.create("pods", {"metadata": {"namespace": "nope", "name": "x"}, "spec": POD["spec"]})
    assert err.value.code == 404 and err.value.message == 'namespaces "nope" not found'
    with pytest.raises(ApiError) as err:
        store.create("pods", {"metadata": {"name": "x"}, "spec": {"containers": []}})
    assert err.value.code == 422 and "spec.containers: Required value" in err.value.message
    generated = store.create("pods", {"metadata": {"generateName": "job-"}, "spec": POD["spec"]})
    assert generated["metadata"]["name"].startswith("job-") and len(generated["metadata"]["name"]) == 9


def test_bound_running_pod_deletes_gracefully_then_kubelet_removes():
    store = Store()
    store.create("pods", POD)
    store.mutate("pods", "default", "p", lambda p: p["spec"].update(nodeName="n1"))
    marked = store.delete("pods", "default", "p")
    assert marked["metadata"]["deletionGracePeriodSeconds"] == 30 and marked["metadata"]["deletionTimestamp"]
    assert store.get("pods", "default", "p")
    store.remove("pods", "default", "p")
    with pytest.raises(ApiError) as err:
        store.get("pods", "default", "p")
    assert err.value.code == 404 and err.value.message == 'pods "p" not found'


def test_watch_history_and_gone():
    store = Store(history_limit=5)
    start = int(store.resource_version)
    for i in range(3):
        store.create("configmaps", {"metadata": {"name": f"c{i}"}})
    backlog, _ = store.watch("configmaps", start + 1)
    assert [e.obj["metadata"]["name"] for e in backlog] == ["c1", "c2"]
    for i in range(3, 10):
        store.create("configmaps", {"metadata": {"name": f"c{i}"}})
    with pytest.raises(ApiError) as err:
        store.watch("configmaps", start)
    assert err.value.code == 410 and err.value.reason == "Expired"


def test_record_event_aggregates_repeats():
    store = Store()
    pod = store.create("pods", POD)
    first = store.record_event(pod, "FailedScheduling", "0/1 nodes are available", "Warning", "default-scheduler")
    again = store.record_event(pod, "FailedScheduling", "0/1 nodes are available", "Warning", "default-scheduler")
    assert again["metadata"]["name"] == first["metadata"]["name"] and again["count"] == 2
    assert first["involvedObject"] == {"kind": "Pod", "name": "p", "namespace": "default", "uid": pod["metadata"]["uid"],
                                       "apiVersion": "v1", "resourceVersion": pod["metadata"]["resourceVersion"]}

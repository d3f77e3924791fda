"""The store: versions, conflicts, graceful pod deletion, watch history, events."""
import pytest

from simcloud.kube.errors import ApiError
from simcloud.kube.store import Store

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


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_versions_older_than_the_window_are_compacted_for_every_resource():
    clock = Clock()
    store = Store(history_seconds=300, clock=clock)
    store.create("configmaps", {"metadata": {"name": "old"}})
    old = int(store.resource_version)
    clock.now += 200
    store.create("configmaps", {"metadata": {"name": "newer"}})
    newer = int(store.resource_version)
    clock.now += 101          # `old` was written 301 s ago, `newer` 101 s ago
    store.create("leases", {"metadata": {"name": "l", "namespace": "kube-node-lease"}, "spec": {}})
    with pytest.raises(ApiError) as err:
        store.watch("configmaps", old - 1)          # would need `old` itself, compacted
    assert (err.value.code, err.value.reason) == (410, "Expired")
    backlog, _ = store.watch("configmaps", old)     # the changes after `old` are all kept
    assert [e.obj["metadata"]["name"] for e in backlog] == ["newer"]
    backlog, _ = store.watch("pods", old)           # a resource with no writes ages the same way
    assert backlog == []
    clock.now += 1000                                # nothing written since: the newest version still watches
    assert store.watch("configmaps", int(store.resource_version))[0] == []
    with pytest.raises(ApiError):
        store.watch("configmaps", newer)


def test_a_busy_resource_keeps_about_75_seconds_of_changes_as_the_watch_cache_does():
    """kube-apiserver's watch cache holds at least DefaultEventFreshDuration (75 s) of a resource's events and
    at least 100 of them: a busy resource's older events go, a quiet one keeps its 100 however old."""
    from simcloud.kube.store import FRESH_MIN_EVENTS, FRESH_SECONDS

    clock = Clock()
    store = Store(history_seconds=3600, clock=clock)
    store.create("configmaps", {"metadata": {"name": "first"}})
    first = int(store.resource_version)
    for i in range(FRESH_MIN_EVENTS - 2):
        store.create("configmaps", {"metadata": {"name": f"c{i}"}})
    clock.now += FRESH_SECONDS + 1
    store.create("configmaps", {"metadata": {"name": "late"}})      # 100 kept: the old ones stay
    assert len(store.watch("configmaps", first - 1)[0]) == FRESH_MIN_EVENTS
    store.create("configmaps", {"metadata": {"name": "later"}})     # 101: a stale one goes
    with pytest.raises(ApiError) as err:
        store.watch("configmaps", first - 1)                        # would need `first`
    assert (err.value.code, err.value.reason) == (410, "Expired")
    late = store.watch("configmaps", int(store.resource_version) - 2)[0]
    assert [e.obj["metadata"]["name"] for e in late] == ["late", "later"]


def test_a_future_version_is_504_too_large():
    store = Store()
    current = int(store.resource_version)
    with pytest.raises(ApiError) as err:
        store.watch("nodes", current + 5)
    assert (err.value.code, err.value.reason) == (504, "Timeout")
    assert err.value.message == f"Timeout: Too large resource version: {current + 5}, current: {current}"
    assert err.value.details["causes"][0]["reason"] == "ResourceVersionTooLarge"


def test_record_event_aggregates_repeats():
    store = Store()
    pod = store.create("pods", POD)
    first = store.record_event(pod, "FailedScheduling", "0/1 nodes are available", "Warning", "default-scheduler")
    again = store.record_event(pod, "FailedScheduling", "0/1 nodes are available", "Warning", "default-scheduler")
    assert again["metadata"]["name"] == first["metadata"]["name"] and again["count"] == 2
    assert first["involvedObject"] == {"kind": "Pod", "name": "p", "namespace": "default", "uid": pod["metadata"]["uid"],
                                       "apiVersion": "v1", "resourceVersion": pod["metadata"]["resourceVersion"]}


def _configmaps(store: Store, namespace: str, names) -> None:
    if namespace not in {n["metadata"]["name"] for n in store.select("namespaces")}:
        store.create("namespaces", {"metadata": {"name": namespace}})
    for name in names:
        store.create("configmaps", {"metadata": {"name": name, "namespace": namespace,
                                                 "labels": {"even": str(int(name[1:]) % 2 == 0).lower()}}})


def _all_pages(store: Store, limit: int, **kw) -> list[list[str]]:
    pages, after = [], None
    while True:
        page = store.page("configmaps", after=after, limit=limit, **kw)
        pages.append([o["metadata"]["name"] for o in page.items])
        if not page.more:
            return pages
        after = store.key_of(page.items[-1])


def test_pages_follow_key_order_and_stop_exactly_at_the_end():
    store = Store()
    _configmaps(store, "a", [f"c{i}" for i in (3, 1, 2)])
    _configmaps(store, "ab", ["c4"])          # a namespace whose name extends another's stays out of "a"
    _configmaps(store, "b", ["c5", "c6"])
    assert _all_pages(store, 2, namespace="a") == [["c1", "c2"], ["c3"]]
    assert _all_pages(store, 3) == [["c1", "c2", "c3"], ["c4", "c5", "c6"]]   # no empty trailing page
    assert _all_pages(store, 2, label_selector="even=true") == [["c2", "c4"], ["c6"]]
    first = store.page("configmaps", limit=2)
    assert (first.more, first.remaining) == (True, 4)
    assert store.page("configmaps", namespace="ab", limit=0).items[0]["metadata"]["name"] == "c4"   # 0: no limit


def test_a_page_resumes_after_the_last_key_even_when_it_is_gone():
    store = Store()
    _configmaps(store, "a", ["c1", "c2", "c3", "c4"])
    first = store.page("configmaps", limit=2)
    cursor = store.key_of(first.items[-1])
    store.remove("configmaps", "a", "c2")             # the cursor's own object
    _configmaps(store, "a", ["c0", "c5"])             # one before the cursor, one after
    rest = store.page("configmaps", after=cursor, limit=10)
    assert [o["metadata"]["name"] for o in rest.items] == ["c3", "c4", "c5"] and not rest.more


def test_a_page_read_at_an_earlier_version_sees_the_objects_as_they_were_then():
    """A `continue` page reads the first page's snapshot (etcd's revision): later creates, updates and
    deletes are undone; once the history that rebuilds it is gone, 410 Expired."""
    store = Store()
    _configmaps(store, "a", ["c1", "c2", "c3"])
    at = int(store.resource_version)
    store.remove("configmaps", "a", "c2")
    store.mutate("configmaps", "a", "c3", lambda o: o["metadata"]["labels"].update(even="changed"))
    _configmaps(store, "a", ["c4"])
    then = store.page("configmaps", after=("a", "c1"), at=at)
    assert [(o["metadata"]["name"], o["metadata"]["labels"]["even"]) for o in then.items] == [
        ("c2", "true"), ("c3", "false")]
    assert [o["metadata"]["name"] for o in store.page("configmaps", after=("a", "c1")).items] == ["c3", "c4"]
    short = Store(history_limit=2)
    _configmaps(short, "a", ["c1"])
    at = int(short.resource_version)
    _configmaps(short, "a", ["c2", "c3", "c4"])
    with pytest.raises(ApiError) as err:
        short.page("configmaps", at=at)
    assert (err.value.code, err.value.reason) == (410, "Expired")


class _CountingDict(dict):
    """Counts the stored objects a page looks at."""
    reads = 0

    def __getitem__(self, key):
        _CountingDict.reads += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("selector", [None, "even=true"])
def test_paging_through_everything_reads_each_object_about_once(selector):
    store = Store()
    _configmaps(store, "a", [f"c{i}" for i in range(3000)])
    store._objects["configmaps"] = _CountingDict(store._objects["configmaps"])
    _CountingDict.reads = 0
    pages = _all_pages(store, 50, label_selector=selector)
    assert sum(map(len, pages)) == (1500 if selector else 3000)
    # linear overall: each page starts right after the last key instead of rescanning from the start
    # (a rescan per page would read ~45,000 here); a page only peeks past its end for the next match
    assert _CountingDict.reads <= 3000 + 2 * len(pages)

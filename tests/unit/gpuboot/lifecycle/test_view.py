"""The watch-fed cluster view (gpuboot.lifecycle.view) on the in-memory fakes, with scripted watch
streams: the rule that says which ledger writes the pod stream covers, staleness (a release the
stream has not caught up with is still counted), 410 Gone (re-list), a dropped connection (resume
from the last version, no re-list), and the placer leading from the view with no full read.
tests/integration/test_cluster_view.py runs it on the local cloud's API server."""
from __future__ import annotations

import copy
import logging
import queue
import time

import pytest

from gpuboot.core.model import LABEL_JOB, LABEL_TASK, Reservation
from gpuboot.core.resources import Resources
from gpuboot.exceptions import Gone, NotPermitted
from gpuboot.lifecycle.batching import BatchPlacer
from gpuboot.lifecycle.booking import SURVEY_MAX_AGE_SECONDS
from gpuboot.lifecycle.ledger import Queued, RequestQueue
from gpuboot.lifecycle.view import ClusterView, ViewUnusable, covered_seq, version_number
from simcloud.harness import wait_until
from tests.builders import pod
from tests.fakes import T4, Cloud, cloud
from tests.unit.gpuboot.lifecycle.test_batching import booker, spec

LOG = logging.getLogger("test-view")
END = object()


class Streams:
    """list_versioned / stream_events over a FakeCluster (one resourceVersion counter for Nodes, pods
    and ConfigMaps, as etcd has), the events of each watch scripted by the test."""

    def __init__(self, c: Cloud) -> None:
        self.c = c
        self.pods: dict[str, dict] = {}
        self.scripts = {"nodes": queue.Queue(), "pods": queue.Queue()}
        self.opened: list[tuple[str, str]] = []      # (kind, resourceVersion) of each watch opened
        self.listed: list[str] = []
        self.asked: list[str] = []                  # request_progress calls, by kind
        self.answer_progress = False                # whether a progress request brings a bookmark

    def version(self) -> str:
        return str(self.c.cluster._version)

    def write_pod(self, obj: dict) -> dict:
        """A pod write (a new resourceVersion), kept for the next list; its event is the test's to send."""
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self.c.cluster._next_version()
        self.pods[obj["metadata"]["name"]] = obj
        return obj

    def list_versioned(self, kind: str):
        self.listed.append(kind)
        items = self.c.cluster.list_nodes() if kind == "nodes" else [copy.deepcopy(p) for p in self.pods.values()]
        return items, self.version()

    def stream_events(self, kind: str, resource_version: str, timeout_seconds: int):
        self.opened.append((kind, resource_version))
        while True:
            try:
                item = self.scripts[kind].get(timeout=0.05)
            except queue.Empty:
                return          # the watch's timeout: re-opened from the last version
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def send(self, kind: str, *items) -> None:
        for item in items:
            self.scripts[kind].put(item)

    def request_progress(self, kind: str) -> str:
        """The real server's answer to a consistent LIST: its cache moves to now, and the watch's next
        BOOKMARK says so (only if the test lets it: a quiet stream otherwise stays where it is)."""
        self.asked.append(kind)
        if self.answer_progress:
            self.bookmark(kind)
        return self.version()

    def bookmark(self, kind: str = "pods") -> None:
        self.send(kind, ("BOOKMARK", {"metadata": {"resourceVersion": self.version()}}))


def gpuboot_pod(job: str, node: str) -> dict:
    return pod(f"{job}-pod", node, requests={"nvidia.com/gpu": 1, "cpu": "1"},
               labels={LABEL_JOB: job, LABEL_TASK: "main"})


def started_view(c: Cloud, streams: Streams) -> ClusterView:
    return ClusterView(streams, c.ecs, monotonic=time.monotonic, log=LOG).start(timeout=10)


def test_the_rule_takes_the_newest_ledger_write_the_stream_has_passed():
    writes = [(10, 1), (15, 2), (30, 3)]
    assert covered_seq(writes, 9) is None
    assert covered_seq(writes, 10) == 1
    assert covered_seq(writes, 29) == 2
    assert covered_seq(writes, 1000) == 3
    assert version_number(None) == 0
    with pytest.raises(ViewUnusable, match="not an integer"):
        version_number("abc")


def test_events_and_bookmarks_move_the_view_and_what_it_has_passed():
    c = cloud()
    s = Streams(c)
    view = started_view(c, s)
    try:
        written = s.write_pod(gpuboot_pod("a", "gpu-run"))
        s.send("pods", ("ADDED", written))
        assert view.pods.wait_past(int(written["metadata"]["resourceVersion"]), 5)
        assert "default/a-pod" in view.pods.items
        done = s.write_pod({**written, "status": {"phase": "Succeeded"}})
        s.send("pods", ("MODIFIED", done))        # a pod that finished holds nothing: out of the view
        s.c.cluster._next_version()
        s.bookmark()
        assert view.pods.wait_past(int(s.version()), 5)
        assert "default/a-pod" not in view.pods.items
        assert s.listed == ["nodes", "pods"]       # one list each, then only the watches
    finally:
        view.stop(1)


def test_gone_relists_and_a_dropped_connection_resumes_from_the_last_version():
    c = cloud()
    s = Streams(c)
    view = started_view(c, s)
    try:
        first = s.write_pod(gpuboot_pod("a", "gpu-run"))
        s.send("pods", ("ADDED", first), ConnectionResetError("peer closed"))
        assert wait_until(lambda: view.pods.resumes == 1, timeout=5, interval=0.01)
        assert wait_until(lambda: ("pods", first["metadata"]["resourceVersion"]) in s.opened, timeout=5, interval=0.01)   # resumed, not listed
        assert s.listed.count("pods") == 1
        second = s.write_pod(gpuboot_pod("b", "gpu-run"))       # written while the stream is gone: the list has it
        s.send("pods", Gone("too old resource version"))
        assert wait_until(lambda: s.listed.count("pods") == 2, timeout=5, interval=0.01)
        assert view.pods.gone == 1
        assert wait_until(lambda: "default/b-pod" in view.pods.items, timeout=5, interval=0.01)
        assert view.pods.passed >= int(second["metadata"]["resourceVersion"])
    finally:
        view.stop(1)


def test_a_stale_pod_stream_still_counts_a_release_it_has_not_seen_the_pod_of():
    """The unsafe order: job a's pod is bound and its reservation released, but the view's pod
    stream has not delivered the pod. A placement from the view must still count gpu-run as taken
    (a's tombstone: it was released after the newest ledger write the stream covers)."""
    c = cloud()
    s = Streams(c)
    ledger = c.ledger()
    ledger.commit("a", [Reservation("a", "main", "gpu-run", Resources.parse({"nvidia.com/gpu": 1, "cpu": "1"}),
                                     c.clock() + 600)], ledger.snapshot().version)
    view = started_view(c, s)
    try:
        view.note(ledger.name, ledger.snapshot())       # the placer read it: covered by the first list
        s.write_pod(gpuboot_pod("a", "gpu-run"))        # bound ...
        ledger.release("a")                             # ... then released; the stream lags behind both
        state = ledger.snapshot()
        got = view.basis(ledger.name, state, c.clock(), wait=0.2)
        assert got is not None
        basis, released = got
        assert basis.seq != state.seq and [r.job_id for r in released] == ["a"]     # an older s0
        b = booker(c)
        RequestQueue(c.cluster, clock=c.clock).add(
            Queued("b", "b:1", spec("b").to_job_request("b").to_json(), 600.0, c.clock() + 60))
        placer = BatchPlacer(b, None)
        assert placer._take_lease(ledger.snapshot(), "placer-1:x")
        placer.lead("placer-1:x", view=view, stay=True)
        answer = ledger.snapshot().batch.answer("b:1")
        assert answer is not None and b.full_reads == 0
        assert "gpu-run" not in [a["node"] for a in answer.plan.get("assignments", [])]
        # once the stream passes the release, the view shows the pod instead and s0 is the release's write
        pod_now = s.pods["a-pod"]
        s.send("pods", ("ADDED", pod_now))
        s.bookmark()
        state = ledger.snapshot()
        basis, released = view.basis(ledger.name, state, c.clock(), fresh=True, wait=5)
        assert basis.seq == state.seq and released == []
        assert next(v for v in basis.survey.views if v.name == "gpu-run").free.gpus == 0
    finally:
        view.stop(1)


def test_a_fresh_basis_asks_a_quiet_pod_stream_for_progress_and_follows_its_bookmark():
    """A ledger write the quiet pod stream has not passed: its bookmarks carry the API server's pod cache
    version, which moves on only when asked (a consistent LIST). Asked once, the basis covers the write;
    a stream that never answers leaves the placement to a full read."""
    c = cloud()
    s = Streams(c)
    ledger = c.ledger()
    view = started_view(c, s)
    try:
        ledger.commit("a", [Reservation("a", "main", "gpu-run", Resources.parse({"nvidia.com/gpu": 1, "cpu": "1"}),
                                         c.clock() + 600)], ledger.snapshot().version)
        state = ledger.snapshot()
        assert view.basis(ledger.name, state, c.clock(), fresh=True, wait=0.2) is None     # nobody answered
        assert s.asked == ["pods"]
        s.answer_progress = True
        basis, released = view.basis(ledger.name, state, c.clock(), fresh=True, wait=5)
        assert basis.seq == state.seq and released == [] and s.asked == ["pods", "pods"]
        view.basis(ledger.name, state, c.clock(), fresh=True, wait=5)
        assert s.asked == ["pods", "pods"] and view.pods.progress_asked == 2     # passed: nothing to ask
    finally:
        view.stop(1)


def test_a_quiet_stream_asks_for_progress_once_per_quiet_period_so_it_never_falls_out_of_the_history():
    """Nothing changes in a collection for QUIET_SECONDS: its watch would resume from an ever older
    version (a 410 and a re-list once the history moved past it), so it asks for progress, and the
    bookmark that brings moves it on; at most once per quiet period."""
    from gpuboot.lifecycle.view import QUIET_SECONDS

    c = cloud()
    s = Streams(c)
    s.answer_progress = True
    now = [1000.0]
    view = ClusterView(s, c.ecs, monotonic=lambda: now[0], log=LOG).start(timeout=10)
    try:
        assert wait_until(lambda: len(s.opened) >= 4, timeout=5, interval=0.01)     # watches re-opened, quiet
        assert s.asked == []
        passed = view.pods.passed
        c.cluster._next_version()                   # another resource's write: the pods stream is behind it
        now[0] += QUIET_SECONDS + 1
        assert wait_until(lambda: sorted(s.asked) == ["nodes", "pods"] and view.nodes.passed > passed
                          and view.pods.passed > passed, timeout=5, interval=0.01)   # one ask each, both moved on
        opened = len(s.opened)
        assert wait_until(lambda: len(s.opened) >= opened + 6, timeout=5, interval=0.01)
        assert len(s.asked) == 2                    # not again within the quiet period
    finally:
        view.stop(1)


def test_a_disconnected_view_refuses_a_fresh_basis_and_the_leader_reads_in_full():
    c = cloud()
    s = Streams(c)
    view = started_view(c, s)
    try:
        s.send("pods", ConnectionResetError("gone"))
        assert wait_until(lambda: view.pods.stale_since is not None or view.pods.resumes, timeout=5, interval=0.01)
        view.pods.stale_since = view.pods.stale_since or time.monotonic()
        assert view.basis(c.ledger().name, c.ledger().snapshot(), c.clock(), fresh=True, wait=0.1) is None
    finally:
        view.stop(1)


class MayNotWatchPods(Streams):
    """The place steps' identity as a placer's: it may list pods but not watch them (403, every time)."""

    def stream_events(self, kind: str, resource_version: str, timeout_seconds: int):
        if kind == "pods":
            self.opened.append((kind, resource_version))
            raise NotPermitted("403 Forbidden: watch pods")
        return super().stream_events(kind, resource_version, timeout_seconds)


def test_a_view_that_may_not_watch_says_which_right_is_missing_and_past_a_surveys_age_the_leader_reads_in_full(
        caplog):
    """A watch the identity may not open leaves the view as listed: logged as an error naming the right
    (once, though it is tried again); the view still serves while that list is younger than a survey the
    single path would re-place against (SURVEY_MAX_AGE_SECONDS), then gives no basis, and the leader
    reads the cluster in full instead of answering "fits" from pods it no longer sees bound."""
    c = cloud()
    s = MayNotWatchPods(c)
    now = [1000.0]
    view = ClusterView(s, c.ecs, monotonic=lambda: now[0], log=LOG).start(timeout=10)
    try:
        assert wait_until(lambda: len([o for o in s.opened if o[0] == "pods"]) >= 2, timeout=10, interval=0.01)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "may not watch pods" in errors[0] and "gpuboot-placer" in errors[0]
        assert not view.connected()
        assert view.basis(c.ledger().name, c.ledger().snapshot(), c.clock()) is not None   # listed just now
        now[0] += SURVEY_MAX_AGE_SECONDS + 1
        assert view.basis(c.ledger().name, c.ledger().snapshot(), c.clock()) is None
        b = booker(c)
        RequestQueue(c.cluster, clock=c.clock).add(
            Queued("b", "b:1", spec("b").to_job_request("b").to_json(), 600.0, c.clock() + 60))
        placer = BatchPlacer(b, None)
        assert placer._take_lease(c.ledger().snapshot(), "placer-1:x")
        placer.lead("placer-1:x", view=view, stay=True)
        assert c.ledger().snapshot().batch.answer("b:1") is not None
        assert b.full_reads == 1
    finally:
        view.stop(1)


def test_the_view_describes_only_the_instances_whose_nodes_changed():
    c = cloud()
    s = Streams(c)
    view = started_view(c, s)
    try:
        state = c.ledger().snapshot()
        view.basis("x", state, c.clock())
        calls = []
        real = c.ecs.describe_instances
        c.ecs.describe_instances = lambda ids: calls.append(list(ids)) or real(ids)
        view.basis("x", state, c.clock())
        assert calls == []                      # nothing changed: no DescribeInstances
        node = c.cluster.get_node("gpu-stop")
        node["status"]["nodeInfo"] = {**(node["status"].get("nodeInfo") or {}), "bootID": "new-boot"}
        c.cluster.put_node(node)
        s.send("nodes", ("MODIFIED", c.cluster.get_node("gpu-stop")))
        assert wait_until(lambda: view.nodes.items["gpu-stop"]["status"].get("nodeInfo", {}).get("bootID") == "new-boot", timeout=5, interval=0.01)
        view.basis("x", state, c.clock())
        assert len(calls) == 1 and len(calls[0]) == 1      # that node's instance only
    finally:
        view.stop(1)


def test_a_nodes_ledger_claim_does_not_rebuild_the_inventory_but_the_survey_holds_the_node_as_it_is():
    """A batch claims the Nodes it books (an annotation): nothing placement reads, so the inventory built
    before is kept (it took 1.8 s a batch on 10,000 nodes), while its survey's Nodes are the claimed ones
    (the next claim sees the mark); a change placement does read (a label) rebuilds it."""
    from gpuboot.core.model import ANNOTATION_LEDGER

    c = cloud()
    s = Streams(c)
    view = started_view(c, s)
    try:
        state = c.ledger().snapshot()
        first = view.basis("x", state, c.clock())[0].survey
        built = view._built

        def modified(change) -> None:
            node = c.cluster.get_node("gpu-run")
            change(node)
            c.cluster.put_node(node)
            s.send("nodes", ("MODIFIED", c.cluster.get_node("gpu-run")))
            version = int(c.cluster.get_node("gpu-run")["metadata"]["resourceVersion"])
            assert wait_until(lambda: view.nodes.passed >= version, timeout=5, interval=0.01)

        modified(lambda n: n["metadata"].setdefault("annotations", {}).update({ANNOTATION_LEDGER: "default/x"}))
        again = view.basis("x", state, c.clock())[0].survey
        assert view._built is built and again.bare is first.bare           # not rebuilt
        claimed = next(n for n in again.nodes if n["metadata"]["name"] == "gpu-run")
        assert claimed["metadata"]["annotations"][ANNOTATION_LEDGER] == "default/x"
        modified(lambda n: n["metadata"].setdefault("labels", {}).update({"team": "b"}))
        view.basis("x", state, c.clock())
        assert view._built is not built                                    # a label: rebuilt
    finally:
        view.stop(1)


def test_stop_ends_the_watch_threads():
    c = cloud()
    view = started_view(c, Streams(c))
    view.stop(2)
    assert not any(t.is_alive() for t in view._threads)


class Behind:
    """A connected view that cannot say what it covers for its first `times` asks (re-listing after a 410)."""

    def __init__(self, view: ClusterView, times: int) -> None:
        self.view, self.times, self.asked = view, times, 0

    def basis(self, *args, **kwargs):
        self.asked += 1
        if self.times:
            self.times -= 1
            return None
        return self.view.basis(*args, **kwargs)

    def connected(self) -> bool:
        return True


@pytest.mark.parametrize("patience", [None, 0])
def test_a_leader_waits_for_a_connected_view_that_is_behind_and_reads_in_full_only_past_its_patience(
        patience, monkeypatch):
    """Its view behind (a re-list of 80,000 pods after a 410 takes a while), the leader looks again rather
    than reading the cluster in full, which costs more than the catching up; only a view behind for longer
    than VIEW_PATIENCE_SECONDS (here 0) sends it to a full read."""
    from gpuboot.lifecycle import batching

    if patience is not None:
        monkeypatch.setattr(batching, "VIEW_PATIENCE_SECONDS", patience)
    c = cloud()
    s = Streams(c)
    view = started_view(c, s)
    try:
        b = booker(c)
        RequestQueue(c.cluster, clock=c.clock).add(
            Queued("b", "b:1", spec("b").to_job_request("b").to_json(), 600.0, c.clock() + 60))
        placer = BatchPlacer(b, None)
        assert placer._take_lease(c.ledger().snapshot(), "placer-1:x")
        behind = Behind(view, 3)
        placer.lead("placer-1:x", view=behind, stay=True)
        assert c.ledger().snapshot().batch.answer("b:1") is not None
        if patience is None:
            assert b.full_reads == 0 and behind.asked == 4
        else:
            assert b.full_reads == 1 and behind.asked == 1
    finally:
        view.stop(1)


def test_an_idle_placer_reads_the_ledger_shards_for_its_view_once_per_note_period_not_every_poll():
    """Idle, the placer looks at the queue every poll (the root and the queue shards) but at the ledger's
    shards, which only its view's bookkeeping needs, once per NOTE_SECONDS: 64 GETs a second saved."""
    import threading

    from gpuboot.lifecycle import placer as placer_module

    c = cloud()
    view = started_view(c, Streams(c))
    b = booker(c)
    shards = set(b.ledger.shard_names())
    reads, lock = {"root": 0, "shards": 0}, threading.Lock()
    read = c.cluster.read_configmap

    def counted(namespace, name, cached=False):
        with lock:
            if name == b.ledger.name:
                reads["root"] += 1
            elif name in shards:
                reads["shards"] += 1
        return read(namespace, name, cached)

    c.cluster.read_configmap = counted
    placer = placer_module.Placer(b, view, name="idle", poll_seconds=0.01)
    stop = threading.Event()
    thread = threading.Thread(target=placer.run, args=(stop,))
    thread.start()
    try:
        wait_until(lambda: reads["root"] >= 30, timeout=20, message="thirty idle polls")
        with lock:
            first = reads["shards"]
        # the start's basis and the first idle poll read every shard; thirty polls later, none more
        assert 0 < first <= 2 * len(shards), reads
        wait_until(lambda: reads["root"] >= 60, timeout=20, message="thirty more idle polls")
        assert reads["shards"] == first, reads
        c.clock.advance(placer_module.NOTE_SECONDS)
        wait_until(lambda: reads["shards"] > first, timeout=20, message="the next note of the ledger")
        assert reads["shards"] <= first + len(shards)
    finally:
        stop.set()
        thread.join(10)
        view.stop(1)
    assert not thread.is_alive()


def test_the_inventory_built_again_only_for_the_nodes_touched_equals_a_whole_build():
    """Between two batches only some nodes change (pods start and end, a node is cordoned or labelled): the
    view builds again only their views (`rejoined`), and the inventory it gives is, view for view, the one
    a whole build of the same Nodes and pods gives (`joined`), over a random run of changes; a re-list
    builds it whole."""
    import random

    from gpuboot.lifecycle.booking import joined

    rng = random.Random(7)
    fleet = {f"n-{i:02d}": ("Running" if i % 4 else "Stopped", T4) for i in range(40)}
    c = cloud(fleet)
    s = Streams(c)
    running = [n for n, (status, _) in fleet.items() if status == "Running"]
    for i in range(60):
        s.write_pod(pod(f"p-{i}", rng.choice(running), requests={"cpu": "1", "nvidia.com/gpu": rng.choice([0, 1])}))
    view = started_view(c, s)
    try:
        state = c.ledger().snapshot()
        view.basis("x", state, c.clock())
        whole = view.full_builds
        for step in range(30):
            for _ in range(rng.randint(1, 4)):
                what = rng.random()
                if what < 0.35:         # a pod starts
                    new = s.write_pod(pod(f"p-{step}-{rng.random():.6f}", rng.choice(running),
                                          requests={"cpu": "2", "nvidia.com/gpu": 1}))
                    s.send("pods", ("ADDED", new))
                elif what < 0.6 and s.pods:     # a pod ends, or is deleted
                    name = rng.choice(sorted(s.pods))
                    gone = s.write_pod({**s.pods.pop(name), "status": {"phase": "Succeeded"}})
                    del s.pods[name]
                    s.send("pods", ("MODIFIED" if rng.random() < 0.5 else "DELETED", gone))
                else:                   # a node is cordoned, uncordoned or labelled
                    node = c.cluster.get_node(rng.choice(sorted(fleet)))
                    if rng.random() < 0.5:
                        node["spec"]["unschedulable"] = not node["spec"].get("unschedulable")
                    else:
                        node["metadata"].setdefault("labels", {})["team"] = rng.choice("abc")
                    c.cluster.put_node(node)
                    s.send("nodes", ("MODIFIED", c.cluster.get_node(node["metadata"]["name"])))
            s.bookmark("pods")
            s.bookmark("nodes")
            version = int(s.version())
            assert wait_until(lambda: view.pods.passed >= version and view.nodes.passed >= version,
                              timeout=5, interval=0.01)
            survey = view.basis("x", state, c.clock())[0].survey
            nodes, pods = view.nodes.snapshot()[0], view.pods.snapshot()[0]
            instances, types, _ = view._instances_of(nodes)
            assert survey.bare == joined(nodes, pods, instances, types, [], c.clock()).bare, f"step {step}"
            assert survey.backed == joined(nodes, pods, instances, types, [], c.clock()).backed
        assert view.full_builds == whole            # every one of them built again only what was touched
        s.send("pods", Gone("410: too old resource version"))       # a re-list touches everything
        assert wait_until(lambda: view.pods.lists == 2, timeout=5, interval=0.01)
        view.basis("x", state, c.clock())
        assert view.full_builds == whole + 1
    finally:
        view.stop(1)

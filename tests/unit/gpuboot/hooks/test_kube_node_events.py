"""The Kubernetes adapter's one stream of a Node's states, against a small in-memory fake client:
resume from the last resourceVersion (or a later bookmark's), re-list on 410 Gone (flagged) at the
collection's version, reconnect after errors."""
import asyncio

from gpuboot.hooks.kube import Gone, NodeEvents, _NodePump


def node(rv: str, gpus: str = "1") -> dict:
    return {"metadata": {"name": "n", "resourceVersion": rv}, "status": {"allocatable": {"nvidia.com/gpu": gpus}}}


class FakeClient:
    """Scripted watches: each call to watch_node pops one script (a list of events, or an exception)."""

    kubernetes_conn_id = "fake"

    def __init__(self, scripts, current):
        self.scripts, self.current, self.watched_from, self.gets = list(scripts), current, [], 0

    async def node_to_watch(self, name):
        self.gets += 1
        return self.current, self.current["metadata"]["resourceVersion"]

    async def watch_node(self, name, resource_version, timeout_seconds, bookmarks=False):
        self.watched_from.append(resource_version)
        script = self.scripts.pop(0) if self.scripts else []
        if isinstance(script, Exception):
            raise script
        for event in script:
            yield event
        if not self.scripts:
            await asyncio.sleep(3600)      # an idle watch


async def collect(client, since, count):
    async with NodeEvents(client, "n", since, backoff=(0.01, 0.02)) as events:
        return [await events.next(5) for _ in range(count)]


def test_resumes_from_the_last_version_relists_on_410_and_reconnects_after_errors():
    client = FakeClient([[("MODIFIED", node("11", "0"))], Gone("too old"), ConnectionError("reset"),
                         [("MODIFIED", node("31", "1")), ("DELETED", node("32"))]], current=node("30", "1"))
    seen = asyncio.run(collect(client, "10", 4))
    assert [(e.node.get("metadata", {}).get("resourceVersion"), e.relisted) for e in seen] == [
        ("11", False), ("30", True), ("31", False), (None, False)]
    assert seen[-1].node == {}                                       # deleted
    assert client.watched_from == ["10", "11", "30", "30"]           # resumed, re-listed, retried, resumed
    assert client.gets == 1


def test_without_a_version_it_lists_first_and_a_quiet_stream_times_out_without_ending():
    client = FakeClient([[]], current=node("7"))

    async def run():
        async with NodeEvents(client, "n", None, backoff=(0.01, 0.02)) as events:
            first = await events.next(5)
            quiet = await events.next(0.05)
            return first, quiet, events._pump.task.done()

    first, quiet, ended = asyncio.run(run())
    assert first.node["metadata"]["resourceVersion"] == "7" and not first.relisted
    assert quiet is None and not ended


class Server:
    """One Node's writes as an API server keeps them: a watch from version r yields every write
    after r in order, then each new write (and, when asked, the bookmarks sent since it opened);
    `expire()` ends the open watches with 410 Gone and refuses watches from before that point
    (compaction); `others(rv)` stands for other Nodes' writes, which move only the collection's
    version; `end_watches()` is the server's timeoutSeconds running out."""

    kubernetes_conn_id = "fake"

    def __init__(self):
        self.writes: list[dict] = []
        self.bookmarks: list[dict] = []
        self.collection = 0              # the Node collection's version: any Node's last write
        self.compacted = 0
        self.generation = 0              # bumped when the server ends its open watches
        self.taken = 0                   # bookmarks the reader of a watch has taken
        self.watched_from: list[str] = []
        self.changed = asyncio.Condition()

    async def write(self, rv: int, gpus: str = "1") -> None:
        async with self.changed:
            self.writes.append(node(str(rv), gpus))
            self.collection = rv
            self.changed.notify_all()

    async def others(self, rv: int) -> None:
        async with self.changed:
            self.collection = rv
            self.changed.notify_all()

    async def bookmark(self) -> None:
        """Send a bookmark at the collection's version; return once the open watch has taken it."""
        async with self.changed:
            self.bookmarks.append({"metadata": {"resourceVersion": str(self.collection)}})
            self.changed.notify_all()
            async with asyncio.timeout(5):
                await self.changed.wait_for(lambda: self.taken == len(self.bookmarks))

    async def end_watches(self) -> None:
        async with self.changed:
            self.generation += 1
            self.changed.notify_all()

    async def expire(self, at: int | None = None) -> None:
        async with self.changed:
            self.compacted = at if at is not None else int(self.writes[-1]["metadata"]["resourceVersion"]) + 1
            self.changed.notify_all()

    async def node_to_watch(self, name):
        return self.writes[-1], str(self.collection)

    async def watch_node(self, name, resource_version, timeout_seconds, bookmarks=False):
        self.watched_from.append(resource_version)
        since, marks, generation = int(resource_version), len(self.bookmarks), self.generation
        while True:
            async with self.changed:
                if since < self.compacted:      # a watch that has come past the compaction goes on
                    raise Gone("too old")
                fresh = [w for w in self.writes if int(w["metadata"]["resourceVersion"]) > since]
                marked = self.bookmarks[marks:] if bookmarks else []
                if not fresh and not marked:
                    if generation != self.generation:
                        return                  # what was sent before the end arrives first
                    await self.changed.wait()
                    continue
            for w in fresh:
                since = int(w["metadata"]["resourceVersion"])
                yield "MODIFIED", w
            for mark in marked:
                marks, since = marks + 1, max(since, int(mark["metadata"]["resourceVersion"]))
                yield "BOOKMARK", mark
                async with self.changed:        # the reader asked for more: it has taken this one
                    self.taken += 1
                    self.changed.notify_all()


def versions(events) -> list[tuple[str, bool]]:
    return [(e.node["metadata"]["resourceVersion"], e.relisted) for e in events]


async def drain(events, count):
    return [await events.next(5) for _ in range(count)]


async def until_relisted(events, limit=5):
    got = []
    while not got or not got[-1].relisted:
        got.append(await events.next(5))
        assert got[-1] is not None and len(got) <= limit, versions(got[:-1])
    return got


def test_readers_of_one_node_share_one_watch_and_each_gets_exactly_the_writes_after_its_version():
    """As a burst of jobs booting one node meets it: readers join one after another, each from the
    version its start step read; each gets what a watch of its own would (every write after its
    version, in order), through the one watch the first reader opened."""
    async def run():
        server = Server()
        async with NodeEvents(server, "n", "10") as a:
            for rv in (11, 12, 13):
                await server.write(rv)
            assert versions(await drain(a, 3)) == [("11", False), ("12", False), ("13", False)]
            async with NodeEvents(server, "n", "12") as b, NodeEvents(server, "n", "15") as c:
                for rv in (14, 15, 16):
                    await server.write(rv)
                got = {"a": await drain(a, 3), "b": await drain(b, 4), "c": await drain(c, 1)}
                quiet = [await r.next(0.05) for r in (a, b, c)]
            return server, got, quiet

    server, got, quiet = asyncio.run(run())
    assert versions(got["a"]) == [("14", False), ("15", False), ("16", False)]
    assert versions(got["b"]) == [("13", False), ("14", False), ("15", False), ("16", False)]
    assert versions(got["c"]) == [("16", False)]
    assert quiet == [None, None, None]                 # nothing twice, nothing from before a reader's version
    assert server.watched_from == ["10"]               # one watch for the three
    assert _NodePump._shared == {}                     # the last reader out stopped the pump


def test_a_reader_from_before_the_shared_history_or_without_a_version_gets_its_own_watch():
    async def run():
        server = Server()
        await server.write(5)
        async with NodeEvents(server, "n", "10") as a, NodeEvents(server, "n", "8") as older, \
                NodeEvents(server, "n", None) as fresh:
            listed = await drain(fresh, 1)
            await server.write(11)
            got = [await drain(a, 1), await drain(older, 1), listed + await drain(fresh, 1)]
            later = NodeEvents(server, "n", "9")       # after `older` replaced `a` as the pump to join
            async with later:
                await server.write(12)
                got.append(await drain(later, 2))
        return server, got

    server, (a, older, fresh, later) = asyncio.run(run())
    assert versions(a) == versions(older) == [("11", False)]
    assert versions(fresh) == [("5", False), ("11", False)]     # listed first, then watched
    assert sorted(server.watched_from) == ["10", "5", "8"]       # three watches: none from 9
    assert versions(later) == [("11", False), ("12", False)]     # joined older's pump, from its history


def test_readers_whose_versions_are_not_numbers_are_never_merged():
    """The API calls resourceVersions opaque: only etcd's numbers are compared, anything else keeps
    its own watch."""
    class Opaque(FakeClient):
        async def watch_node(self, name, resource_version, timeout_seconds, bookmarks=False):
            self.watched_from.append(resource_version)
            yield "MODIFIED", node("x8")
            await asyncio.sleep(3600)

    client = Opaque([], current=node("x7"))

    async def run():
        async with NodeEvents(client, "n", "x7") as one, NodeEvents(client, "n", "x7") as two:
            return await drain(one, 1), await drain(two, 1)

    one, two = asyncio.run(run())
    assert versions(one) == versions(two) == [("x8", False)]
    assert client.watched_from == ["x7", "x7"]


def test_a_410_reaches_every_reader_of_the_shared_watch_flagged_and_new_readers_do_not_rely_on_the_gap():
    async def run():
        server = Server()
        await server.write(20)
        async with NodeEvents(server, "n", "20") as a, NodeEvents(server, "n", "20") as b:
            await server.write(21)
            first = (await drain(a, 1), await drain(b, 1))
            await server.write(22)
            await server.expire()                       # the watch dies with 410 after 22 (maybe unseen)
            await server.write(23)
            relisted = (await until_relisted(a), await until_relisted(b))
            async with NodeEvents(server, "n", "21") as c:  # from before the gap: not served from the history
                await server.write(24)
                after = await drain(c, 1)
        return server, first, relisted, after

    server, first, (a, b), after = asyncio.run(run())
    assert versions(first[0]) == versions(first[1]) == [("21", False)]
    assert versions(a) == versions(b) and a[-1].relisted    # 22 if the watch got it before the 410, then the re-list
    assert server.watched_from.count("21") == 1         # c's own watch (from 21) was refused...
    assert after[0].relisted                             # ...so c re-listed, flagged, like a reader alone


def test_a_quiet_node_older_than_the_history_is_relisted_once_at_the_collections_version():
    """A node stopped for long: its own last write (5) is older than what the server keeps (30).
    The re-list takes the Node collection's version (40), so the watch resumes; the Node's own
    version would be refused again at once, a 410 loop for as long as the node stays quiet."""
    async def run():
        server = Server()
        await server.write(5)
        await server.others(40)
        await server.expire(at=30)
        async with NodeEvents(server, "n", "5", backoff=(0.01, 0.02)) as events:
            relisted = await events.next(5)
            await server.write(41)
            return server, [relisted, await events.next(5), await events.next(0.1)]

    server, (relisted, written, quiet) = asyncio.run(run())
    assert (versions([relisted]), versions([written]), quiet) == ([("5", True)], [("41", False)], None)
    assert server.watched_from == ["5", "40"]


def test_a_bookmark_moves_the_version_a_quiet_watch_resumes_from_and_is_not_an_event():
    """The server ends a quiet Node's watch; other Nodes' writes moved the collection past a
    compaction meanwhile. Resumed from the bookmark's version, not the Node's own last write,
    the watch goes on with no 410 and no re-list."""
    async def run():
        server = Server()
        await server.write(10)
        async with NodeEvents(server, "n", "10") as events:
            await server.write(11)
            first = await events.next(5)
            await server.others(50)
            await server.bookmark()
            await server.end_watches()
            await server.expire(at=45)
            async with asyncio.timeout(5):
                while len(server.watched_from) < 2:     # the pump has resumed its watch
                    await asyncio.sleep(0.001)
            await server.write(51)
            return server, [first, await events.next(5), await events.next(0.1)]

    server, (first, written, quiet) = asyncio.run(run())
    assert (versions([first]), versions([written]), quiet) == ([("11", False)], [("51", False)], None)
    assert server.watched_from == ["10", "50"]

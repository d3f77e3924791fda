"""The Kubernetes adapter's one stream of a Node's states, against a small in-memory fake client:
resume from the last resourceVersion, re-list on 410 Gone (flagged), reconnect after errors."""
import asyncio

from gpuboot.hooks.kube import Gone, NodeEvents, _NodePump


def node(rv: str, gpus: str = "1") -> dict:
    return {"metadata": {"name": "n", "resourceVersion": rv}, "status": {"allocatable": {"nvidia.com/gpu": gpus}}}


class FakeClient:
    """Scripted watches: each call to watch_node pops one script (a list of events, or an exception)."""

    kubernetes_conn_id = "fake"

    def __init__(self, scripts, current):
        self.scripts, self.current, self.watched_from, self.gets = list(scripts), current, [], 0

    async def get_node(self, name):
        self.gets += 1
        return self.current

    async def watch_node(self, name, resource_version, timeout_seconds):
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
    after r in order, then each new write; `expire()` ends the open watches with 410 Gone and
    refuses watches from before that point (compaction)."""

    kubernetes_conn_id = "fake"

    def __init__(self):
        self.writes: list[dict] = []
        self.compacted = 0
        self.watched_from: list[str] = []
        self.changed = asyncio.Condition()

    async def write(self, rv: int, gpus: str = "1") -> None:
        async with self.changed:
            self.writes.append(node(str(rv), gpus))
            self.changed.notify_all()

    async def expire(self) -> None:
        async with self.changed:
            self.compacted = int(self.writes[-1]["metadata"]["resourceVersion"]) + 1
            self.changed.notify_all()

    async def get_node(self, name):
        return self.writes[-1]

    async def watch_node(self, name, resource_version, timeout_seconds):
        self.watched_from.append(resource_version)
        since, sent = int(resource_version), 0
        while True:
            async with self.changed:
                if since < self.compacted:
                    raise Gone("too old")
                fresh = [w for w in self.writes if int(w["metadata"]["resourceVersion"]) > since][sent:]
                if not fresh:
                    await self.changed.wait()
                    continue
            for w in fresh:
                sent += 1
                yield "MODIFIED", w


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
        async def watch_node(self, name, resource_version, timeout_seconds):
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

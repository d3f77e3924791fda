"""The Kubernetes adapter's one stream of a Node's states, against a small in-memory fake client:
resume from the last resourceVersion, re-list on 410 Gone (flagged), reconnect after errors."""
import asyncio

from gpuboot.kube import Gone, NodeEvents


def node(rv: str, gpus: str = "1") -> dict:
    return {"metadata": {"name": "n", "resourceVersion": rv}, "status": {"allocatable": {"nvidia.com/gpu": gpus}}}


class FakeClient:
    """Scripted watches: each call to watch_node pops one script (a list of events, or an exception)."""

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
            return first, quiet, events._task.done()

    first, quiet, ended = asyncio.run(run())
    assert first.node["metadata"]["resourceVersion"] == "7" and not first.relisted
    assert quiet is None and not ended

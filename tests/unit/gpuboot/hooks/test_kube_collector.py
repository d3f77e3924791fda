"""collector_paused: the cyclic GC is off while any thread lists, and back as it was after the last."""
from __future__ import annotations

import gc
import threading

import pytest

from gpuboot.hooks.kube import KubeClient, collector_paused


class Pages:
    """A list call answering page after page (the shape `_list` reads), noting the collector each time."""

    def __init__(self, pages: int, fail_at: int | None = None):
        self.pages, self.fail_at, self.collector_on = pages, fail_at, []

    def __call__(self, limit, _continue, _preload_content, **_):
        index = int(_continue or 0)
        self.collector_on.append(gc.isenabled())
        if index == self.fail_at:
            raise ConnectionError("the API server went away")
        more = index + 1 < self.pages
        body = '{"items": [{"i": %d}], "metadata": {%s}}' % (index, f'"continue": "{index + 1}"' if more else "")
        return type("Response", (), {"data": body.encode()})()


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_a_list_runs_with_the_collector_off_and_leaves_it_on(collector_on):
    pages = Pages(3)
    assert KubeClient()._list(pages) == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert pages.collector_on == [False, False, False]
    assert gc.isenabled()


def test_a_failed_list_turns_the_collector_back_on(collector_on):
    with pytest.raises(ConnectionError):
        KubeClient()._list(Pages(3, fail_at=1))
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(collector_on):
    gc.disable()
    KubeClient()._list(Pages(2))
    assert not gc.isenabled()


def test_many_threads_listing_at_once_leave_it_on_only_after_the_last(collector_on):
    inside, leave = threading.Barrier(8 + 1), threading.Event()

    def lister():
        with collector_paused():
            inside.wait(timeout=30)          # all eight are in
            leave.wait(timeout=30)

    threads = [threading.Thread(target=lister) for _ in range(8)]
    for thread in threads:
        thread.start()
    inside.wait(timeout=30)
    assert not gc.isenabled()
    leave.set()
    for thread in threads:
        thread.join(timeout=30)
    assert gc.isenabled()


def test_threads_leaving_one_by_one_keep_it_off_until_the_last(collector_on):
    gates = [threading.Event() for _ in range(4)]
    entered = threading.Barrier(4 + 1)
    left = []

    def lister(gate):
        with collector_paused():
            entered.wait(timeout=30)
            gate.wait(timeout=30)
        left.append(gate)

    threads = [threading.Thread(target=lister, args=(gate,)) for gate in gates]
    for thread in threads:
        thread.start()
    entered.wait(timeout=30)
    for i, (gate, thread) in enumerate(zip(gates, threads)):
        gate.set()
        thread.join(timeout=30)
        assert gc.isenabled() == (i == len(gates) - 1), f"after {i + 1} of {len(gates)} left"

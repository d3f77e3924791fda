"""The replay's event clock: time order, same-instant priority, FIFO, no going back."""
import pytest

from gpuboot.replay.clock import EventClock, Kind


def drain(clock):
    out = []
    while (event := clock.pop()) is not None:
        out.append((event.at, event.kind, event.payload))
    return out


def test_events_come_out_in_time_order_and_now_follows():
    clock = EventClock(0)
    for at, name in [(30, "c"), (10, "a"), (20, "b")]:
        clock.schedule(at, Kind.ARRIVAL, name)
    seen = []
    while (event := clock.pop()) is not None:
        seen.append((event.payload, clock.now))
    assert seen == [("a", 10), ("b", 20), ("c", 30)]


def test_same_instant_frees_capacity_before_arrivals_and_idle_checks_last():
    clock = EventClock(0)
    clock.schedule(5, Kind.IDLE_CHECK, "idle")
    clock.schedule(5, Kind.ARRIVAL, "arrive")
    clock.schedule(5, Kind.NODE_READY, "ready")
    clock.schedule(5, Kind.JOB_END, "end")
    assert [p for _, _, p in drain(clock)] == ["end", "ready", "arrive", "idle"]


def test_same_instant_and_kind_is_first_in_first_out():
    clock = EventClock(0)
    for name in "xyz":
        clock.schedule(7, Kind.ARRIVAL, name)
    assert [p for _, _, p in drain(clock)] == ["x", "y", "z"]


def test_scheduling_in_the_past_is_refused():
    clock = EventClock(100)
    with pytest.raises(ValueError, match="before now"):
        clock.schedule(99, Kind.ARRIVAL)

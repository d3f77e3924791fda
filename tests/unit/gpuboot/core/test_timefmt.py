"""One way to write a time or a duration for people, one for machines."""
from __future__ import annotations

import pytest

from gpuboot.core.timefmt import duration, relative, rfc3339, utc, utc_relative

T0 = 1764581211.0     # 2025-12-01 09:26:51 UTC


def test_utc_is_seconds_and_says_utc():
    assert utc(T0) == "2025-12-01 09:26:51 UTC" and utc(T0 + 0.9) == "2025-12-01 09:26:51 UTC"
    assert utc(None) == "-"


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0.0 s"), (-1, "0.0 s"), (0.44, "0.4 s"), (17.24, "17.2 s"), (119.94, "119.9 s"),
    (120, "2 min 00 s"), (125.9, "2 min 05 s"), (599.9, "9 min 59 s"), (600, "10 min"), (7199, "119 min"),
    (7200, "2 h 00 min"), (7319, "2 h 01 min"), (47 * 3600 + 59 * 60, "47 h 59 min"),
    (2 * 86400, "2 d 00 h"), (9 * 86400 + 5 * 3600, "9 d 05 h"), (None, "-"),
])
def test_durations_read_well(seconds, text):
    assert duration(seconds) == text


def test_relative_says_which_side_of_now():
    assert relative(T0 + 250, T0) == "in 4 min 10 s"
    assert relative(T0 - 30, T0) == "30.0 s ago"
    assert relative(T0 + 0.5, T0) == "now" and relative(None, T0) == "-"
    assert utc_relative(T0 + 60, T0) == "2025-12-01 09:27:51 UTC (in 60.0 s)"


def test_rfc3339_is_what_kubernetes_writes():
    assert rfc3339(T0) == "2025-12-01T09:26:51Z"

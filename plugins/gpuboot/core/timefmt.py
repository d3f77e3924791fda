"""How a time or a duration is written: one format for people, one for machines.

People (task logs, run notes, pages): `utc` gives `2026-12-01 09:26:51 UTC`, `relative` adds
"in 4 min 10 s" or "3 min 02 s ago", `duration` gives `0.4 s`, `17.2 s`, `2 min 05 s`, `12 min`,
`3 h 05 min`, `2 d 03 h` (whole units are cut, not rounded: 599 s is never "10 min"). Machines (Kubernetes annotations): `rfc3339`, as the API server writes times.
APIs return ISO 8601 / epoch numbers and leave the wording to the page.
"""
from __future__ import annotations

import datetime as dt

MINUTE, HOUR, DAY = 60, 3600, 86400


def utc(epoch: float | None) -> str:
    """Epoch seconds as `2026-12-01 09:26:51 UTC` (None: "-")."""
    if epoch is None:
        return "-"
    return dt.datetime.fromtimestamp(float(epoch), dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float | None) -> str:
    """A duration read at a glance, exact to a tenth of a second when short, to a unit when long."""
    if seconds is None:
        return "-"
    seconds = max(0.0, float(seconds))
    if seconds < 2 * MINUTE:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole < 10 * MINUTE:
        return f"{whole // MINUTE} min {whole % MINUTE:02d} s"
    if whole < 2 * HOUR:
        return f"{whole // MINUTE} min"
    if whole < 2 * DAY:
        return f"{whole // HOUR} h {whole % HOUR // MINUTE:02d} min"
    return f"{whole // DAY} d {whole % DAY // HOUR:02d} h"


def relative(epoch: float | None, now: float) -> str:
    """`in 4 min 10 s`, `3 min 02 s ago`, or `now` (within a second)."""
    if epoch is None:
        return "-"
    delta = float(epoch) - now
    if abs(delta) < 1:
        return "now"
    return f"in {duration(delta)}" if delta > 0 else f"{duration(-delta)} ago"


def utc_relative(epoch: float | None, now: float) -> str:
    """`2026-12-01 09:26:51 UTC (in 4 min 10 s)`: a deadline or expiry a person acts on."""
    return "-" if epoch is None else f"{utc(epoch)} ({relative(epoch, now)})"


def rfc3339(epoch: float) -> str:
    """`2026-12-01T09:26:51Z`, the form Kubernetes writes times in (annotations gpuboot sets)."""
    return dt.datetime.fromtimestamp(float(epoch), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

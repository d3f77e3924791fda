"""Hourly prices of the fleet's offerings, read with ECS DescribePrice and kept for a while.

Why a cache: prices change rarely (ECS announces changes), while every placement reads the
whole fleet; asking DescribePrice once per (instance type, zone) per `ttl_seconds` (an hour
by default) keeps the action off the hot path and far below its quota. A type ECS has no
price for (or a key without ecs:DescribePrice) is remembered as unpriced for the same TTL
and logged once per TTL, so placement falls back to GPU counts instead of failing; a
transient error is not remembered (the next survey asks again). The node label or annotation
gpuboot.io/price-per-hour still overrides whatever ECS says (gpuboot.core.inventory).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from gpuboot.core.ports import Ecs, EcsError

log = logging.getLogger(__name__)
DEFAULT_TTL_SECONDS = 3600.0


class PriceCache:
    """(region, instance type, zone) -> hourly price or None, each answer kept `ttl_seconds`."""

    def __init__(self, ttl_seconds: float = DEFAULT_TTL_SECONDS, clock: Callable[[], float] = time.monotonic):
        if ttl_seconds < 0:
            raise ValueError(f"price cache: ttl_seconds must be >= 0, got {ttl_seconds}")
        self.ttl_seconds, self._clock = ttl_seconds, clock
        self._entries: dict[tuple[str, str, str], tuple[float, float | None]] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every answer (tests start from an empty cache)."""
        with self._lock:
            self._entries.clear()

    def prices(self, ecs: Ecs, offerings: Iterable[tuple[str, str | None]], region: str = "") -> dict:
        """{(instance type, zone): price or None} for each offering, asking ECS only for stale ones."""
        now = self._clock()
        out: dict[tuple[str, str | None], float | None] = {}
        for itype, zone in sorted(set(offerings), key=lambda o: (o[0], o[1] or "")):
            key = (region, itype, zone or "")
            with self._lock:
                entry = self._entries.get(key)
            if entry is not None and now - entry[0] < self.ttl_seconds:
                out[(itype, zone)] = entry[1]
                continue
            try:
                price: float | None = float(ecs.describe_price(itype, zone))
            except EcsError as err:
                if err.kind == "transient":
                    out[(itype, zone)] = entry[1] if entry else None     # keep the last answer, ask again later
                    continue
                log.warning("no ECS price for %s in %s (%s: %s); placement ranks it by GPUs until %.0fs from now "
                            "(grant ecs:DescribePrice, or label the node gpuboot.io/price-per-hour)",
                            itype, zone or "the region", err.code, err.message, self.ttl_seconds)
                price = None
            with self._lock:
                self._entries[key] = (now, price)
            out[(itype, zone)] = price
        return out


PRICES = PriceCache()   # one per process: every survey of every task shares it

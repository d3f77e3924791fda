"""WakeUpTrigger: the timer a step waiting for capacity defers on, holding no worker slot."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from airflow.triggers.base import BaseTrigger

from gpuboot.triggers.events import ShortEvent


class WakeUpTrigger(BaseTrigger):
    """Fires {"status": "wake", "echo": echo} at `moment` (epoch seconds).

    Why `echo`: the state a resumed task needs travels in the event itself, so it
    survives every runner (dag.test() passes only the event to the resume method)."""

    def __init__(self, moment: float, echo: dict | None = None) -> None:
        super().__init__()
        self.moment, self.echo = float(moment), dict(echo or {})

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"moment": self.moment, "echo": self.echo}

    async def run(self):
        await asyncio.sleep(max(0.0, self.moment - time.time()))
        yield ShortEvent({"status": "wake", "echo": self.echo, "summary": "woke up to try again"})

"""The trigger event every gpuboot trigger fires: its log line is a one-line summary."""
from __future__ import annotations

from airflow.triggers.base import TriggerEvent


class ShortEvent(TriggerEvent):
    """A TriggerEvent whose log line is its one-line summary: the triggerer logs every event it fires
    ("Trigger fired event ... result=<repr>") into the task log, and the full payload (the plan, the
    baselines, the evidence) is a 20-line dict with memory in bytes. The payload is unchanged."""

    def __repr__(self) -> str:
        payload = self.payload if isinstance(self.payload, dict) else {}
        return f"TriggerEvent<{payload.get('status')}: {payload.get('summary') or payload.get('message')}>"

    __str__ = __repr__

"""The triggers the steps defer on, in the triggerer: GPU readiness, the capacity timer, the gang."""
from __future__ import annotations

import importlib


def __getattr__(name: str):
    """Classpaths of the flat layout (gpuboot.triggers.NodeGpuReadyTrigger) that deferred tasks
    stored in the metadata database still resolve, for one release."""
    from gpuboot._aliases import OLD_TRIGGERS, moved

    if name in OLD_TRIGGERS:
        moved(f"gpuboot.triggers.{name}", f"{OLD_TRIGGERS[name]}.{name}")
        return getattr(importlib.import_module(OLD_TRIGGERS[name]), name)
    raise AttributeError(f"module 'gpuboot.triggers' has no attribute {name!r}")

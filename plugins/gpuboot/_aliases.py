"""The module paths of the flat layout (gpuboot 0.1), kept importable for one release.

Airflow stores some of them by path: the classpath of a deferred task's trigger (in the
metadata database), the plugin's and the provider's entry points (in an installed wheel's
metadata), and users' DAG files import the task group. Each old path is the new module
itself (same objects, no copy), with a DeprecationWarning naming the new path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

REMOVED_IN = "0.3"
MOVED = {
    "gpuboot.launchtrigger": "gpuboot.triggers.gang",
    "gpuboot.plugin": "gpuboot.ui.plugin",
    "gpuboot.provider": "gpuboot.get_provider_info",
    "gpuboot.taskgroup": "gpuboot.task_groups.gpu_job",
    "gpuboot.specdags": "gpuboot.task_groups.spec_dags",
}
# Names the flat gpuboot.triggers module held; the gpuboot.triggers package answers them (its __getattr__).
OLD_TRIGGERS = {
    "NodeGpuReadyTrigger": "gpuboot.triggers.gpu_ready",
    "WakeUpTrigger": "gpuboot.triggers.wake_up",
    "ShortEvent": "gpuboot.triggers.events",
}


def moved(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path goes in gpuboot {REMOVED_IN}",
                  DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        moved(spec.name, self.target)
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        """The target module ran already: an alias adds nothing."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            return importlib.util.spec_from_loader(name, _Alias(MOVED[name]))
        return None


def install() -> None:
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())

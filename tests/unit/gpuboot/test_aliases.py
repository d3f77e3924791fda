"""The flat layout's module paths still import, for one release: Airflow stores some by path
(a deferred task's trigger classpath, the plugin and provider entry points) and users' DAGs import
the task group. Each old path is the new module itself, and says where it moved."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpuboot
from gpuboot._aliases import MOVED, OLD_TRIGGERS

OLD_CLASSPATHS = {
    "gpuboot.triggers.NodeGpuReadyTrigger": "gpuboot.triggers.gpu_ready.NodeGpuReadyTrigger",
    "gpuboot.triggers.WakeUpTrigger": "gpuboot.triggers.wake_up.WakeUpTrigger",
    "gpuboot.launchtrigger.GangTrigger": "gpuboot.triggers.gang.GangTrigger",
    "gpuboot.plugin.GpuBootPlugin": "gpuboot.ui.plugin.GpuBootPlugin",
    "gpuboot.provider.get_provider_info": "gpuboot.get_provider_info.get_provider_info",
    "gpuboot.taskgroup.gpu_job_group": "gpuboot.task_groups.gpu_job.gpu_job_group",
}


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("old", OLD_CLASSPATHS)
def test_an_old_classpath_is_the_new_object_and_warns(old):
    from airflow.sdk._shared.module_loading import import_string  # what the triggerer resolves a trigger with

    with pytest.warns(DeprecationWarning, match="moved to gpuboot"):
        found = import_string(old) if old.startswith("gpuboot.triggers.") else _resolve(old)
    assert found is _resolve(OLD_CLASSPATHS[old])


def test_every_alias_names_an_existing_module(monkeypatch):
    for old, new in MOVED.items():
        monkeypatch.delitem(sys.modules, old, raising=False)   # a first import, which warns
        with pytest.warns(DeprecationWarning, match=new):
            assert importlib.import_module(old) is importlib.import_module(new)
    for name, module in OLD_TRIGGERS.items():
        assert hasattr(importlib.import_module(module), name)


def test_an_unknown_name_is_still_an_error():
    import gpuboot.triggers

    with pytest.raises(AttributeError, match="NoSuchTrigger"):
        gpuboot.triggers.NoSuchTrigger  # noqa: B018


def test_the_old_entry_points_load_in_a_fresh_interpreter():
    """An installed 0.1 wheel's metadata names gpuboot.plugin and gpuboot.provider: both load."""
    code = ("import importlib.metadata as m, warnings; warnings.simplefilter('ignore');"
            "p = m.EntryPoint('gpuboot', 'gpuboot.plugin:GpuBootPlugin', 'airflow.plugins').load();"
            "i = m.EntryPoint('provider_info', 'gpuboot.provider:get_provider_info', 'x').load()();"
            "print(p.__module__, p.name, i['package-name'])")
    env = dict(os.environ, PYTHONPATH=str(Path(gpuboot.__file__).parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["gpuboot.ui.plugin", "gpuboot", "gpuboot"]


def test_the_sensors_old_argument_name_still_works():
    from gpuboot.sensors.gpu_ready import GpuReadySensor

    with pytest.warns(DeprecationWarning, match="baselines"):
        sensor = GpuReadySensor(task_id="w", boots=[{"node": "n"}])
    assert sensor.baselines == [{"node": "n"}]

"""The plugins-folder entry of gpuboot, for a source checkout whose plugins/ is Airflow's plugins
folder (the scheduler, workers, dag-processor and triggerer then find the `gpuboot` package next
to this file on sys.path). An installed gpuboot (the wheel, or `make install`'s editable install of
this checkout, which gives the source set-up the provider's connection type and form) registers the
same plugin by its `airflow.plugins` entry point: then this file binds no plugin class (Airflow's
loader registers every one it finds here), so "gpuboot" is not loaded twice (Airflow would skip the
second and report it as a plugin error).
"""
from importlib.metadata import entry_points

ENTRY_POINT = "gpuboot.ui.plugin:GpuBootPlugin"
INSTALLED = any(ep.value == ENTRY_POINT for ep in entry_points(group="airflow.plugins"))

if not INSTALLED:
    from gpuboot.ui.plugin import GpuBootPlugin

    __all__ = ["GpuBootPlugin"]

"""The plugins-folder entry of gpuboot, for a source checkout whose plugins/ is Airflow's plugins
folder (the scheduler, workers, dag-processor and triggerer then find the `gpuboot` package next
to this file on sys.path). An installed wheel registers the same plugin by its `airflow.plugins`
entry point instead; use one or the other, not both (Airflow would skip the second "gpuboot").
"""
from gpuboot.ui.plugin import GpuBootPlugin

__all__ = ["GpuBootPlugin"]

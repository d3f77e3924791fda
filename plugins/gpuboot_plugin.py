"""Registers gpuboot with Airflow's plugin manager, so `airflow plugins` and the UI list it.

The library itself is the `gpuboot` package next to this file (plugins/ is on sys.path for
the scheduler, workers, dag-processor and triggerer alike); this file adds nothing else.
"""
from airflow.plugins_manager import AirflowPlugin


class GpuBootPlugin(AirflowPlugin):
    name = "gpuboot"

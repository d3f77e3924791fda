"""The gpuboot Airflow plugin, so `airflow plugins` and the UI list it.

Installed as a package (`pip install gpuboot`), Airflow finds it through the `airflow.plugins`
entry point; from the source tree, through plugins/gpuboot_plugin.py in the plugins folder.
"""
from airflow.plugins_manager import AirflowPlugin


class GpuBootPlugin(AirflowPlugin):
    name = "gpuboot"

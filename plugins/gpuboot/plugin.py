"""The gpuboot Airflow plugin, so `airflow plugins` and the UI list it: its pages and its run notes.

Installed as a package (`pip install gpuboot`), Airflow finds it through the `airflow.plugins`
entry point; from the source tree, through plugins/gpuboot_plugin.py in the plugins folder.
The API server mounts the fleet app (gpuboot.fleetapi) at /gpuboot; the UI shows its page under
Browse ("GPU fleet", and "Run a GPU job": gpu_job's form checked field by field) and as a tab
of every DAG run ("GPU placement", that run's placement and boots). The run-note listener
(gpuboot.runnote) runs where runs end, in the scheduler.
"""
from airflow.plugins_manager import AirflowPlugin

from gpuboot import runnote
from gpuboot.fleetapi import create_app

URL_PREFIX = "/gpuboot"


class GpuBootPlugin(AirflowPlugin):
    name = "gpuboot"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "gpuboot"}]
    listeners = [runnote]          # each gpuboot run's note: its steps' summary lines
    external_views = [
        {"name": "GPU fleet", "href": f"{URL_PREFIX}/fleet", "url_route": "gpu-fleet", "destination": "nav",
         "category": "browse"},
        {"name": "Run a GPU job", "href": f"{URL_PREFIX}/jobs/new", "url_route": "gpu-job-form", "destination": "nav",
         "category": "browse"},
        {"name": "GPU placement", "href": f"{URL_PREFIX}/fleet/run?dag_id={{DAG_ID}}&run_id={{RUN_ID}}",
         "url_route": "gpu-placement", "destination": "dag_run"},
    ]

"""The gpuboot Airflow plugin, so `airflow plugins` and the UI list it, and the GPU-fleet page.

Installed as a package (`pip install gpuboot`), Airflow finds it through the `airflow.plugins`
entry point; from the source tree, through plugins/gpuboot_plugin.py in the plugins folder.
The API server mounts the fleet app (gpuboot.fleetapi) at /gpuboot; the UI shows its page under
Browse ("GPU fleet") and as a tab of every DAG run ("GPU placement", that run's placement and boots).
"""
from airflow.plugins_manager import AirflowPlugin

from gpuboot.fleetapi import create_app

URL_PREFIX = "/gpuboot"


class GpuBootPlugin(AirflowPlugin):
    name = "gpuboot"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "gpuboot fleet"}]
    external_views = [
        {"name": "GPU fleet", "href": f"{URL_PREFIX}/fleet", "url_route": "gpu-fleet", "destination": "nav",
         "category": "browse"},
        {"name": "GPU placement", "href": f"{URL_PREFIX}/fleet/run?dag_id={{DAG_ID}}&run_id={{RUN_ID}}",
         "url_route": "gpu-placement", "destination": "dag_run"},
    ]

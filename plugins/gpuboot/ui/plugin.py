"""The gpuboot Airflow plugin, so `airflow plugins` and the UI list it: its pages and its run notes.

Installed as a package (`pip install gpuboot`), Airflow finds it through the `airflow.plugins`
entry point; from the source tree, through plugins/gpuboot_plugin.py in the plugins folder.
The API server mounts the fleet app (gpuboot.ui.fleet_api) at /gpuboot; the UI shows its page under
Browse ("GPU fleet", and "Run a GPU job": gpu_job's form checked field by field) and as a tab
of every DAG run ("GPU placement", that run's placement and boots). The run-note listener
(gpuboot.ui.run_note) runs where runs end, in the scheduler; the warm-up (gpuboot.ui.warmup) in the
triggerer, as it starts.
"""
from airflow.plugins_manager import AirflowPlugin

from gpuboot.core.jobspec import register_form_formats
from gpuboot.ui import run_note as runnote
from gpuboot.ui import warmup

register_form_formats()     # the API server validates gpu_job's params at trigger time: say its rules in words

URL_PREFIX = "/gpuboot"


class FleetApp:
    """The fleet app (gpuboot.ui.fleet_api), built on its first request.

    Airflow imports every plugin in every process, each task try included, and only the API
    server mounts the app. Built at import, it would pull Airflow's API-server security into every
    task try, a noticeable share of each task's start, paid twice between a node's GPUs
    registering and its pod running. The API server has those modules loaded already, so
    building there on the first request is cheap."""

    def __init__(self) -> None:
        self._app = None

    async def __call__(self, scope, receive, send) -> None:
        if self._app is None:            # one event loop per API-server worker: no race to build
            from gpuboot.ui.fleet_api import create_app
            self._app = create_app()
        await self._app(scope, receive, send)


class GpuBootPlugin(AirflowPlugin):
    name = "gpuboot"
    fastapi_apps = [{"app": FleetApp(), "url_prefix": URL_PREFIX, "name": "gpuboot"}]
    listeners = [runnote, warmup]  # each gpuboot run's note: its steps' summary lines; a warm triggerer
    external_views = [
        {"name": "GPU fleet", "href": f"{URL_PREFIX}/fleet", "url_route": "gpu-fleet", "destination": "nav",
         "category": "browse"},
        {"name": "Run a GPU job", "href": f"{URL_PREFIX}/jobs/new", "url_route": "gpu-job-form", "destination": "nav",
         "category": "browse"},
        {"name": "GPU placement", "href": f"{URL_PREFIX}/fleet/run?dag_id={{DAG_ID}}&run_id={{RUN_ID}}",
         "url_route": "gpu-placement", "destination": "dag_run"},
    ]

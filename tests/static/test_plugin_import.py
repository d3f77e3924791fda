"""Airflow imports every plugin in every process, each task try included: gpuboot's must stay light there."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("fastapi", "airflow.api_fastapi.core_api.security", "airflow.api_fastapi.app", "gpuboot.ui.fleet_api")


def test_importing_the_plugin_does_not_build_the_fleet_app(tmp_path):
    """Building the fleet app at import pulled the API server's security into each task try (1.1 s each,
    measured by `make bench-distributed`); the plugin must defer it to the API server's first request."""
    probe = ("import sys; import gpuboot.ui.plugin; "
             f"print('imported:', ','.join(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={"PYTHONPATH": f"{REPO / 'plugins'}", "PATH": "/usr/bin:/bin",
                                         "AIRFLOW_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("imported:")]   # Airflow may log on stdout
    assert line == "imported: ", f"gpuboot.ui.plugin {line}"

"""The triggerer's warm-up (gpuboot.ui.warmup): Airflow's own Job start, in a fresh process, imports the
readiness trigger's Kubernetes clients in the triggerer, and only there, and freezes what the
triggerer then holds out of the garbage collector's full collections."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuboot.ui.warmup import is_triggerer

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import sys
sys.argv = ["airflow", sys.argv[1]]
from airflow.jobs.job import Job
Job()                                   # Airflow calls the on_starting listeners here
import gc
print("imported:", "kubernetes_asyncio.client" in sys.modules)
print("frozen:", gc.get_freeze_count() > 100_000)   # the loaded modules' objects (several 100,000)
"""


def test_only_the_airflow_triggerer_command_counts():
    assert is_triggerer(["/venv/bin/airflow", "triggerer", "--skip-serve-logs"])
    assert not is_triggerer(["/venv/bin/airflow", "scheduler"])
    assert not is_triggerer(["/venv/bin/airflow"])
    assert not is_triggerer(["celery", "worker", "triggerer"])


@pytest.mark.parametrize("command, warmed", [("triggerer", True), ("scheduler", False)])
def test_a_starting_triggerer_imports_the_clients_before_any_trigger(tmp_path, command, warmed):
    env = {"PATH": "/usr/bin:/bin", "AIRFLOW_HOME": str(tmp_path),
           "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"), "PYTHONPATH": str(REPO / "plugins"),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'airflow.db'}"}
    done = subprocess.run([sys.executable, "-c", PROBE, command], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith(("imported:", "frozen:"))]
    assert lines == [f"imported: {warmed}", f"frozen: {warmed}"], done.stdout[-2000:] + done.stderr[-2000:]

"""Shared fixtures: a factory that runs `python -m simcloud serve` per test, stopped afterwards."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from gpuboot.lifecycle.pricing import PRICES
from simcloud.harness import SimCloud, small_fleet, wait_until  # noqa: F401  (re-exported for tests)

# The local cloud boots a node in seconds, not the minute an ECS GPU instance needs: let the
# tests' jobs use boot timeouts that short (tests of the default minimum unset it).
os.environ.setdefault("GPUBOOT_MIN_BOOT_SECONDS", "1")

# One throwaway Airflow home for the whole session, set before any test module can import
# Airflow (which fixes its config file and database at first import): never the user's
# ~/airflow, and the same home whichever folder happens to be collected first.
if "airflow" not in sys.modules:
    _home = tempfile.mkdtemp(prefix="gpuboot-tests-airflow-")
    os.environ["AIRFLOW_HOME"] = _home
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_home}/airflow.db"
# The project's DAGs and plugins, set as early: Airflow caches its DAG bundle list at first use.
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(Path(__file__).resolve().parents[1] / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(Path(__file__).resolve().parents[1] / "plugins")

REPO = Path(__file__).resolve().parents[1]
KUBECTL_CANDIDATES = [Path("/usr/bin/kubectl"), REPO / ".tools/debian-kubectl/usr/bin/kubectl"]


def kubectl_binaries() -> list[Path]:
    """Every kubectl the tests should drive: the system one and Debian's (unpacked by .ci/run)."""
    found = [p for p in KUBECTL_CANDIDATES if p.exists()]
    on_path = shutil.which("kubectl")
    if on_path and Path(on_path).resolve() not in {p.resolve() for p in found}:
        found.append(Path(on_path))
    return found


def pytest_addoption(parser):
    parser.addoption("--kube", choices=("simcloud", "real"), default=None,
                     help="the local cloud's Kubernetes backend: simcloud's own API server (default) or the real "
                          "control plane (make controlplane); sets $GPUBOOT_KUBE, which SimCloud.start reads")


def pytest_configure(config):
    if config.getoption("--kube"):
        os.environ["GPUBOOT_KUBE"] = config.getoption("--kube")
    config.addinivalue_line(
        "markers", "simcloud_only(reason): needs simcloud's own API server (its internals, or a fault only it can "
                   "inject); skipped on the real control plane (--kube=real / GPUBOOT_KUBE=real)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GPUBOOT_KUBE", "simcloud") != "real":
        return
    for item in items:
        marker = item.get_closest_marker("simcloud_only")
        if marker is not None:
            reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "simcloud only")
            item.add_marker(pytest.mark.skip(reason=f"simcloud only: {reason}"))


@pytest.fixture
def simcloud_factory(tmp_path):
    """simcloud_factory(fleet_dict_or_path=None, **SimCloud.start kwargs) -> a running SimCloud."""
    with contextlib.ExitStack() as stack:
        count = 0

        def start(fleet: dict | str | Path | None = None, **kwargs) -> SimCloud:
            nonlocal count
            count += 1
            workdir = tmp_path / f"simcloud-{count}"
            return stack.enter_context(SimCloud.start(fleet if fleet is not None else small_fleet(), workdir,
                                                      **kwargs))

        yield start


@pytest.fixture(autouse=True)
def fresh_price_cache():
    """The process-wide price cache starts empty for every test: a test whose ECS (fake or simcloud
    fleet) prices a type differently, or not at all, sees its own answers whatever ran before it
    in the same worker."""
    PRICES.clear()
    yield
    PRICES.clear()


# Per-folder time (issue 31): the summed test time (setup, call and teardown) of each folder under tests/,
# and its span on the clock (first start to last end: on xdist workers, folders overlap). Printed after
# every run, so a slow folder shows without a separate profiling run.
_FOLDER_TIMES: dict[str, list[float]] = {}


def pytest_runtest_logreport(report):
    parts = report.nodeid.split("::")[0].split("/")
    folder = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
    spent = _FOLDER_TIMES.setdefault(folder, [0.0, 0, float("inf"), 0.0])
    spent[0] += report.duration
    spent[1] += report.when == "call" or (report.when == "setup" and report.skipped)
    if getattr(report, "start", None) is not None:
        spent[2], spent[3] = min(spent[2], report.start), max(spent[3], report.stop)


def pytest_terminal_summary(terminalreporter):
    if not _FOLDER_TIMES or len(_FOLDER_TIMES) < 2:
        return
    terminalreporter.section("time per folder")
    terminalreporter.write_line(f"{'folder':<24} {'tests':>6} {'test time':>10} {'span':>8}")
    for folder, (spent, count, first, last) in sorted(_FOLDER_TIMES.items(), key=lambda kv: -kv[1][0]):
        span = f"{last - first:7.0f}s" if last > first else "      -"
        terminalreporter.write_line(f"{folder:<24} {int(count):>6} {spent:>9.0f}s {span}")

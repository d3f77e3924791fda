"""The provider wheel, built from this checkout and installed into a fresh virtualenv with
Airflow (from constraints.txt, so uv takes every package from its cache): what a team gets from
`pip install gpuboot` in its own Airflow 3.3 image.

Checked there, with no checkout on sys.path and an empty plugins folder, beside the official
apache-airflow-providers-alibaba (issue 35 #8: both registered `alibaba_cloud`, and Airflow kept the
official hook and merged the forms): `airflow providers list` shows the provider; the connection
forms the UI gets (the api-server's hook metadata service) have gpuboot's `gpuboot_ecs` type with
its fields, and the official `alibaba_cloud` type with the official hook and its own fields only;
the plugin is loaded from its entry point; the `gpu_job` DAG parses.

The wheel's contents are checked in every run (a build, ~7 s); the installed wheel is slow (90 to 110 s
on 2 busy cores: the install and two Airflow start-ups) and runs only when
GPUBOOT_TEST_PACKAGE=1, as `make test-package` (which .ci/run calls) sets it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UV = [shutil.which("python3") or sys.executable, "-m", "uv"]
OFFICIAL_ALIBABA = "apache-airflow-providers-alibaba==3.5.2"     # installed beside the wheel

# Run inside the fresh virtualenv: what the UI's connection form, the plugin manager and the
# dag-processor see.
slow = pytest.mark.skipif(
    os.environ.get("GPUBOOT_TEST_PACKAGE") != "1", reason="slow; run with `make test-package` (GPUBOOT_TEST_PACKAGE=1)")

PROBE = """
import json, sys
from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService
meta = [m.model_dump() for m in HookMetaService.hook_meta_data() if m.connection_type in ("gpuboot_ecs", "alibaba_cloud")]
from airflow import plugins_manager
plugins, plugin_errors = plugins_manager._get_plugins()
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1], safe_mode=False)
import gpuboot
print(json.dumps({"hook_meta": meta, "plugins": {p.name: str(p.source) for p in plugins},
                  "plugin_errors": plugin_errors, "dags": sorted(bag.dag_ids), "import_errors": bag.import_errors,
                  "gpuboot": gpuboot.__file__, "sys_path": sys.path}, default=str))
"""


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{cmd[:4]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`make dist`'s build, from a copy of only what the wheel is made of (the checkout stays clean)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "plugins", src / "plugins", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    _run([*UV, "build", "--quiet", "--wheel", "--out-dir", str(out), str(src)])
    (built,) = out.glob("gpuboot-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict[str, str]:
    """A fresh virtualenv with the wheel and Airflow, and the environment of an Airflow that has
    never seen this checkout: its own home, the DAGs copied out, an empty plugins folder."""
    root = tmp_path_factory.mktemp("site")
    venv = root / "venv"
    _run([*UV, "venv", "--quiet", "--python", "3.11", str(venv)])
    _run([*UV, "pip", "install", "--quiet", "-p", str(venv / "bin" / "python"), str(wheel), OFFICIAL_ALIBABA,
          "-c", str(REPO / "constraints.txt")])
    shutil.copytree(REPO / "dags", root / "dags", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "plugins").mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV", "GPUBOOT"))}
    env.update({"AIRFLOW_HOME": str(root / "home"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_FOLDER": str(root / "dags"),
                "AIRFLOW__CORE__PLUGINS_FOLDER": str(root / "plugins"),
                "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"})
    return {"venv": str(venv), "root": str(root), **{"env:" + k: v for k, v in env.items()}}


def _env(installed: dict[str, str]) -> dict[str, str]:
    return {k[4:]: v for k, v in installed.items() if k.startswith("env:")}


def test_wheel_holds_the_package_and_its_entry_points_only(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"gpuboot"}, f"the wheel must hold the gpuboot package only, got {sorted(tops)}"
    assert "gpuboot/get_provider_info.py" in names and "gpuboot/replay/sim.py" in names
    assert "[apache_airflow_provider]\nprovider_info = gpuboot.get_provider_info:get_provider_info" in entry_points
    assert "[airflow.plugins]\ngpuboot = gpuboot.ui.plugin:GpuBootPlugin" in entry_points
    runtime = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    for package in ("aiohttp", "msgspec", "matplotlib", "pytest", "aliyun-python-sdk"):
        assert not any(package in line for line in runtime), f"{package} is a runtime dependency: {runtime}"


@slow
def test_installed_wheel_is_a_provider_with_the_connection_form_the_plugin_and_the_dag(installed):
    env, bin_dir = _env(installed), Path(installed["venv"]) / "bin"
    dags = str(Path(installed["root"]) / "dags" / "gpu_job.py")
    # The CLI and the probe each start Airflow (~15-30 s on a busy machine): side by side.
    cli = subprocess.Popen([str(bin_dir / "airflow"), "providers", "list", "-o", "json"], env=env,
                           cwd=installed["root"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    probe = _run([str(bin_dir / "python"), "-c", PROBE, dags], env=env, cwd=installed["root"])
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err[-3000:]

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    providers = {p["package_name"]: p for p in json.loads(out[out.index("["):])}
    assert providers["gpuboot"]["version"] == version

    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert not any(p.startswith(str(REPO)) for p in seen["sys_path"]), "the checkout leaked onto sys.path"
    assert seen["gpuboot"].startswith(installed["venv"]), seen["gpuboot"]

    assert providers["apache-airflow-providers-alibaba"]
    by_type = {m["connection_type"]: m for m in seen["hook_meta"]}
    assert set(by_type) == {"gpuboot_ecs", "alibaba_cloud"}, seen["hook_meta"]
    official = by_type["alibaba_cloud"]
    assert official["hook_class_name"].startswith("airflow.providers.alibaba."), official
    assert not {"region_id", "endpoint", "credential_mode"} & set(official["extra_fields"] or {}), official
    meta = by_type["gpuboot_ecs"]
    assert (meta["hook_class_name"], meta["hook_name"]) == ("gpuboot.hooks.ecs.EcsHook", "Alibaba Cloud ECS (gpuboot)")
    extra = meta["extra_fields"]
    assert {"region_id", "endpoint", "credential_mode"} <= set(extra)
    assert extra["credential_mode"]["schema"]["enum"][:2] == ["static", "default_chain"]
    assert extra["credential_mode"]["value"] == "static"
    fields = meta["standard_fields"]
    assert fields["login"]["title"] == "AccessKey ID" and fields["password"]["title"] == "AccessKey secret"
    assert fields["host"]["hidden"] and fields["port"]["hidden"]

    assert "gpuboot.ui.plugin:GpuBootPlugin" in seen["plugins"]["gpuboot"], seen["plugins"]
    assert seen["plugin_errors"] == {}
    assert seen["import_errors"] == {} and seen["dags"] == ["gpu_job"]

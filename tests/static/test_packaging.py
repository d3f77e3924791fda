"""pyproject.toml against the rest of the checkout, without building anything (the wheel itself:
tests/packaging/test_wheel.py).

The distribution's dependencies must cover what the package imports, the extras what the local
cloud, the replay and the tests need, and every range must admit the version the tests ran with
(requirements*.txt pins, constraints.txt the whole tree); the provider info must describe EcsHook
as it is and validate against Airflow's schema; the entry points must name objects that exist.
"""
from __future__ import annotations

import ast
import importlib
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(specs: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, specs) if canonicalize_name(r.name) != "gpuboot"}


RUNTIME = _requirements(PROJECT["dependencies"])
EXTRAS = {name: _requirements(specs) for name, specs in PROJECT["optional-dependencies"].items()}


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9._-]+)==([^\s;#]+)", line.strip())
        if match:
            pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


CONSTRAINTS = _pins(ROOT / "constraints.txt")


def test_every_pinned_requirement_is_declared_where_it_belongs():
    """requirements.txt (runtime, local cloud, replay) and requirements-test.txt each pin only what
    pyproject declares, in the runtime list or an extra, with a range that admits the pin."""
    declared = {**{k: v for extra in EXTRAS.values() for k, v in extra.items()}, **RUNTIME}
    for path in ("requirements.txt", "requirements-test.txt"):
        for name, version in _pins(ROOT / path).items():
            assert name in declared, f"{path} pins {name}, which pyproject.toml does not declare"
            assert declared[name].specifier.contains(version, prereleases=True), \
                f"{path} pins {name}=={version} outside pyproject's {declared[name]}"


def test_every_declared_requirement_is_locked_in_the_constraints():
    for group, reqs in {"dependencies": RUNTIME, **EXTRAS}.items():
        for name, req in reqs.items():
            assert name in CONSTRAINTS, f"{group}: {name} is not in constraints.txt (make lock)"
            assert req.specifier.contains(CONSTRAINTS[name], prereleases=True), \
                f"{group}: {req} excludes the locked {name}=={CONSTRAINTS[name]}"


def test_the_extras_keep_the_local_cloud_replay_and_tests_out_of_the_runtime():
    assert set(EXTRAS) >= {"simcloud", "replay", "test"}
    for name in ("aiohttp", "msgspec", "matplotlib", "pytest", "aliyun-python-sdk-core", "psycopg2-binary"):
        assert name not in RUNTIME, f"{name} is a runtime dependency; it belongs in an extra"
    assert {"aiohttp", "msgspec"} <= set(EXTRAS["simcloud"]) and "matplotlib" in EXTRAS["replay"]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def _distribution(module: str) -> str | None:
    """The distribution an import comes from (None: the standard library or gpuboot itself)."""
    top = module.split(".", maxsplit=1)[0]
    if top in sys.stdlib_module_names or top in {"gpuboot", "__future__"}:
        return None
    provider = re.match(r"airflow\.providers\.((?:cncf\.)?\w+)", module)
    if provider:
        return canonicalize_name("apache-airflow-providers-" + provider.group(1).replace(".", "-"))
    if top == "airflow":
        return "apache-airflow"
    from importlib.metadata import packages_distributions

    (dist, *_) = packages_distributions()[top]
    return canonicalize_name(dist)


@pytest.mark.parametrize("path", sorted((ROOT / "plugins" / "gpuboot").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT / "plugins")))
def test_what_the_package_imports_is_a_dependency(path):
    """The runtime list covers every import of the package; the replay may use its extra."""
    allowed = set(RUNTIME) | (set(EXTRAS["replay"]) if "replay" in path.parts else set())
    for module in sorted(_imports(path)):
        dist = _distribution(module)
        # a dependency of a dependency counts only if declared: pip would not promise it
        assert dist is None or dist in allowed, f"{path.name} imports {module} ({dist}), not in its dependencies"


def test_entry_points_name_what_exists():
    from airflow.plugins_manager import AirflowPlugin

    points = PROJECT["entry-points"]
    module, _, attr = points["apache_airflow_provider"]["provider_info"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    module, _, attr = points["airflow.plugins"]["gpuboot"].partition(":")
    plugin = getattr(importlib.import_module(module), attr)
    assert issubclass(plugin, AirflowPlugin) and plugin.name == "gpuboot"
    # the plugins-folder entry of a source checkout registers the same class, unless gpuboot is installed
    import gpuboot_plugin
    assert points["airflow.plugins"]["gpuboot"] == gpuboot_plugin.ENTRY_POINT
    assert gpuboot_plugin.INSTALLED or gpuboot_plugin.GpuBootPlugin is plugin


def test_provider_info_describes_the_hook_and_validates_against_airflows_schema():
    import airflow
    import jsonschema

    from gpuboot.get_provider_info import get_provider_info
    from gpuboot.hooks.ecs import EcsHook

    info = get_provider_info()
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    assert info["package-name"] == PROJECT["name"]
    (conn,) = info["connection-types"]
    module, _, name = conn["hook-class-name"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is EcsHook
    assert (conn["connection-type"], conn["hook-name"]) == (EcsHook.conn_type, EcsHook.hook_name)
    assert {"region_id", "endpoint", "credential_mode"} <= set(conn["conn-fields"])
    from gpuboot.hooks.ecs import CREDENTIAL_MODES
    assert [m for m in conn["conn-fields"]["credential_mode"]["schema"]["enum"] if m] == list(CREDENTIAL_MODES)


def test_a_source_checkouts_plugins_folder_registers_the_plugin_once():
    """Airflow finds the plugin once: by the entry point of the installed gpuboot (make install installs
    this checkout editable, for the provider's connection type and form: issue 35 #8), else in
    plugins/gpuboot_plugin.py, and only there (.airflowignore keeps gpuboot/ out)."""
    from airflow import plugins_manager
    from airflow._shared.plugins_manager import _load_plugins_from_plugin_directory

    import gpuboot_plugin

    plugins, errors = _load_plugins_from_plugin_directory(plugins_folder=str(ROOT / "plugins"))
    assert errors == {}
    folder = [(p.name, Path(str(p.source.path)).name) for p in plugins]
    assert folder == ([] if gpuboot_plugin.INSTALLED else [("gpuboot", "gpuboot_plugin.py")])
    loaded, errors = plugins_manager._get_plugins()
    assert [p.name for p in loaded].count("gpuboot") == 1 and not any("gpuboot" in k for k in errors), errors


def test_provider_info_lists_every_operator_sensor_trigger_and_hook_module():
    """As provider.yaml does: each role's folder is listed whole (a new module must be added), and each
    listed module holds a class of that role."""
    from airflow.sdk import BaseHook, BaseOperator, BaseSensorOperator
    from airflow.triggers.base import BaseTrigger

    from gpuboot.get_provider_info import get_provider_info

    info = get_provider_info()
    roles = {"operators": BaseOperator, "sensors": BaseSensorOperator, "triggers": BaseTrigger, "hooks": BaseHook}
    for role, base in roles.items():
        listed = {m for entry in info[role] for m in entry["python-modules"]}
        for module in listed:
            classes = [v for v in vars(importlib.import_module(module)).values()
                       if isinstance(v, type) and issubclass(v, base) and v.__module__ == module]
            assert classes, f"{module} (listed under {role}) defines no {base.__name__}"
        if role != "hooks":
            folder = ROOT / "plugins" / "gpuboot" / role
            found = {f"gpuboot.{role}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}
            holding = {m for m in found if any(isinstance(v, type) and issubclass(v, base) and v.__module__ == m
                                               for v in vars(importlib.import_module(m)).values())}
            assert holding == listed, f"{role}: get_provider_info lists {sorted(listed)}, the folder holds {sorted(holding)}"


def test_the_source_setup_lists_the_connection_type_and_its_form():
    """Issue 35 #8: from a checkout (make install, make demo) Airflow listed no gpuboot connection type: the
    provider's entry point exists only for an installed gpuboot, which make install now makes this checkout."""
    from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService

    (meta,) = [m for m in HookMetaService.hook_meta_data() if m.connection_type == "gpuboot_ecs"]
    assert meta.hook_class_name == "gpuboot.hooks.ecs.EcsHook"
    assert {"region_id", "endpoint", "credential_mode"} <= set(meta.extra_fields or {})

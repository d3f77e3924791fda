"""The layers of plugins/gpuboot, kept by a test: pure core, adapters, lifecycle, Airflow steps.

Every module of the package is listed in exactly one layer (a new module must be placed), and
its imports, module-level or inside functions, may only reach the layers below it:

    airflow    the steps, trigger, task group, DAG loaders   may import anything below
    lifecycle  booking and boot fall-back: adapters + core, no Airflow (they reach Kubernetes and ECS
               through the Protocols of gpuboot.ports)
    adapters   ECS, Kubernetes, the ledger: I/O through the client libraries, no operator, and of the
               core only its values (not the placement engine)
    core       pure decisions and values, and the ports (Protocols) the adapters fill: no I/O library,
               no Airflow, nothing above
Nothing under plugins/ imports the local cloud.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
PACKAGE = PLUGINS / "gpuboot"

LAYERS: dict[str, set[str]] = {
    "core": {"gpuboot", "gpuboot.model", "gpuboot.resources", "gpuboot.inventory", "gpuboot.placement",
             "gpuboot.readiness", "gpuboot.steplog", "gpuboot.jobspec", "gpuboot.gang", "gpuboot.idle",
             "gpuboot.replay", "gpuboot.ports", "gpuboot.fleet"},
    "adapters": {"gpuboot.ecs", "gpuboot.provider", "gpuboot.kube", "gpuboot.ledger"},
    "lifecycle": {"gpuboot.booking", "gpuboot.batching", "gpuboot.boot", "gpuboot.pricing"},
    "airflow": {"gpuboot.steps", "gpuboot.steps.base", "gpuboot.steps.place", "gpuboot.steps.start",
                "gpuboot.steps.wait", "gpuboot.steps.launch", "gpuboot.steps.release", "gpuboot.steps.waiting",
                "gpuboot.triggers", "gpuboot.launchtrigger", "gpuboot.taskgroup", "gpuboot.scaledown", "gpuboot.specdags",
                "gpuboot.plugin", "gpuboot.fleetapi", "gpuboot.runnote", "gpuboot.warmup", "gpuboot_plugin"},
}
ORDER = ["core", "adapters", "lifecycle", "airflow"]
PACKAGES = {"gpuboot.replay"}      # entries that cover their submodules
IO_LIBRARIES = ("kubernetes", "kubernetes_asyncio", "alibabacloud", "alibabacloud_ecs20140526", "Tea",
                "darabonba", "aliyunsdkcore", "aliyunsdkecs", "aiohttp", "requests", "urllib3")
# What each layer may not import, besides the gpuboot layers above it.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "core": ("airflow", *IO_LIBRARIES),
    "adapters": ("gpuboot.placement", "airflow.sdk.bases.operator", "airflow.models.baseoperator", "airflow.sensors",
                 "airflow.providers.cncf.kubernetes.operators", "airflow.providers.cncf.kubernetes.triggers",
                 "airflow.triggers"),
    "lifecycle": ("airflow",),
    "airflow": (),
}
EVERYWHERE = ("simcloud",)


def module_name(path: Path) -> str:
    rel = path.relative_to(PLUGINS).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def placed(module: str) -> tuple[str, str] | None:
    """(layer, entry) for `module`: its own entry, else its package's (gpuboot.replay.sim -> core)."""
    best = None
    for layer, names in LAYERS.items():
        for name in names:
            covers = module == name or (name in PACKAGES and module.startswith(name + "."))
            if covers and (best is None or len(name) > len(best[1])):
                best = (layer, name)
    return best


def layer_of(module: str) -> str | None:
    return (placed(module) or (None, None))[0]


def imports_of(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, relative ones resolved."""
    package = module if module in ("gpuboot",) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from gpuboot import boot` imports the module gpuboot.boot, not only the package
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names
                      if target.startswith("gpuboot") and placed(f"{target}.{alias.name}") != placed(target)]
    return found


def violations(source: str, module: str) -> list[str]:
    """Every import of `module` that crosses its layer's boundary, with the line and the rule."""
    layer = layer_of(module)
    if layer is None:
        return [f"{module}: not placed in any layer of tests/static/test_layers.py"]
    above = ORDER[ORDER.index(layer) + 1:]
    out = []
    for line, target in imports_of(source, module):
        target_layer = layer_of(target) if target.startswith("gpuboot") else None
        if target_layer in above:
            out.append(f"{module}:{line} imports {target} ({target_layer} layer, above {layer})")
        for banned in (*FORBIDDEN[layer], *EVERYWHERE):
            if target == banned or target.startswith(banned + ".") or target.startswith(banned + "_"):
                out.append(f"{module}:{line} imports {target} (no {banned} in the {layer} layer)")
    return out


def package_modules() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), PLUGINS / "gpuboot_plugin.py"])


@pytest.mark.parametrize("path", package_modules(), ids=lambda p: str(p.relative_to(PLUGINS)))
def test_every_module_keeps_to_its_layer(path):
    assert violations(path.read_text(), module_name(path)) == []


def test_the_layers_name_exactly_the_modules_that_exist():
    """No entry outlives its module (a moved or deleted one must leave the map), none is in two layers."""
    existing = {module_name(p) for p in package_modules()}
    listed = [name for names in LAYERS.values() for name in names]
    assert sorted(set(listed) - existing) == []
    assert len(listed) == len(set(listed))


def test_the_check_catches_forbidden_imports():
    """The check itself can fail: each kind of crossing is reported with its line."""
    assert violations("import kubernetes\n", "gpuboot.placement") == [
        "gpuboot.placement:1 imports kubernetes (no kubernetes in the core layer)"]
    assert violations("def f():\n    from gpuboot.boot import JobBoot\n", "gpuboot.readiness") == [
        "gpuboot.readiness:2 imports gpuboot.boot (lifecycle layer, above core)"]
    assert violations("from .steps.wait import GpuReadySensor\n", "gpuboot.boot") == [
        "gpuboot.boot:1 imports gpuboot.steps.wait (airflow layer, above lifecycle)"]
    assert violations("from gpuboot.steps import place\n", "gpuboot.booking") == [
        "gpuboot.booking:1 imports gpuboot.steps (airflow layer, above lifecycle)",
        "gpuboot.booking:1 imports gpuboot.steps.place (airflow layer, above lifecycle)"]
    assert violations("from airflow.sdk.exceptions import AirflowException\n", "gpuboot.booking") == [
        "gpuboot.booking:1 imports airflow.sdk.exceptions (no airflow in the lifecycle layer)"]
    assert violations("from gpuboot import scaledown\n", "gpuboot.ledger") == [
        "gpuboot.ledger:1 imports gpuboot.scaledown (airflow layer, above adapters)"]
    assert violations("import simcloud.testing\n", "gpuboot.taskgroup") == [
        "gpuboot.taskgroup:1 imports simcloud.testing (no simcloud in the airflow layer)"]
    assert violations("x = 1\n", "gpuboot.newthing") == [
        "gpuboot.newthing: not placed in any layer of tests/static/test_layers.py"]
    assert violations("from gpuboot.resources import GPU\nimport json\n", "gpuboot.placement") == []

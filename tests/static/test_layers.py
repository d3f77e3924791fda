"""The layers of plugins/gpuboot are import-linter contracts in pyproject.toml ([tool.importlinter]):
a module is placed by the folder it lives in, and each folder may import only the folders below it

    ui > task_groups > sensors > operators > triggers > lifecycle > hooks | replay > core

with the core and the replay pure (no Airflow, no I/O library), the lifecycle free of Airflow,
the hooks free of the core's decisions, and nothing under plugins/ importing the local cloud.
The local cloud has its own layers (simcloud/__init__.py draws them)

    __main__ | harness > server > admin | machines > fleet > kube | ecs > config | workdir | tls

and no import cycle between the modules or subpackages of any of its packages (acyclic_siblings).
These tests run the real check on the tree, and on copies of it with one crossing each, so the
check itself is seen to fail.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "plugins"), str(root)]))
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_contract():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.fixture
def tree_copy(tmp_path) -> Path:
    shutil.copytree(ROOT / "plugins" / "gpuboot", tmp_path / "plugins" / "gpuboot",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "simcloud", tmp_path / "simcloud", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


CROSSINGS = {
    # (file to append to, under the tree's root; the import; the contract that must break)
    "core imports a hook": ("plugins/gpuboot/core/placement.py", "from gpuboot.hooks.kube import KubeClient",
                            "gpuboot's layers"),
    "a hook imports an operator": ("plugins/gpuboot/hooks/ecs.py", "from gpuboot.operators.place import PlaceOperator",
                                   "gpuboot's layers"),
    "an import inside a function": ("plugins/gpuboot/lifecycle/boot.py",
                                    "def f():\n    from gpuboot.sensors import gpu_ready", "gpuboot's layers"),
    "core imports an I/O library": ("plugins/gpuboot/core/readiness.py", "import kubernetes",
                                    "The core and the replay are pure"),
    "core imports Airflow": ("plugins/gpuboot/core/jobspec.py", "from airflow.sdk import Param",
                             "The core and the replay are pure"),
    "the lifecycle imports Airflow": ("plugins/gpuboot/lifecycle/booking.py",
                                      "from airflow.sdk.exceptions import AirflowException", "knows no Airflow"),
    "a hook decides placement": ("plugins/gpuboot/hooks/kube.py", "from gpuboot.core.placement import place",
                                 "never its decisions"),
    "the product imports the local cloud": ("plugins/gpuboot/ui/plugin.py", "import simcloud.harness",
                                            "never imports the local cloud"),
    # the local cloud
    "the Kubernetes server imports the ECS emulator": ("simcloud/kube/scheduler.py",
                                                       "from simcloud.ecs.model import Instance", "simcloud's layers"),
    "the ECS emulator imports the fleet": ("simcloud/ecs/model.py", "from simcloud import fleet", "simcloud's layers"),
    "the Kubernetes API imports the admin surface": ("simcloud/kube/api.py", "from simcloud.admin import ADMIN_PREFIX",
                                                     "simcloud's layers"),
    "a kubelet imports the server, inside a function": ("simcloud/machines/kubelet.py",
                                                        "def f():\n    from simcloud.server import Cloud",
                                                        "simcloud's layers"),
    "config imports the store": ("simcloud/config.py", "from simcloud.kube.store import Store", "simcloud's layers"),
    # cycles inside one layer, which no layer contract sees
    "a cycle in the Kubernetes server, inside a function": ("simcloud/kube/admission.py",
                                                            "def f():\n    from simcloud.kube.store import ApiError",
                                                            "no import cycle"),
    "a cycle in the ECS emulator": ("simcloud/ecs/model.py", "from simcloud.ecs import api", "no import cycle"),
}


@pytest.mark.parametrize("case", CROSSINGS, ids=list(CROSSINGS))
def test_a_crossing_breaks_its_contract(tree_copy, case):
    path, line, contract = CROSSINGS[case]
    target = tree_copy / path
    target.write_text(target.read_text() + "\n" + line + "\n")
    run = lint_imports(tree_copy)
    assert run.returncode != 0
    broken = [row for row in run.stdout.splitlines() if row.rstrip().endswith("BROKEN")]
    assert any(contract in row for row in broken), run.stdout


def test_a_new_folder_must_be_placed_in_a_layer(tree_copy):
    """exhaustive: a new top-level package of gpuboot is refused until pyproject.toml places it."""
    (tree_copy / "plugins" / "gpuboot" / "newthing").mkdir()
    (tree_copy / "plugins" / "gpuboot" / "newthing" / "__init__.py").write_text("")
    run = lint_imports(tree_copy)
    assert run.returncode != 0 and "gpuboot.newthing" in run.stdout, run.stdout


def test_a_new_simcloud_module_must_be_placed_in_a_layer(tree_copy):
    """exhaustive: a new module or subpackage at simcloud's top is refused until pyproject.toml places it."""
    (tree_copy / "simcloud" / "newthing.py").write_text("")
    run = lint_imports(tree_copy)
    assert run.returncode != 0 and "simcloud.newthing" in run.stdout, run.stdout

"""The ports hold both ways: the lifecycle calls Kubernetes and ECS only through the Protocols of
gpuboot.core.ports, and the real adapters and the test fakes both have every Protocol method with a
compatible signature (same parameter names, kinds and defaults; the adapter may take more, with
defaults). So a fake cannot drift from the adapter it stands for without a test failing here."""
from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Protocol

import pytest

from gpuboot.core.ports import ClusterReads, ConfigMapStore, Ecs, PodControl
from gpuboot.hooks.kube import KubeClient
from tests.fakes import FakeCluster, FakeEcs

PACKAGE = Path(__file__).resolve().parents[4] / "plugins" / "gpuboot"
EMPTY = inspect.Parameter.empty
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def members(protocol: type) -> list[str]:
    """The methods a Protocol asks for (its own and its Protocol bases')."""
    names = {n for k in protocol.__mro__ if Protocol in k.__bases__
             for n, v in vars(k).items() if callable(v) and not n.startswith("_")}
    return sorted(names)


def _annotation_fits(wanted, given) -> bool:
    """The implementation's annotation is the Protocol's, or a union that has it as a member."""
    return given == wanted or (isinstance(given, str) and isinstance(wanted, str)
                               and wanted in [part.strip() for part in given.split("|")])


def mismatches(protocol: type, cls: type) -> list[str]:
    """Where `cls` does not satisfy `protocol`, one line each."""
    out = []
    for name in members(protocol):
        impl = getattr(cls, name, None)
        where = f"{cls.__name__}.{name}"
        if not callable(impl):
            out.append(f"{where}: missing")
            continue
        want = [p for p in inspect.signature(getattr(protocol, name)).parameters.values() if p.name != "self"]
        have_sig = inspect.signature(impl)
        have = [p for p in have_sig.parameters.values() if p.name != "self"]
        by_name = {p.name: p for p in have}
        for i, p in enumerate(want):
            q = by_name.get(p.name)
            if q is None:
                out.append(f"{where}: no parameter {p.name!r}")
                continue
            if p.kind in POSITIONAL and (q.kind not in POSITIONAL or have.index(q) != i):
                out.append(f"{where}: {p.name!r} is not positional parameter {i + 1}")
            if p.kind is inspect.Parameter.KEYWORD_ONLY and q.kind not in (inspect.Parameter.KEYWORD_ONLY,
                                                                          inspect.Parameter.POSITIONAL_OR_KEYWORD):
                out.append(f"{where}: {p.name!r} cannot be passed by keyword")
            if p.default is not EMPTY and q.default != p.default:
                out.append(f"{where}: {p.name!r} defaults to {q.default!r}, not {p.default!r}")
            if not _annotation_fits(p.annotation, q.annotation):
                out.append(f"{where}: {p.name!r} is {q.annotation}, not {p.annotation}")
        wanted_names = {p.name for p in want}
        for q in have:
            if q.name not in wanted_names and q.kind not in VARIADIC and q.default is EMPTY:
                out.append(f"{where}: extra parameter {q.name!r} has no default")
        returns = inspect.signature(getattr(protocol, name)).return_annotation
        if have_sig.return_annotation != returns:
            out.append(f"{where}: returns {have_sig.return_annotation}, not {returns}")
    return out


def ecs_hook() -> type:
    from gpuboot.hooks.ecs import EcsHook  # imports Airflow (a BaseHook): only this test needs it

    return EcsHook


@pytest.mark.parametrize("protocol, implementation", [
    (ClusterReads, lambda: KubeClient), (ConfigMapStore, lambda: KubeClient), (Ecs, ecs_hook),
    (ClusterReads, lambda: FakeCluster), (ConfigMapStore, lambda: FakeCluster), (Ecs, lambda: FakeEcs),
    (PodControl, lambda: KubeClient), (PodControl, lambda: FakeCluster),
], ids=["KubeClient-reads", "KubeClient-configmaps", "EcsHook", "FakeCluster-reads", "FakeCluster-configmaps",
        "FakeEcs", "KubeClient-pods", "FakeCluster-pods"])
def test_the_adapters_and_the_fakes_satisfy_the_ports(protocol, implementation):
    assert mismatches(protocol, implementation()) == []


def test_the_check_catches_drift():
    class Drifted:
        def list_nodes(self, label_selector: str) -> list[dict]: ...          # a new required parameter
        def list_active_pods(self) -> list: ...                                # another return type
        def describe_instances(self, ids: list[str]) -> list[dict]: ...        # renamed

        def stop_instances(self, instance_ids: list[str], stopped_mode: str = "KeepCharging") -> dict: ...

    assert mismatches(ClusterReads, Drifted) == [
        "Drifted.list_active_pods: returns list, not list[dict]",
        "Drifted.list_nodes: extra parameter 'label_selector' has no default",
        "Drifted.node_to_watch: missing",
    ]
    found = mismatches(Ecs, Drifted)
    assert "Drifted.describe_instances: no parameter 'instance_ids'" in found
    assert "Drifted.stop_instances: 'stopped_mode' defaults to 'KeepCharging', not 'StopCharging'" in found
    assert "Drifted.stop_instances: 'instance_ids' is list[str], not Sequence[str]" in found


def calls_on(path: Path, receivers: set[str]) -> set[str]:
    """Attributes taken of `kube` / `self.kube` (and the like) in a module: what it calls on them."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in receivers:
                found.add(f"{owner.id}.{node.attr}")
            elif (isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name)
                  and owner.value.id == "self" and owner.attr in receivers):
                found.add(f"{owner.attr}.{node.attr}")
    return found


def test_the_ports_list_exactly_what_the_lifecycle_and_the_ledger_call():
    lifecycle = set().union(*(calls_on(PACKAGE / "lifecycle" / f"{name}.py", {"kube", "ecs"}) for name in ("booking", "boot", "pricing")))
    assert lifecycle == {f"kube.{m}" for m in members(ClusterReads)} | {f"ecs.{m}" for m in members(Ecs)}
    assert calls_on(PACKAGE / "lifecycle" / "ledger.py", {"kube"}) == {f"kube.{m}" for m in members(ConfigMapStore)}
    assert calls_on(PACKAGE / "lifecycle" / "preemption.py", {"kube"}) == {f"kube.{m}" for m in members(PodControl)}


def test_the_lifecycle_imports_no_airflow_and_no_client_library():
    """What keeps its unit tests fast: booking and boot load without Airflow or an I/O library."""
    code = ("import sys, gpuboot.lifecycle.boot, gpuboot.lifecycle.booking; print(sorted({m.split('.')[0] for m in sys.modules}"
            " & {'airflow', 'kubernetes', 'alibabacloud_ecs20140526'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(PACKAGE.parent)})
    assert out.stdout.strip() == "[]"

"""Where a benchmark's CPU went, from Linux /proc: per process tree, per control-plane component, the machine.

Why. On this machine the API servers, etcd, the local cloud's kubelets and ECS, the placer and the place
steps (in a deployment: Airflow workers on machines of their own) share two cores. A figure such as
placements per second is only read right beside who used the cores while it was measured.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# the real control plane's processes: `controlplane <component> ...` (controlplane/main.go)
COMPONENTS = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")


@dataclass(frozen=True)
class Proc:
    parent: int
    cpu_s: float            # user + system so far
    argv: tuple[str, ...]


def processes() -> dict[int, Proc]:
    """Every process running now: pid -> its parent, CPU seconds so far and command line."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:         # ended meanwhile
            continue
        table[int(entry)] = Proc(int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK,
                                 tuple(a.decode(errors="replace") for a in argv if a))
    return table


def _children(table: dict[int, Proc]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = defaultdict(list)
    for pid, proc in table.items():
        children[proc.parent].append(pid)
    return children


def tree_cpu(root: int, table: dict[int, Proc] | None = None) -> float:
    """CPU seconds (user + system) used so far by `root` and every process under it that still runs."""
    table = processes() if table is None else table
    children, total, todo = _children(table), 0.0, [root]
    while todo:
        pid = todo.pop()
        total += table[pid].cpu_s if pid in table else 0.0
        todo += children[pid]
    return total


def used_between(table0: dict[int, Proc], table1: dict[int, Proc], pid: int) -> float:
    """CPU seconds `pid` used between two `processes()` tables (0 if it ran in neither)."""
    return (table1[pid].cpu_s if pid in table1 else 0.0) - (table0[pid].cpu_s if pid in table0 else 0.0)


def cloud_parts(root: int, table: dict[int, Proc]) -> dict[str, float]:
    """CPU seconds so far of the local cloud (`root`: the `simcloud serve` process), by part: each control-plane
    component under it (with its own children) by name, everything else as "local cloud" (on the simcloud
    backend that is its API server too; on both, the kubelets and ECS)."""
    parts: dict[str, float] = defaultdict(float)
    parts["local cloud"] = table[root].cpu_s if root in table else 0.0
    for pid in _children(table)[root]:
        argv = table[pid].argv
        named = len(argv) > 1 and Path(argv[0]).name == "controlplane" and argv[1] in COMPONENTS
        parts[argv[1] if named else "local cloud"] += tree_cpu(pid, table)
    return dict(parts)


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every core) since boot: /proc/stat less idle and iowait."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / TICK


def own_cpu_s() -> float:
    """CPU seconds this process (all its threads) has used so far."""
    times = os.times()
    return times.user + times.system

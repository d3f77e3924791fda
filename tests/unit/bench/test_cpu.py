"""bench.cpu: the CPU of a process tree, of the local cloud's parts, and of this process (Linux /proc)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.cpu import Proc, cloud_parts, machine_busy_s, own_cpu_s, processes, tree_cpu, used_between
from simcloud.harness import wait_until

BURN = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\nsys.stdin.read()\n"
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux
def test_the_cpu_of_a_grandchild_counts_for_the_process_it_runs_under():
    """A shell (idle itself) runs a Python that burns half a second of CPU, then lives on until its stdin
    closes (a process that has ended no longer counts): the shell's tree holds that CPU."""
    shell = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "$0"; :', BURN], stdin=subprocess.PIPE)
    try:
        assert wait_until(lambda: tree_cpu(shell.pid) >= 0.4, timeout=30, message="the grandchild's CPU")
        assert tree_cpu(shell.pid) < 5      # its own, not the machine's
        assert processes()[shell.pid].argv[0] == "sh"
    finally:
        shell.stdin.close()         # the Python ends, then the shell
        shell.wait(10)


@linux
def test_this_process_and_the_machine_count_the_cpu_burnt_here():
    before, busy = own_cpu_s(), machine_busy_s()
    began = time.process_time()
    while time.process_time() - began < 0.5:    # half a second of CPU in this process
        pass
    assert 0.4 <= own_cpu_s() - before < 5
    assert machine_busy_s() - busy >= 0.4


def test_the_local_clouds_cpu_splits_by_control_plane_component_and_the_rest_is_the_cloud():
    """`simcloud serve` (1) runs etcd (2) and kube-apiserver (3, which has a child 4) from the controlplane
    binary, and a helper (5) that is not a component; 6 is another tree."""
    binary = "/root/.cache/gpuboot/controlplane/abc/controlplane"
    table = {1: Proc(0, 10.0, ("python", "-m", "simcloud", "serve")),
             2: Proc(1, 3.0, (binary, "etcd", "--data-dir=x")),
             3: Proc(1, 20.0, (binary, "kube-apiserver", "--secure-port=1")),
             4: Proc(3, 1.0, ("sh",)),
             5: Proc(1, 2.0, ("python", "-c", "helper")),
             6: Proc(0, 50.0, ("python", "-m", "bench"))}
    assert cloud_parts(1, table) == {"local cloud": 12.0, "etcd": 3.0, "kube-apiserver": 21.0}
    assert cloud_parts(7, table) == {"local cloud": 0.0}      # the cloud has ended
    later = {**table, 2: Proc(1, 4.5, table[2].argv), 8: Proc(1, 1.0, ("sh",))}
    assert (used_between(table, later, 2), used_between(table, later, 8), used_between(table, later, 9)) == (1.5, 1.0, 0.0)

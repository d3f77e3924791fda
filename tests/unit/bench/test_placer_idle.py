"""bench.placer_idle's measure: the CPU of a process and every process under it (Linux /proc)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from bench.placer_idle import tree_cpu
from simcloud.harness import wait_until

BURN = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\nsys.stdin.read()\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_cpu_of_a_grandchild_counts_for_the_process_it_runs_under():
    """A shell (idle itself) runs a Python that burns half a second of CPU, then lives on until its stdin
    closes (a process that has ended no longer counts): the shell's tree holds that CPU."""
    shell = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "$0"; :', BURN], stdin=subprocess.PIPE)
    try:
        assert wait_until(lambda: tree_cpu(shell.pid) >= 0.4, timeout=30, message="the grandchild's CPU")
        assert tree_cpu(shell.pid) < 5      # its own, not the machine's
    finally:
        shell.stdin.close()         # the Python ends, then the shell
        shell.wait(10)

"""`DEMO_ONESHOT=1 scripts/demo.py` end to end: local cloud + airflow standalone + one gpu_job run.

Slow (Airflow standalone boots four components): it runs only when GPUBOOT_TEST_DEMO=1,
which `make test-demo` sets.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO

pytestmark = pytest.mark.skipif(
    os.environ.get("GPUBOOT_TEST_DEMO") != "1", reason="slow; run with `make test-demo` (GPUBOOT_TEST_DEMO=1)"
)


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes whose command line or environment mentions `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (text in cmdline or text in environ):
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def run_demo(tmp_path: Path, **extra: str) -> tuple[str, Path]:
    """The demo in oneshot mode; asserts it exited 0 and returns its output and its folder."""
    demo_dir = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(DEMO_ONESHOT="1", DEMO_DIR=str(demo_dir), DEMO_PASSWORD="e2e-pass", **extra)

    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    out = done.stdout + done.stderr

    assert done.returncode == 0, out[-6000:]
    real = os.environ.get("GPUBOOT_KUBE") == "real"      # make test-real-k8s runs these on it too
    assert ("local cloud ready on the real control plane" in out and "v1.37.2" in out) if real \
        else "local cloud ready on simcloud's own API server" in out
    # standalone's five processes share one SQLite file: WAL keeps its readers from failing a writer
    with contextlib.closing(sqlite3.connect(demo_dir / "airflow" / "airflow.db")) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert "Airflow UI: http://127.0.0.1:" in out and "login: admin / e2e-pass" in out
    for task in ("place", "start", "wait_gpu_ready", "launch"):
        assert any(task in line and line.rstrip().endswith("success") for line in out.splitlines()), task
    return out, demo_dir


def test_demo_oneshot_runs_the_job_and_cleans_up(tmp_path):
    out, demo_dir = run_demo(tmp_path)
    assert "pod | [rank 0] epoch 1/10" in out and "pod | [rank 0] training done" in out
    assert "finished: success" in out
    # the idle scale-down runs from the start (not paused) and stops the node the job booted (issue 9)
    assert "gpuboot_idle_scaledown is unpaused" in out, out[-6000:]
    assert any(line.startswith("    scale-down | gpu-") and " stop " in line for line in out.splitlines()), out[-6000:]
    assert "scale-down stopped gpu-" in out and "nothing is left running idle" in out
    assert processes_mentioning(str(demo_dir)) == []


def test_demo_gang_boots_two_nodes_and_both_ranks_talk_in_the_launch_log(tmp_path):
    """`DEMO_ONESHOT=1 make demo-gang`: 2 ranks of 2 GPUs, so both 2-GPU stopped nodes boot."""
    out, demo_dir = run_demo(tmp_path, DEMO_JOB="gang")
    assert "pod | [rank 0] demo-gang rank 0 of 2: master 127." in out
    assert "pod | [rank 1] demo-gang rank 1 of 2: master 127." in out
    assert "pod | [rank 0] demo-gang rank 0 got: hello from rank 1" in out
    assert "pod | [rank 1] demo-gang rank 1 got: welcome from rank 0 of 2" in out
    assert "finished: success" in out and "scale-down stopped gpu-" in out
    stopped = out.split("scale-down stopped ", 1)[1].split(" (StopCharging)")[0]
    assert len(stopped.split(", ")) == 2, stopped           # the two nodes the gang booted
    assert processes_mentioning(str(demo_dir)) == []

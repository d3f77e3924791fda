"""`make demo &` stops cleanly on SIGINT: the demo script started as a background job of a
non-interactive shell (SIGINT ignored, as POSIX shells do for `&` without job control) gets
SIGINT once the local cloud is up and Airflow standalone is starting, and everything it started
(the cloud, standalone and its children) is gone when it exits. Every process it starts inherits a
marker variable, so a leftover is found whatever its name. The race that once left standalone
running (the interrupt inside Popen, before the `try` that stops the child) is also played on
purpose, for standalone and for the local cloud."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from simcloud.harness import process_alive, wait_until

REPO = Path(__file__).resolve().parents[2]


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark`."""
    def carries(pid: str) -> bool:
        try:
            return f"GPUBOOT_DEMO_MARK={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and carries(p.name)
            and process_alive(int(p.name))]


def described(pids: list[int]) -> list[str]:
    """'pid: command line (parent pid)' for each, for the failure message."""
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except OSError:
            cmd, ppid = "(gone)", "?"
        out.append(f"{pid}: {cmd[:200]} (parent {ppid})")
    return out


def test_the_demo_in_the_background_stops_everything_on_sigint(tmp_path):
    mark = uuid.uuid4().hex
    log = tmp_path / "demo.out"
    env = dict(os.environ, GPUBOOT_DEMO_MARK=mark, DEMO_DIR=str(tmp_path / "demo"), PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        demo = subprocess.Popen([sys.executable, str(REPO / "scripts" / "demo.py")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `cmd &` gets it
    try:
        wait_until(lambda: "starting airflow standalone" in log.read_text(), timeout=180)
        assert len(marked(mark)) >= 3, "the demo, the cloud and standalone should be running"
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert "interrupted; everything is stopped" in log.read_text()
        assert marked(mark) == [], f"left running: {described(marked(mark))}\n{log.read_text()[-3000:]}"
    finally:
        for pid in marked(mark):         # never leave the demo's processes behind a failed test
            os.kill(pid, signal.SIGKILL)
        if demo.poll() is None:
            demo.kill()
            demo.wait()


@contextlib.contextmanager
def interrupted_inside_popen(monkeypatch, module, args=None) -> Iterator[list[subprocess.Popen]]:
    """`module`'s Popen starts the real child (or `args` instead), then the user's Ctrl-C reaches
    this process before Popen returns: the moment of the race. Yields the children started; any
    left running afterwards is killed, after the test's own assertions."""
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_interrupted(child_args, **kwargs):
        started.append(real_popen(args or child_args, **kwargs))
        os.kill(os.getpid(), signal.SIGINT)
        return started[-1]

    monkeypatch.setattr(module.subprocess, "Popen", popen_then_interrupted)
    # the demo's cleanup ignores SIGINT and SIGTERM from then on: put both back, or every later
    # child of this test process would start with them ignored
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield started
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_an_interrupt_while_standalone_is_being_started_still_stops_it(tmp_path, monkeypatch):
    """The race behind a leftover standalone: Ctrl-C arriving inside Popen, after the fork, before
    running_airflow's `try`. Played with a real child in its own session, like standalone: it must
    come out as the interrupt, and the child must be gone."""
    from scripts import demo

    until_signalled = [sys.executable, "-c", "import signal; signal.pause()"]      # runs until stopped
    with interrupted_inside_popen(monkeypatch, demo, until_signalled) as started:
        with pytest.raises(KeyboardInterrupt):
            with demo.running_airflow(dict(os.environ), tmp_path / "standalone.log"):
                pass
        assert started[0].poll() is not None, "the child started during the interrupt was left running"


def test_an_interrupt_while_the_local_cloud_is_being_started_still_stops_it(tmp_path, monkeypatch):
    """The same race for the local cloud the demo starts first (SimCloud.start)."""
    import simcloud.harness as testing

    with interrupted_inside_popen(monkeypatch, testing) as started:
        with pytest.raises(KeyboardInterrupt):
            with testing.SimCloud.start(testing.small_fleet(), tmp_path / "cloud"):
                pass
        assert started[0].poll() is not None, "the local cloud started during the interrupt was left running"

"""`make demo &` stops cleanly on SIGINT: the demo script started as a background job of a
non-interactive shell (SIGINT ignored, as POSIX shells do for `&` without job control) gets
SIGINT once the local cloud is up and Airflow standalone is starting, and everything it started
(the cloud, standalone and its children) is gone when it exits. Every process it starts inherits a
marker variable, so a leftover is found whatever its name."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from simcloud.testing import process_alive, wait_until

REPO = Path(__file__).resolve().parents[3]


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark`."""
    def carries(pid: str) -> bool:
        try:
            return f"GPUBOOT_DEMO_MARK={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and carries(p.name)
            and process_alive(int(p.name))]


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
        assert marked(mark) == [], f"left running: {marked(mark)}\n{log.read_text()[-3000:]}"
    finally:
        for pid in marked(mark):         # never leave the demo's processes behind a failed test
            os.kill(pid, signal.SIGKILL)
        if demo.poll() is None:
            demo.kill()
            demo.wait()

"""Long-running service processes for the distributed test, each in its own session.

Why sessions: Airflow's components fork (Celery pool children, task supervisors that
move their task into a new process *group*, uvicorn workers). A process group is not
enough to find them all again, but none of them calls setsid, so every descendant keeps
the session id of the process we started: stopping a service signals its leader, waits
for the whole session to drain, then SIGKILLs whatever of the session is left.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from simcloud.harness import wait_until


class ServiceDied(RuntimeError):
    """A service exited while the test still needed it."""


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    log_path: Path
    stop_signal: signal.Signals
    layer: int

    def tail(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is `sid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the command: state ppid pgrp session ...
        if fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(entry.name))
    return members


class Processes:
    """Named services started in order and stopped in reverse order, always (use as a context manager)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.services: list[Service] = []
        self.extra_logs: dict[str, Path] = {}  # other logs worth showing on failure (e.g. the cloud's)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, args: Sequence[str], *, env: dict[str, str] | None = None,
              cwd: Path | None = None, user: str | None = None,
              stop_signal: signal.Signals = signal.SIGTERM, layer: int = 0) -> Service:
        """Start `args` in a new session with stdout+stderr in `<log_dir>/<name>.log`; higher
        layers are stopped first."""
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(list(args), env=env, cwd=cwd, user=user, stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        service = Service(name, process, log_path, stop_signal, layer)
        self.services.append(service)
        return service

    def check_alive(self) -> None:
        """Raise ServiceDied naming the first service that exited, with the end of its log."""
        for service in self.services:
            if service.process.poll() is not None:
                raise ServiceDied(f"{service.name} exited with status {service.process.returncode}; "
                                  f"end of {service.log_path}:\n{service.tail()}")

    def wait_for_log(self, service: Service, text: str, timeout: float) -> None:
        """Wait until `text` appears in the service's log (failing early if any service died)."""
        def seen() -> bool:
            self.check_alive()
            return text in service.log_path.read_text(errors="replace")
        wait_until(seen, timeout=timeout, interval=0.2,
                   message=lambda: f"{service.name} did not log {text!r} in {timeout}s:\n{service.tail()}")

    def tails(self, lines: int = 60) -> str:
        """The end of every service's log (and of the extra logs), for a failure report."""
        logs = {s.name: s.log_path for s in self.services} | self.extra_logs
        return "\n".join(f"===== {name} ({path}) =====\n{tail(path, lines)}" for name, path in logs.items())

    def stop_all(self, grace: float = 20.0) -> None:
        while self.services:
            top = max(s.layer for s in self.services)
            stop([s for s in self.services if s.layer == top], grace)
            self.services = [s for s in self.services if s.layer != top]


def stop(services: list[Service], grace: float = 20.0) -> None:
    """Signal the leaders, wait up to `grace` for their sessions to drain, then SIGKILL the rest."""
    started = time.monotonic()
    for service in services:
        with contextlib.suppress(ProcessLookupError):
            service.process.send_signal(service.stop_signal)
    sessions = {service.process.pid for service in services}

    def left() -> list[int]:
        for service in services:
            service.process.poll()  # reap the leaders so they stop counting
        return [pid for sid in sessions for pid in session_members(sid)]

    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not left(), timeout=grace, interval=0.1)
    for pid in left():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for service in services:
        with contextlib.suppress(subprocess.TimeoutExpired):
            service.process.wait(timeout=5)
    print(f"stopped {', '.join(s.name for s in services)} in {time.monotonic() - started:.1f}s", flush=True)

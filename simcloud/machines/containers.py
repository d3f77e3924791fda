"""What a container does in the local cloud, and the pod logs it leaves (the LogSource).

The rule, so that exit codes and logs are real:

* `command` + `args` run as a local process. `python`/`python3` as the first word mean
  this interpreter (`sys.executable`); anything else must be an absolute path or on
  PATH (`sh -c "..."` works). Without `command`, `args` alone is the command line (the
  image's entrypoint is unknown here). `$(VAR)` references are expanded from the env
  as Kubernetes does (`$$(` escapes).
* The process gets only the container's env (`value`, `valueFrom.fieldRef`, `valueFrom.secretKeyRef` and
  `envFrom.secretRef`: a missing Secret or key keeps it waiting in CreateContainerConfigError), plus
  PATH, HOME (= its own temp working dir), HOSTNAME (= pod name), KUBERNETES_SERVICE_HOST/
  _PORT and KUBERNETES_PORT (the address the local API server is bound to, so an in-pod
  client reaches it under `serve --host` too), PYTHONUNBUFFERED=1 (so progress lines arrive as printed), and
  NVIDIA_VISIBLE_DEVICES for GPU pods. Its cwd is a fresh temp dir.
* Networking: pods share the host's network stack, but each gets its own loopback address
  as status.podIP (127.x.y.z, see kubelet.new_pod_ip; `valueFrom.fieldRef: status.podIP`
  gives it), so processes of different pods bind the same port at their own pod IP and
  reach each other there: a gang's ranks really rendezvous at MASTER_ADDR:MASTER_PORT.
* stdout and stderr are captured together, line by line, each with a nanosecond
  timestamp, into the container's log. The image is recorded, never pulled.
* A container with neither command nor args sleeps `simcloud.io/run-seconds` (pod
  annotation, default 1 s) without a process, and prints one line.
* A container whose process cannot be started (command not found, exec refused: E2BIG
  "argument list too long" for oversized args or env, EACCES, ENOEXEC) never runs, as
  containerd reports it: state terminated, reason StartError, exit code 128, the runc
  message; the kubelet then applies restartPolicy (Never: the pod is Failed).
* Processes run in their own session and die with the server (SIGTERM/SIGKILL of the
  process group on delete, node stop and shutdown; PR_SET_PDEATHSIG if the server is
  killed outright).
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

from simcloud.kube.errors import ApiError

RUN_SECONDS_ANNOTATION = "simcloud.io/run-seconds"
EXIT_START_ERROR = 128      # containerd's exit code for a container whose task never started
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def rfc3339(ns: int | None = None, nanos: bool = False) -> str:
    """RFC 3339 UTC ("...Z"); with nanos, the RFC3339Nano form kubelet log timestamps use."""
    ns = time.time_ns() if ns is None else ns
    base = datetime.fromtimestamp(ns // 1_000_000_000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{base}.{ns % 1_000_000_000:09d}Z" if nanos else f"{base}Z"


class CannotRun(Exception):
    """The container's process could not be started (message as containerd words it)."""


class ContainerLog:
    """Timestamped lines of one container instance; followers wake on every append."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, bytes]] = []
        self.done = False
        self.changed = asyncio.Event()

    def append(self, line: bytes) -> None:
        self.lines.append((time.time_ns(), line if line.endswith(b"\n") else line + b"\n"))
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        event, self.changed = self.changed, asyncio.Event()
        event.set()


class Container:
    """One running container instance: a process, or a sleeper for command-less containers."""

    def __init__(self, name: str, image: str, log: ContainerLog, workdir: Path | None) -> None:
        self.name = name
        self.image = image
        self.log = log
        self.workdir = workdir
        self.started_at = rfc3339()
        self.container_id = "containerd://" + hashlib.sha256(f"{name}{time.time_ns()}".encode()).hexdigest()
        self.image_id = image_id(image)
        self.exit_code: int | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task | None = None

    async def wait(self) -> int:
        """Exit code (128+signal when killed by one) once the process is gone and its output read."""
        await asyncio.shield(self._task)
        return self.exit_code

    def signal(self, sig: int) -> None:
        if self.exit_code is not None:
            return
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, sig)
        elif self._task is not None:
            self._task.cancel(msg=str(int(sig)))

    async def stop(self, grace_seconds: float) -> int:
        """SIGTERM, then SIGKILL after the grace period, as the kubelet does."""
        self.signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.wait(), timeout=max(grace_seconds, 0.0))
        except TimeoutError:
            self.signal(signal.SIGKILL)
            return await self.wait()


def _runc_error(program: str, why: str) -> str:
    """How containerd words a container process that could not be started."""
    return ("failed to create containerd task: failed to create shim task: OCI runtime create failed: "
            f'runc create failed: unable to start container process: exec: "{program}": {why}: unknown')


def image_id(image: str) -> str:
    repo = image.split("@", maxsplit=1)[0].rsplit(":", 1)[0] if ":" in image.rsplit("/", maxsplit=1)[-1] else image.split("@", maxsplit=1)[0]
    return f"{repo}@sha256:{hashlib.sha256(image.encode()).hexdigest()}"


def _expand(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR_REF.sub(sub, text)


def secret_refs(container: dict) -> list[tuple[str, str | None, bool]]:
    """The Secrets a container's env reads: (name, key or None for envFrom's every key, optional)."""
    refs = [((s.get("secretRef") or {}).get("name", ""), None, bool((s.get("secretRef") or {}).get("optional")))
            for s in container.get("envFrom") or [] if s.get("secretRef")]
    for item in container.get("env") or []:
        ref = (item.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            refs.append((ref.get("name", ""), ref.get("key", ""), bool(ref.get("optional"))))
    return refs


def _field_value(pod: dict, path: str) -> str:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    return str({
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.hostIP": status.get("hostIP"), "status.podIP": status.get("podIP"),
    }.get(path) or "")


_libc = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if _libc is not None:
        _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ContainerRunner:
    """Starts containers as local processes and serves their logs (the LogSource of simcloud.kube.api)."""

    def __init__(self, root: Path, k8s_host: str = "127.0.0.1", k8s_port: int = 0) -> None:
        global _libc
        if _libc is None and sys.platform.startswith("linux"):
            _libc = ctypes.CDLL(None, use_errno=True)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.k8s_host, self.k8s_port = k8s_host, k8s_port   # the Kubernetes API, as pods reach it
        self._logs: dict[tuple[str, str], ContainerLog] = {}   # (pod uid, container) -> newest instance
        self._running: set[Container] = set()
        self._workdirs: dict[str, list[Path]] = {}               # pod uid -> temp dirs to remove

    # -- running -----------------------------------------------------------
    def environment(self, pod: dict, container: dict, extra: dict[str, str],
                    secrets: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
        """The process's environment; `secrets` (name -> decoded data) are those the container reads
        (secret_env_names), fetched by the kubelet: envFrom's first, then env in order, as Kubernetes does."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "HOSTNAME": pod["metadata"]["name"],
            "KUBERNETES_SERVICE_HOST": self.k8s_host,
            "KUBERNETES_SERVICE_PORT": str(self.k8s_port),
            "KUBERNETES_PORT": f"tcp://{self.k8s_host}:{self.k8s_port}",
        }
        env.update(extra)
        secrets = secrets or {}
        for source in container.get("envFrom") or []:
            env.update(secrets.get((source.get("secretRef") or {}).get("name", ""), {}))
        for item in container.get("env") or []:
            value_from = item.get("valueFrom") or {}
            if "value" in item:
                env[item["name"]] = _expand(str(item.get("value") or ""), env)
            elif value_from.get("fieldRef"):
                env[item["name"]] = _field_value(pod, value_from["fieldRef"].get("fieldPath", ""))
            elif value_from.get("secretKeyRef"):
                ref = value_from["secretKeyRef"]
                if ref.get("key") in secrets.get(ref.get("name", ""), {}):
                    env[item["name"]] = secrets[ref["name"]][ref["key"]]
        return env

    async def start(self, pod: dict, container: dict, extra_env: dict[str, str] | None = None,
                    secrets: dict[str, dict[str, str]] | None = None) -> Container:

        """Start one container of `pod`; raises CannotRun (after logging why) when its command is missing."""
        meta = pod["metadata"]
        name = container["name"]
        log = ContainerLog()
        self._logs[(meta.get("uid", ""), name)] = log
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        if not argv:
            seconds = float((meta.get("annotations") or {}).get(RUN_SECONDS_ANNOTATION, 1))
            ctr = Container(name, container.get("image", ""), log, None)
            ctr._task = asyncio.ensure_future(self._sleep(ctr, seconds))
            self._track(ctr)
            return ctr
        workdir = Path(tempfile.mkdtemp(prefix=f"{meta.get('namespace')}_{meta['name']}_{name}_", dir=self.root))
        self._workdirs.setdefault(meta.get("uid", ""), []).append(workdir)
        env = self.environment(pod, container, {"HOME": str(workdir), **(extra_env or {})}, secrets)
        argv = [_expand(str(a), env) for a in argv]
        # a path is exec'd as given (the exec's own error names what is wrong); a bare name is looked up on PATH
        exe = sys.executable if argv[0] in ("python", "python3") else \
            argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env["PATH"])
        if exe is None:
            log.close()
            raise CannotRun(_runc_error(argv[0], "executable file not found in $PATH"))
        ctr = Container(name, container.get("image", ""), log, workdir)
        try:
            ctr._process = await asyncio.create_subprocess_exec(
                exe, *argv[1:], cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent, limit=1 << 20)
        except OSError as exc:      # the exec itself was refused (E2BIG, EACCES, ENOEXEC, ...)
            log.close()
            raise CannotRun(_runc_error(argv[0], os.strerror(exc.errno).lower() if exc.errno else str(exc))) from None
        ctr._task = asyncio.ensure_future(self._pump(ctr))
        self._track(ctr)
        return ctr

    def _track(self, ctr: Container) -> None:
        self._running.add(ctr)
        ctr._task.add_done_callback(lambda _t: self._running.discard(ctr))

    async def _pump(self, ctr: Container) -> None:
        proc = ctr._process
        try:
            while True:
                try:
                    line = await proc.stdout.readline()
                except ValueError:  # a line longer than the limit: take it in pieces
                    line = await proc.stdout.read(1 << 20)
                if not line:
                    break
                ctr.log.append(line)
            code = await proc.wait()
        finally:
            ctr.log.close()
        ctr.exit_code = 128 - code if code < 0 else code

    async def _sleep(self, ctr: Container, seconds: float) -> None:
        ctr.log.append(f"simcloud: container {ctr.name} ({ctr.image}) has no command; "
                       f"running for {seconds:g}s".encode())
        try:
            await asyncio.sleep(seconds)
            ctr.exit_code = 0
        except asyncio.CancelledError as exc:
            ctr.exit_code = 128 + int(exc.args[0] if exc.args and str(exc.args[0]).isdigit() else signal.SIGKILL)
        finally:
            ctr.log.close()

    def forget(self, pod_uid: str) -> None:
        """Drop a removed pod's logs and temp working dirs."""
        for key in [k for k in self._logs if k[0] == pod_uid]:
            del self._logs[key]
        for path in self._workdirs.pop(pod_uid, []):
            shutil.rmtree(path, ignore_errors=True)

    async def shutdown(self, grace_seconds: float = 2.0) -> None:
        """Stop every container (SIGTERM, then SIGKILL after the grace period)."""
        running = list(self._running)
        if running:
            await asyncio.gather(*(c.stop(grace_seconds) for c in running), return_exceptions=True)
        for uid in list(self._workdirs):
            self.forget(uid)

    # -- LogSource ---------------------------------------------------------
    def stream(self, namespace: str, pod: dict, container: str | None, *, follow: bool = False,
               timestamps: bool = False, since_seconds: int | None = None, since_time: str | None = None,
               tail_lines: int | None = None, limit_bytes: int | None = None) -> AsyncIterator[bytes]:
        """Validate now (raising ApiError 400 like the kubelet) and return the line iterator."""
        meta = pod["metadata"]
        names = [c["name"] for c in (pod.get("spec", {}).get("initContainers") or [])] + \
                [c["name"] for c in pod.get("spec", {}).get("containers") or []]
        main = [c["name"] for c in pod.get("spec", {}).get("containers") or []]
        if container is None:
            if len(main) != 1:
                raise ApiError(400, "BadRequest", f"a container name must be specified for pod {meta['name']}, "
                                                  f"choose one of: [{' '.join(main)}]")
            container = main[0]
        elif container not in names:
            raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {meta['name']}")
        log = self._logs.get((meta.get("uid", ""), container))
        if log is None:
            raise ApiError(400, "BadRequest",
                           f'container "{container}" in pod "{meta["name"]}" is waiting to start: ContainerCreating')
        cutoff = 0
        if since_seconds is not None:
            cutoff = time.time_ns() - int(since_seconds) * 1_000_000_000
        elif since_time:
            cutoff = int(datetime.fromisoformat(since_time.replace("Z", "+00:00")).timestamp() * 1e9)
        return _follow(log, cutoff, follow, timestamps, tail_lines, limit_bytes)


async def _follow(log: ContainerLog, cutoff: int, follow: bool, timestamps: bool,
                  tail_lines: int | None, limit_bytes: int | None) -> AsyncIterator[bytes]:
    index = 0
    if tail_lines is not None:
        index = max(0, len(log.lines) - int(tail_lines))
    budget = None if limit_bytes is None else int(limit_bytes)
    while True:
        changed = log.changed
        while index < len(log.lines):
            ts, line = log.lines[index]
            index += 1
            if ts < cutoff:
                continue
            out = (rfc3339(ts, nanos=True).encode() + b" " + line) if timestamps else line
            if budget is not None:
                if budget <= 0:
                    return
                out, budget = out[:budget], budget - len(out)
            yield out
        if not follow or log.done:
            return
        await changed.wait()

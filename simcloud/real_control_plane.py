"""The real Kubernetes control plane, run from the `controlplane` binary (controlplane/, `make controlplane`).

    from simcloud.real_control_plane import RealControlPlane, controlplane_binary

    plane = RealControlPlane(tmp_path / "k8s", controlplane_binary())
    kubelet = plane.add_node_token("gpu-1")          # before start: user system:node:gpu-1, group system:nodes
    with plane:                                      # etcd, kube-apiserver, controller-manager, scheduler
        kubernetes.config.load_kube_config(str(plane.admin_kubeconfig))
        ...
        plane.compact()                              # etcd compaction at the current revision

Everything lives in the workdir: `pki/` (a CA, the API server's serving certificate for 127.0.0.1 and
localhost, the ServiceAccount RSA key), `tokens.csv` (the API server's static token file),
`kubeconfigs/<identity>.kubeconfig` (one per token, for the `kubernetes` client and kubectl),
`etcd/` (data) and `logs/<component>.log`. Each component is its own process; `stop()` (or leaving
the `with` block, or a start that fails halfway) stops the scheduler and the controller-manager,
then the API server, then etcd, SIGTERM first and SIGKILL after a deadline, and waits for each.

Identities: the static token file is read once, when the API server starts, so add tokens before
`start()` with `add_token` / `add_node_token` / `add_user`. After start, mint ServiceAccount
tokens instead (create a ServiceAccount and call its TokenRequest API as admin).

Only the standard library and `cryptography` are used: this module runs without the rest of simcloud.
`python -m simcloud.real_control_plane --workdir DIR` starts a plane for manual use and prints its kubeconfigs.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import datetime
import http.client
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from simcloud.kube.auth import PUBLIC_PATHS

REPO_ROOT = Path(__file__).resolve().parents[1]
BINARY_ENV = "GPUBOOT_CONTROLPLANE_BIN"
BINARY_PATH_FILE = REPO_ROOT / ".tools" / "controlplane-bin"   # written by `make controlplane`
HOST = "127.0.0.1"
# The order in which components start; they stop in the reverse order.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
# A kube-apiserver's compactor records the revisions it compacts under this etcd key (outside the
# /registry prefix) and every kube-apiserver watches it; compact() writes it the same way.
COMPACT_REV_KEY = b"compact_rev_key"


class ControlPlaneError(RuntimeError):
    """A component could not be started (the message carries the end of its log) or stopped."""


def controlplane_binary(explicit: str | os.PathLike | None = None) -> Path:
    """The `controlplane` binary: `explicit`, else $GPUBOOT_CONTROLPLANE_BIN, else the path that
    `make controlplane` wrote to .tools/controlplane-bin; the first of these that is given is used (no
    fallback past a wrong one). FileNotFoundError, naming `make controlplane`, when it is no executable."""
    if explicit:
        source, value = "the argument", str(explicit)
    elif os.environ.get(BINARY_ENV):
        source, value = f"${BINARY_ENV}", os.environ[BINARY_ENV]
    elif BINARY_PATH_FILE.is_file():
        source, value = str(BINARY_PATH_FILE), BINARY_PATH_FILE.read_text().strip()
    else:
        raise FileNotFoundError(
            "the real Kubernetes control plane binary was not found: build it with `make controlplane` (it "
            f"writes its path to {BINARY_PATH_FILE.relative_to(REPO_ROOT)}) or set ${BINARY_ENV}")
    path = Path(value).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(
            f"the real Kubernetes control plane binary {path} (from {source}) is missing or not executable: "
            "build it with `make controlplane`")
    return path


@dataclass
class Identity:
    """A static bearer token of the API server, and the kubeconfig written for it at start."""
    name: str
    user: str
    groups: tuple[str, ...]
    token: str
    uid: str
    kubeconfig: Path | None = None


@dataclass
class _Process:
    component: str
    popen: subprocess.Popen
    log_path: Path
    log_offset: int
    argv: list[str] = field(default_factory=list)
    ready: Callable[[], bool] | None = None


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 right now (held together while picked)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _die_with_parent() -> None:
    """preexec_fn: the child is killed when the thread that started it exits (Linux prctl). SIGKILL, not
    SIGTERM: all components get it at once, and a SIGTERMed kube-apiserver whose etcd is gone takes
    a minute or more to exit."""
    with contextlib.suppress(Exception):   # best effort: not on Linux
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 40, offset: int = 0) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except OSError as error:
        return f"(no log: {error})"
    text = data.decode(errors="replace").rstrip("\n").splitlines()
    return "\n".join(text[-lines:]) if text else "(empty log)"


class _PKI:
    """A CA, the API server's serving certificate for 127.0.0.1/localhost, a ServiceAccount RSA key."""

    def __init__(self, directory: Path, hosts: Sequence[str] = ()):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        valid = {"not_before": now - datetime.timedelta(minutes=5), "not_after": now + datetime.timedelta(days=365)}
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuboot-real_control_plane-ca")])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
              .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(valid["not_before"]).not_valid_after(valid["not_after"])
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                           content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False, encipher_only=False,
                                           decipher_only=False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys([HOST, "localhost", "kubernetes", "kubernetes.default",
                                   "kubernetes.default.svc", *hosts]):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        serving_key = ec.generate_private_key(ec.SECP256R1())
        serving = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
                   .issuer_name(ca.subject).public_key(serving_key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(valid["not_before"]).not_valid_after(valid["not_after"])
                   .add_extension(x509.SubjectAlternativeName(names), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False)
                   .sign(ca_key, hashes.SHA256()))
        self._ca, self._ca_key_obj, self._valid = ca, ca_key, valid
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ca_pem = ca.public_bytes(serialization.Encoding.PEM)
        self.ca_cert = self._write("ca.crt", self.ca_pem)
        self.ca_key = self._write_key("ca.key", ca_key)
        self.serving_cert = self._write("apiserver.crt", serving.public_bytes(serialization.Encoding.PEM))
        self.serving_key = self._write_key("apiserver.key", serving_key)
        self.sa_key = self._write_key("sa.key", sa_key)
        self.sa_pub = self._write("sa.pub", sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    def issue(self, name: str, common_name: str, *, ips: Sequence[str] = (), server: bool = True,
              organization: str | None = None) -> tuple[Path, Path]:
        """A certificate signed by the CA (serving for `ips`, or a client one): (<name>.crt, <name>.key)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        if organization:
            subject.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
        builder = (x509.CertificateBuilder().subject_name(x509.Name(subject)).issuer_name(self._ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(self._valid["not_before"]).not_valid_after(self._valid["not_after"])
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                         else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key_obj.public_key()),
                                  critical=False))
        if ips:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys(ips)]), critical=False)
        cert = builder.sign(self._ca_key_obj, hashes.SHA256())
        return (self._write(f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
                self._write_key(f"{name}.key", key))

    def _write(self, name: str, data: bytes) -> Path:
        path = self.directory / name
        path.write_bytes(data)
        return path

    def _write_key(self, name: str, key) -> Path:
        path = self.directory / name
        path.touch(mode=0o600)
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        return path


class RealControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler in `workdir`, on free ports of
    127.0.0.1. A context manager: `with RealControlPlane(dir, binary) as plane: ...`.

    node_monitor_period / node_monitor_grace_period: the node-lifecycle controller's (seconds).
    controllers: the controller-manager's --controllers (upstream default "*").
    etcd_compaction_interval: the API server's own periodic compaction (upstream 5m; "0" turns it off).
    etcd_auto_compaction: etcd's --auto-compaction-mode/--auto-compaction-retention, e.g. ("revision", "10").
    watch_cache_sizes: the API server's --watch-cache-sizes, e.g. ["podtemplates#0"] serves that
        resource's watches from etcd itself (so an etcd compaction answers them 410 Gone).
    shutdown_watch_termination_grace_period: the API server's flag of that name. Upstream's default (0)
        lets an open watch hold a SIGTERMed kube-apiserver for --request-timeout (60 s); "2s" (ours)
        ends open watches and exits in about a second. None keeps upstream's default.
    kubelet_ips: the addresses the kubelets serve on (the Nodes' InternalIP): start() issues them one
        serving certificate (pki/kubelet.crt, .key) and the API server a client certificate for them
        (pki/apiserver-kubelet-client.*); the API server verifies kubelets against the CA
        (--kubelet-certificate-authority; without it, it would not check their certificates at all)
        and reaches them at their InternalIP (`kubectl logs`, the pod operator's log reads).
    default_toleration_seconds: --default-not-ready/unreachable-toleration-seconds (upstream 300).
    extra_args: {component: [flags...]} appended to that component's command line.
    die_with_parent: the components are SIGKILLed by the kernel when the thread that called start()
        (or restart()) exits, so a crashed test run leaves nothing behind; call start() from a thread
        that outlives the plane (the main thread), or pass False and rely on stop() alone.
    """

    def __init__(self, workdir: str | os.PathLike, binary: str | os.PathLike | None = None, *,
                 node_monitor_period: float = 2.0, node_monitor_grace_period: float = 20.0,
                 controllers: Sequence[str] = ("*",), service_cluster_ip_range: str = "10.96.0.0/12",
                 etcd_compaction_interval: str | None = None,
                 etcd_auto_compaction: tuple[str, str] | None = None,
                 watch_cache_sizes: Sequence[str] = (),
                 shutdown_watch_termination_grace_period: str | None = "2s",
                 extra_args: dict[str, Sequence[str]] | None = None,
                 kubelet_ips: Sequence[str] = (), default_toleration_seconds: int | None = None,
                 start_timeout: float = 90.0, stop_timeout: float = 30.0, die_with_parent: bool = True):
        self.workdir = Path(workdir).resolve()
        self.binary = controlplane_binary(binary)
        self.node_monitor_period = node_monitor_period
        self.node_monitor_grace_period = node_monitor_grace_period
        self.controllers = list(controllers)
        self.service_cluster_ip_range = service_cluster_ip_range
        self.etcd_compaction_interval = etcd_compaction_interval
        self.etcd_auto_compaction = etcd_auto_compaction
        self.watch_cache_sizes = list(watch_cache_sizes)
        self.shutdown_watch_termination_grace_period = shutdown_watch_termination_grace_period
        self.extra_args = {name: list(args) for name, args in (extra_args or {}).items()}
        unknown = set(self.extra_args) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"extra_args for unknown components: {sorted(unknown)}")
        self.kubelet_ips = list(kubelet_ips)
        self.default_toleration_seconds = default_toleration_seconds
        self.kubelet_cert: tuple[Path, Path] | None = None
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.die_with_parent = die_with_parent
        self.identities: dict[str, Identity] = {}
        self.ports: dict[str, int] = {}
        self.startup_seconds: dict[str, float] = {}   # start to ready, per component (last start)
        self.stop_seconds: dict[str, float] = {}      # SIGTERM to exit, per component (last stop)
        self._processes: dict[str, _Process] = {}
        self._lock = threading.Lock()
        self._started = False
        self.pki: _PKI | None = None
        self.log_dir = self.workdir / "logs"
        self.kubeconfig_dir = self.workdir / "kubeconfigs"
        self.etcd_dir = self.workdir / "etcd"
        self.token_file = self.workdir / "tokens.csv"
        self.authn_config = self.workdir / "authentication.json"
        self.admin = self.add_token("admin", ["system:masters"], name="admin")
        self.controller_manager_identity = self.add_token("system:kube-controller-manager",
                                                          name="kube-controller-manager")
        self.scheduler_identity = self.add_token("system:kube-scheduler", name="kube-scheduler")

    # ---- identities -------------------------------------------------------------------------------

    def add_token(self, user: str, groups: Iterable[str] = (), *, name: str | None = None,
                  token: str | None = None, uid: str | None = None) -> Identity:
        """A static token for `user` in `groups` (plus system:authenticated, which the API server adds);
        its kubeconfig is written at start as kubeconfigs/<name>.kubeconfig. Only before start()."""
        if self._started:
            raise RuntimeError("the static token file is read when kube-apiserver starts: add tokens before "
                               "start(), or use ServiceAccount tokens (TokenRequest) afterwards")
        name = name or user.replace(":", "-")
        if name in self.identities:
            raise ValueError(f"an identity named {name!r} exists already")
        groups = tuple(groups)
        for value in (user, name, *groups):
            if any(ch in value for ch in ',"\n'):
                raise ValueError(f"unsupported character in {value!r}")
        identity = Identity(name=name, user=user, groups=groups, token=token or secrets.token_hex(24),
                            uid=uid or f"uid-{secrets.token_hex(8)}")
        self.identities[name] = identity
        return identity

    def add_node_token(self, node_name: str) -> Identity:
        """A kubelet's identity for `node_name`: user system:node:<name> in system:nodes (what the Node
        authorizer and NodeRestriction admission expect), kubeconfig kubeconfigs/node-<name>.kubeconfig."""
        return self.add_token(f"system:node:{node_name}", ["system:nodes"], name=f"node-{node_name}")

    def add_user(self, user: str, groups: Iterable[str] = ()) -> Identity:
        """A plain user (RBAC decides what it may do: bind roles to it as admin)."""
        return self.add_token(user, groups)

    def kubeconfig(self, name: str = "admin") -> Path:
        identity = self.identities[name]
        if identity.kubeconfig is None:
            raise RuntimeError("kubeconfigs are written by start()")
        return identity.kubeconfig

    @property
    def admin_kubeconfig(self) -> Path:
        return self.kubeconfig("admin")

    @property
    def server_url(self) -> str:
        return f"https://{HOST}:{self.ports['apiserver']}"

    @property
    def etcd_url(self) -> str:
        return f"http://{HOST}:{self.ports['etcd-client']}"

    @property
    def ca_cert(self) -> Path:
        assert self.pki is not None, "not started"
        return self.pki.ca_cert

    def log_path(self, component: str) -> Path:
        return self.log_dir / f"{component}.log"

    def kubeconfig_text(self, identity: Identity, namespace: str = "default") -> str:
        """JSON (a subset of YAML): what `kubernetes.config.load_kube_config` and kubectl read."""
        assert self.pki is not None, "not started"
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "real_control_plane", "cluster": {
                "server": self.server_url,
                "certificate-authority-data": base64.b64encode(self.pki.ca_pem).decode()}}],
            "users": [{"name": identity.name, "user": {"token": identity.token}}],
            "contexts": [{"name": f"real_control_plane-{identity.name}", "context": {
                "cluster": "real_control_plane", "user": identity.name, "namespace": namespace}}],
            "current-context": f"real_control_plane-{identity.name}",
        }
        return json.dumps(config, indent=2) + "\n"

    # ---- start / stop -----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Self:
        """Start etcd, kube-apiserver (waits for /readyz), the controller-manager and the scheduler (waits
        for their /healthz). On any failure everything already started is stopped before the error."""
        with self._lock:
            if self._started:
                raise RuntimeError("already started")
            self._started = True
        try:
            self._prepare()
            self._launch("etcd", self._etcd_argv, self._etcd_ready)
            self._launch("kube-apiserver", self._apiserver_argv, self._apiserver_ready)
            self._launch("kube-controller-manager", self._controller_manager_argv, self._controller_manager_ready)
            self._launch("kube-scheduler", self._scheduler_argv, self._scheduler_ready)
        except BaseException:
            self.stop()
            raise
        return self

    def _prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A fresh cluster each start: the folders this class owns are emptied (nothing else is touched).
        for owned in (self.etcd_dir, self.workdir / "pki", self.kubeconfig_dir, self.log_dir):
            shutil.rmtree(owned, ignore_errors=True)
        for folder in (self.kubeconfig_dir, self.log_dir):
            folder.mkdir(parents=True)
        self.etcd_dir.mkdir(mode=0o700)
        self.pki = _PKI(self.workdir / "pki")
        self.kubelet_cert = self.pki.issue("kubelet", "simcloud-kubelet", ips=[HOST, *self.kubelet_ips])
        self.pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", server=False,
                       organization="system:masters")
        self.authn_config.write_text(json.dumps(self.authentication_configuration(), indent=1))
        self.token_file.touch(mode=0o600)
        self.token_file.write_text("".join(
            f'{i.token},{i.user},{i.uid},"{",".join(i.groups)}"\n' for i in self.identities.values()))

    @staticmethod
    def authentication_configuration() -> dict:
        """Anonymous requests only on the public health and version paths (structured authentication's
        `anonymous.conditions`), the hardened set-up simcloud's own server models: a request without a
        token elsewhere is 401, as there, rather than the 403 of the flag's default (anonymous everywhere)."""
        return {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "AuthenticationConfiguration",
                "anonymous": {"enabled": True,
                              "conditions": [{"path": p} for p in dict.fromkeys(p.rstrip("/") for p in PUBLIC_PATHS)]}}

    def _write_kubeconfigs(self) -> None:
        for identity in self.identities.values():
            path = self.kubeconfig_dir / f"{identity.name}.kubeconfig"
            path.touch(mode=0o600)
            path.write_text(self.kubeconfig_text(identity))
            identity.kubeconfig = path

    def _launch(self, component: str, build_argv: Callable[[], list[str]], ready: Callable[[], bool]) -> None:
        """Start `component` and wait until `ready()`; a port taken in between is retried on new ports."""
        for attempt in range(3):
            argv = build_argv()
            started = time.monotonic()
            process = self._spawn(component, argv)
            process.ready = ready
            try:
                self._wait_ready(process, ready, started)
                self.startup_seconds[component] = time.monotonic() - started
                return
            except ControlPlaneError:
                log = _tail(process.log_path, 400, process.log_offset)
                if attempt < 2 and "address already in use" in log:
                    self._terminate([component])
                    continue
                raise

    def restart(self, component: str) -> None:
        """Stop one running component (SIGTERM, waited for) and start it again with the same command line
        and ports, waiting until it is ready. Restarting kube-apiserver rebuilds its watch cache: a watch
        from a resourceVersion older than the restart then answers 410 Gone, as after a real rollout."""
        if component not in self._processes:
            raise RuntimeError(f"{component} is not running")
        old = self._processes[component]
        assert old.ready is not None
        self._terminate([component])
        started = time.monotonic()
        process = self._spawn(component, old.argv)
        process.ready = old.ready
        try:
            self._wait_ready(process, old.ready, started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds[component] = time.monotonic() - started

    def _spawn(self, component: str, argv: list[str]) -> _Process:
        log_path = self.log_path(component)
        with open(log_path, "ab") as log:
            offset = log.tell()
            log.write(f"==== {datetime.datetime.now().isoformat()} {' '.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                [str(self.binary), component, *argv], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True,
                # Only a prctl call runs between fork and exec.
                preexec_fn=_die_with_parent if self.die_with_parent else None)  # noqa: PLW1509
        process = _Process(component, popen, log_path, offset, argv)
        self._processes[component] = process
        return process

    def _wait_ready(self, process: _Process, ready: Callable[[], bool], started: float) -> None:
        deadline = started + self.start_timeout
        last_error = "not ready"
        while True:
            code = process.popen.poll()
            if code is not None:
                raise ControlPlaneError(
                    f"{process.component} exited with code {code} during start-up; last lines of "
                    f"{process.log_path}:\n{_tail(process.log_path, 40, process.log_offset)}")
            try:
                if ready():
                    return
            except Exception as error:
                last_error = f"{type(error).__name__}: {error}"
            if time.monotonic() >= deadline:
                raise ControlPlaneError(
                    f"{process.component} not ready within {self.start_timeout:.0f}s ({last_error}); last lines "
                    f"of {process.log_path}:\n{_tail(process.log_path, 40, process.log_offset)}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the scheduler and controller-manager, then kube-apiserver, then etcd (SIGTERM, then SIGKILL
        after stop_timeout), waiting for each process. Idempotent; raises ControlPlaneError only if a
        process survived SIGKILL."""
        self._terminate(["kube-scheduler", "kube-controller-manager"])
        self._terminate(["kube-apiserver"])
        self._terminate(["etcd"])
        self._started = False

    def _terminate(self, components: Sequence[str]) -> None:
        processes = [self._processes.pop(c) for c in components if c in self._processes]
        signalled = time.monotonic()
        for process in processes:
            if process.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.popen.send_signal(signal.SIGTERM)
        deadline = signalled + self.stop_timeout
        survivors = []
        for process in processes:
            try:
                process.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                self.stop_seconds[process.component] = time.monotonic() - signalled
            except subprocess.TimeoutExpired:
                survivors.append(process)
        for process in survivors:
            with contextlib.suppress(ProcessLookupError):
                process.popen.kill()
            with open(process.log_path, "ab") as log:
                log.write(f"==== SIGKILL after {self.stop_timeout:.0f}s without exit on SIGTERM\n".encode())
        for process in survivors:
            try:
                process.popen.wait(timeout=10)
            except subprocess.TimeoutExpired as error:
                raise ControlPlaneError(f"{process.component} (pid {process.popen.pid}) survived SIGKILL") from error

    def pids(self) -> dict[str, int]:
        return {name: p.popen.pid for name, p in self._processes.items() if p.popen.poll() is None}

    def memory(self) -> dict[str, int]:
        """Resident memory (bytes) of each running component (Linux /proc)."""
        sizes = {}
        for name, pid in self.pids().items():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        sizes[name] = int(line.split()[1]) * 1024
        return sizes

    # ---- command lines ----------------------------------------------------------------------------

    def _etcd_argv(self) -> list[str]:
        client, peer = _free_ports(2)
        self.ports.update({"etcd-client": client, "etcd-peer": peer})
        argv = [
            "--name=gpuboot", f"--data-dir={self.etcd_dir}",
            f"--listen-client-urls=http://{HOST}:{client}", f"--advertise-client-urls=http://{HOST}:{client}",
            f"--listen-peer-urls=http://{HOST}:{peer}", f"--initial-advertise-peer-urls=http://{HOST}:{peer}",
            f"--initial-cluster=gpuboot=http://{HOST}:{peer}", "--initial-cluster-state=new",
            "--unsafe-no-fsync=true", "--log-level=warn",
        ]
        if self.etcd_auto_compaction:
            mode, retention = self.etcd_auto_compaction
            argv += [f"--auto-compaction-mode={mode}", f"--auto-compaction-retention={retention}"]
        return argv + self.extra_args.get("etcd", [])

    def _apiserver_argv(self) -> list[str]:
        assert self.pki is not None
        (port,) = _free_ports(1)
        self.ports["apiserver"] = port
        argv = [
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={HOST}", f"--advertise-address={HOST}", f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'pki' / 'apiserver-generated'}",
            f"--tls-cert-file={self.pki.serving_cert}", f"--tls-private-key-file={self.pki.serving_key}",
            f"--client-ca-file={self.pki.ca_cert}",
            f"--token-auth-file={self.token_file}",
            f"--authentication-config={self.authn_config}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.pki.sa_key}",
            f"--service-account-signing-key-file={self.pki.sa_key}",
            f"--service-cluster-ip-range={self.service_cluster_ip_range}",
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            f"--kubelet-certificate-authority={self.pki.ca_cert}",
            f"--kubelet-client-certificate={self.pki.directory / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={self.pki.directory / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
        ]
        if self.default_toleration_seconds is not None:
            argv += [f"--default-not-ready-toleration-seconds={self.default_toleration_seconds}",
                     f"--default-unreachable-toleration-seconds={self.default_toleration_seconds}"]
        if self.etcd_compaction_interval is not None:
            argv.append(f"--etcd-compaction-interval={self.etcd_compaction_interval}")
        if self.watch_cache_sizes:
            argv.append(f"--watch-cache-sizes={','.join(self.watch_cache_sizes)}")
        if self.shutdown_watch_termination_grace_period is not None:
            argv.append(f"--shutdown-watch-termination-grace-period={self.shutdown_watch_termination_grace_period}")
        return argv + self.extra_args.get("kube-apiserver", [])

    def _controller_manager_argv(self) -> list[str]:
        assert self.pki is not None
        self._write_kubeconfigs()
        return [
            *self._component_argv("controller-manager", "kube-controller-manager"),
            "--use-service-account-credentials=true",
            f"--root-ca-file={self.pki.ca_cert}",
            f"--service-account-private-key-file={self.pki.sa_key}",
            f"--cluster-signing-cert-file={self.pki.ca_cert}", f"--cluster-signing-key-file={self.pki.ca_key}",
            f"--service-cluster-ip-range={self.service_cluster_ip_range}",
            f"--node-monitor-period={_duration(self.node_monitor_period)}",
            f"--node-monitor-grace-period={_duration(self.node_monitor_grace_period)}",
            f"--controllers={','.join(self.controllers)}",
            *self.extra_args.get("kube-controller-manager", []),
        ]

    def _scheduler_argv(self) -> list[str]:
        return [*self._component_argv("scheduler", "kube-scheduler"), *self.extra_args.get("kube-scheduler", [])]

    def _component_argv(self, name: str, identity: str) -> list[str]:
        """The flags the controller-manager and the scheduler share: their kubeconfig for the API and for
        authenticating and authorizing their own health endpoint, on a port of their own."""
        (port,) = _free_ports(1)
        self.ports[name] = port
        kubeconfig = self.kubeconfig(identity)
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
            # No front proxy here: the request-header CA they would look up does not exist.
            "--authentication-skip-lookup=true",
            "--leader-elect=false", f"--bind-address={HOST}", f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'pki' / f'{name}-generated'}",
        ]

    # ---- readiness and HTTP -----------------------------------------------------------------------

    def _etcd_ready(self) -> bool:
        with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as response:
            return json.loads(response.read()).get("health") == "true"

    def _apiserver_ready(self) -> bool:
        status, body = self.request("GET", "/readyz")
        return status == 200 and body.strip() == b"ok"

    def _controller_manager_ready(self) -> bool:
        # /healthz answers ok while the controllers are still being built (one ServiceAccount and token
        # each, some seconds); each controller's check is registered once all are built, and an API
        # server lost before that makes the controller-manager exit. Ready = those checks are there.
        status, body = self._component_get("controller-manager", "/healthz?verbose")
        return status == 200 and "[+]serviceaccount-token-controller ok" in body.splitlines()

    def _scheduler_ready(self) -> bool:
        status, body = self._component_get("scheduler", "/readyz")
        return status == 200 and body.strip() == "ok"

    def _component_get(self, component: str, path: str) -> tuple[int, str]:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE   # their serving certificates are self-signed
        url = f"https://{HOST}:{self.ports[component]}{path}"
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status, response.read().decode(errors="replace")

    def request(self, method: str, path: str, body: dict | None = None, *, identity: str = "admin",
                timeout: float = 10.0) -> tuple[int, bytes]:
        """One HTTPS call to kube-apiserver as `identity` (verifying the CA): (status, body)."""
        assert self.pki is not None, "not started"
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        connection = http.client.HTTPSConnection(HOST, self.ports["apiserver"], timeout=timeout, context=context)
        try:
            headers = {"Authorization": f"Bearer {self.identities[identity].token}", "Accept": "application/json"}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def serviceaccount_token(self, namespace: str, name: str, expiration_seconds: int = 86400) -> str:
        """A token of ServiceAccount namespace/name from its TokenRequest API (as admin)."""
        status, body = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": expiration_seconds}})
        if status != 201:
            raise ControlPlaneError(f"TokenRequest for {namespace}/{name} answered {status}: {body[:300]!r}")
        return json.loads(body)["status"]["token"]

    def version(self) -> dict:
        status, body = self.request("GET", "/version")
        if status != 200:
            raise ControlPlaneError(f"/version answered {status}: {body[:200]!r}")
        return json.loads(body)

    # ---- etcd: revision and compaction (the v3 JSON gateway on the client port) --------------------

    def _etcd_call(self, path: str, payload: dict) -> dict:
        request = urllib.request.Request(f"{self.etcd_url}{path}", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            raise ControlPlaneError(f"etcd {path}: HTTP {error.code}: {error.read()[:300]!r}") from error

    def etcd_revision(self) -> int:
        """etcd's current revision (what resourceVersions count)."""
        answer = self._etcd_call("/v3/kv/range", {"key": _b64(COMPACT_REV_KEY)})
        return int(answer["header"]["revision"])

    def compact(self, revision: int | None = None) -> int:
        """Compact etcd at `revision` (default: the current one) the way kube-apiserver's compactor does:
        record it under compact_rev_key (compare-and-swap on that key's version), then compact
        (physical). Older resourceVersions are then gone from etcd: a watch or an exact list that etcd
        serves answers 410 Gone. Returns the revision compacted."""
        current = self._etcd_call("/v3/kv/range", {"key": _b64(COMPACT_REV_KEY)})
        revision = int(current["header"]["revision"]) if revision is None else revision
        kvs = current.get("kvs") or []
        version = int(kvs[0].get("version", 0)) if kvs else 0
        self._etcd_call("/v3/kv/txn", {
            "compare": [{"key": _b64(COMPACT_REV_KEY), "target": "VERSION", "result": "EQUAL",
                         "version": str(version)}],
            "success": [{"request_put": {"key": _b64(COMPACT_REV_KEY), "value": _b64(str(revision).encode())}}],
        })
        self._etcd_call("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _duration(seconds: float) -> str:
    """A Go duration: 20.0 -> '20s', 0.5 -> '500ms'."""
    millis = round(seconds * 1000)
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simcloud.real_control_plane", description=(
        "Start the real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, "
        "kube-scheduler) in WORKDIR, print its kubeconfigs, and run until interrupted (Ctrl-C / SIGTERM)."))
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--binary", help=f"the controlplane binary (default: ${BINARY_ENV}, then "
                                         f"{BINARY_PATH_FILE.relative_to(REPO_ROOT)} from `make controlplane`)")
    parser.add_argument("--node", action="append", default=[], metavar="NAME",
                        help="a kubelet token and kubeconfig for node NAME (repeatable)")
    parser.add_argument("--user", action="append", default=[], metavar="NAME",
                        help="a plain user's token and kubeconfig (repeatable; RBAC applies)")
    parser.add_argument("--node-monitor-grace-period", type=float, default=20.0, metavar="SECONDS")
    parser.add_argument("--node-monitor-period", type=float, default=2.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    try:
        plane = RealControlPlane(args.workdir, args.binary, node_monitor_period=args.node_monitor_period,
                                 node_monitor_grace_period=args.node_monitor_grace_period)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for node in args.node:
        plane.add_node_token(node)
    for user in args.user:
        plane.add_user(user)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    started = time.monotonic()
    with plane:
        print(f"kubeconfig: {plane.admin_kubeconfig}", flush=True)
        for name, identity in plane.identities.items():
            if name != "admin":
                print(f"kubeconfig[{name}]: {identity.kubeconfig}", flush=True)
        print(f"server: {plane.server_url}  etcd: {plane.etcd_url}  logs: {plane.log_dir}", flush=True)
        print(f"ready in {time.monotonic() - started:.1f}s; "
              f"export KUBECONFIG={plane.admin_kubeconfig}; Ctrl-C stops it", flush=True)
        while not stop.wait(1.0):
            pass
        print("stopping...", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The files a simcloud workdir holds for an identity: a kubeconfig and the Airflow connections.

One writer for the admin files the server writes at start and for the ServiceAccount
files a test asks for (`python -m simcloud token ... --kubeconfig/--connections`), so
both have the same shape: a kubeconfig with one bearer-token user, and connections.json
(`dag.test(conn_file_path=...)` format) whose `kubernetes_default` points at it.
"""
from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import yaml


def kubeconfig_text(server_url: str, user: str, token: str, namespace: str = "default",
                    ca_pem: bytes | None = None) -> str:
    """An HTTPS server needs `ca_pem` (its CA); kubectl sends the token only over TLS."""
    cluster: dict = {"server": server_url}
    if ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "simcloud", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "simcloud", "context": {"cluster": "simcloud", "user": user, "namespace": namespace}}],
        "current-context": "simcloud",
    }, sort_keys=False)


def kubernetes_connection(kubeconfig: Path, namespace: str = "default") -> dict:
    return {"conn_type": "kubernetes", "extra": {"kube_config_path": str(Path(kubeconfig).resolve()),
                                                 "namespace": namespace}}


def token_of(kubeconfig: Path) -> str:
    """The bearer token of a kubeconfig's first user (the admin token, for the workdir's own)."""
    return yaml.safe_load(Path(kubeconfig).read_text())["users"][0]["user"]["token"]


def write_file(path: Path, text: str, private: bool = False) -> None:
    """Write atomically, readable only by the owner when it holds a secret."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write_identity(workdir: Path, user: str, token: str, kubeconfig: Path, connections: Path | None = None,
                   namespace: str = "default") -> None:
    """A kubeconfig for `user` (and optionally a connections.json using it, ECS connection copied)."""
    workdir = Path(workdir)
    cluster = yaml.safe_load((workdir / "kubeconfig").read_text())["clusters"][0]["cluster"]
    ca = cluster.get("certificate-authority-data")
    write_file(kubeconfig, kubeconfig_text(cluster["server"], user, token, namespace,
                                           base64.b64decode(ca) if ca else None), private=True)
    if connections is not None:
        conns = json.loads((workdir / "connections.json").read_text())
        conns["kubernetes_default"] = kubernetes_connection(kubeconfig, namespace)
        write_file(connections, json.dumps(conns, indent=2), private=True)

"""Shared by the end-to-end and distributed tests: the job they trigger and how they read
the reservation ledger afterwards."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from gpuboot.core.model import Reservation
from gpuboot.lifecycle.ledger import CONFIGMAP, DATA_KEY


def two_gpu_training_job(tag: str) -> dict:
    """A 2-GPU job whose lines, prefixed with `tag`, prove the pod's log reached the launch task's log."""
    train = ("import time\n"
             "for epoch in range(1, 4):\n"
             f"    print(f'{tag}-epoch {{epoch}}/3', flush=True)\n"
             "    time.sleep(0.2)\n"  # sleep-ok: the pod's own workload, not a wait
             f"print('{tag}-training-done', flush=True)\n")
    return {"name": f"{tag}-train", "image": "python:3.11-slim", "command": ["python", "-c", train],
            "gpus": 2, "cpu": "2", "memory": "8Gi", "settle_seconds": 1,
            "boot_timeout_seconds": 120, "queue_timeout_seconds": 60}


RENDEZVOUS = Path(__file__).resolve().parents[1] / "scripts" / "gang_rendezvous.py"


def gang_job(tag: str, replicas: int = 2, gpus: int = 1, **env: str) -> dict:
    """A gang whose ranks rendezvous at MASTER_ADDR:MASTER_PORT (scripts/gang_rendezvous.py);
    `env` adds its RENDEZVOUS_* switches (e.g. RENDEZVOUS_FAIL_RANK)."""
    return {"name": f"{tag}-gang", "image": "python:3.11-slim", "command": ["python", "-c", RENDEZVOUS.read_text()],
            "env": {"RENDEZVOUS_TAG": tag, **env}, "replicas": replicas, "gpus": gpus, "cpu": "1",
            "memory": "1Gi", "settle_seconds": 1, "boot_timeout_seconds": 120, "queue_timeout_seconds": 60}


def live_reservations(cloud) -> list[Reservation]:
    """The unexpired reservations in the cloud's ledger ConfigMap (none when it does not exist)."""
    from kubernetes.client.exceptions import ApiException

    try:
        cm = cloud.core_v1().read_namespaced_config_map(CONFIGMAP, "default")
    except ApiException as e:
        if e.status == 404:
            return []
        raise
    entries = [Reservation.from_json(d) for d in json.loads((cm.data or {}).get(DATA_KEY) or "[]")]
    return [r for r in entries if r.expires_at > time.time()]


def run_threads(threads: list[threading.Thread], timeout: float) -> None:
    """Start every actor at once, then wait for all of them; one still running at the bound fails the test."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not [t.name for t in threads if t.is_alive()], f"actors still running after {timeout}s"

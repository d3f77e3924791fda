"""Shared by the end-to-end and distributed tests: the job they trigger and how they read
the reservation ledger afterwards."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from gpuboot.core.model import Reservation
from gpuboot.lifecycle.ledger import CONFIGMAP, DATA_KEY, LABEL_LEDGER, SHARDS, ReservationLedger


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
    """The unexpired reservations in the cloud's ledger ConfigMaps, its shards (none when there is none)."""
    cms = cloud.core_v1().list_namespaced_config_map("default", label_selector=f"{LABEL_LEDGER}={CONFIGMAP}").items
    entries = [Reservation.from_json(d) for cm in cms for d in json.loads((cm.data or {}).get(DATA_KEY) or "[]")]
    return [r for r in entries if r.expires_at > time.time()]


def run_threads(threads: list[threading.Thread], timeout: float) -> None:
    """Start every actor at once, then wait for all of them; one still running at the bound fails the test."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not [t.name for t in threads if t.is_alive()], f"actors still running after {timeout}s"


def format1_add(kube, reservation: Reservation, namespace: str = "default") -> bool:
    """Book as a format-1 gpuboot (one ConfigMap for everything) did: read the ledger, parsing its
    meta.json `seq` as format 1 did, add the reservation, compare-and-swap. True when written,
    False when the write met another; ValueError (format 1's own failure, naming the upgrade)
    once the ledger is format 2 or migrating."""
    from gpuboot.hooks.kube import Conflict

    cm = kube.read_configmap(namespace, CONFIGMAP)
    data = dict((cm or {}).get("data") or {})
    meta = json.loads(data.get("meta.json") or "{}")
    seq = int(meta.get("seq", 0))
    entries = [*json.loads(data.get(DATA_KEY) or "[]"), reservation.to_json()]
    data.update({DATA_KEY: json.dumps(entries, sort_keys=True),
                 "meta.json": json.dumps({"seq": seq + 1, "tombstones_from": meta.get("tombstones_from", 0)})})
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIGMAP, "namespace": namespace},
            "data": data}
    try:
        if cm is None:
            kube.create_configmap(namespace, body)
        else:
            body["metadata"]["resourceVersion"] = cm["metadata"]["resourceVersion"]
            kube.replace_configmap(namespace, body)
        return True
    except Conflict:
        return False


def nodes_in_distinct_shards(count: int, *, ordered: bool = True) -> list[str]:
    """`count` node names, each in a shard of its own (in shard-name order when `ordered`)."""
    ledger, seen, out = ReservationLedger(None), set(), []
    i = 0
    while len(out) < count:
        name, i = f"node-{i}", i + 1
        shard = ledger.object_of_node(name, SHARDS)
        if shard not in seen:
            seen.add(shard)
            out.append(name)
    return sorted(out, key=lambda n: ledger.object_of_node(n, SHARDS)) if ordered else out


def same_shard_as(node: str) -> str:
    ledger = ReservationLedger(None)
    return next(f"other-{i}" for i in range(10_000)
                if ledger.object_of_node(f"other-{i}", SHARDS) == ledger.object_of_node(node, SHARDS))

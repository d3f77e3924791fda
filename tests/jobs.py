"""The 2-GPU training job the end-to-end and distributed tests trigger: its lines, prefixed
with `tag`, prove the pod's log reached the launch task's log."""
from __future__ import annotations


def two_gpu_training_job(tag: str) -> dict:
    train = ("import time\n"
             "for epoch in range(1, 4):\n"
             f"    print(f'{tag}-epoch {{epoch}}/3', flush=True)\n"
             "    time.sleep(0.2)\n"  # sleep-ok: the pod's own workload, not a wait
             f"print('{tag}-training-done', flush=True)\n")
    return {"name": f"{tag}-train", "image": "python:3.11-slim", "command": ["python", "-c", train],
            "gpus": 2, "cpu": "2", "memory": "8Gi", "settle_seconds": 1,
            "boot_timeout_seconds": 120, "queue_timeout_seconds": 60}

"""An in-process ECS endpoint for the ECS conformance tests.

The aiohttp app runs in its own event loop on a background thread, bound to
127.0.0.1 on a free port, so the (synchronous) SDKs can call it from the test
thread. `on_loop` runs a function inside that loop, the only place the cloud's
state may be touched.
"""
from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
from aiohttp import web

from simcloud.config import Faults, Timings
from simcloud.ecs.api import make_ecs_app
from simcloud.ecs.model import EcsCloud, Instance, InstanceType
from simcloud.harness import wait_until  # noqa: F401  (re-exported for the ECS tests)

T = TypeVar("T")

REGION = "cn-hangzhou"
ACCESS_KEY_ID = "LTAI-simcloud-test"
ACCESS_KEY_SECRET = "simcloud-test-secret"

GPU_TYPE = InstanceType("ecs.gn6i-c4g1.xlarge", cpu=4, memory_gib=15.0, gpu=1, gpu_spec="NVIDIA T4",
                        price_per_hour=1.2)
BIG_GPU_TYPE = InstanceType("ecs.gn7i-c32g1.8xlarge", cpu=32, memory_gib=188.0, gpu=1, gpu_spec="NVIDIA A10")  # unpriced
CPU_TYPE = InstanceType("ecs.g7.xlarge", cpu=4, memory_gib=16.0, price_per_hour=0.2)


@dataclass
class EcsServer:
    cloud: EcsCloud
    faults: Faults
    port: int
    loop: asyncio.AbstractEventLoop
    transitions: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def on_loop(self, fn: Callable[[], T]) -> T:
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=10)

    def status(self, instance_id: str) -> str:
        return self.on_loop(lambda: self.cloud.instances[instance_id].status)


def build_fleet(cloud: EcsCloud) -> None:
    """Three stopped GPU nodes in two zones, two running ones, and a running CPU node."""
    fleet = [
        ("i-gpu-a", GPU_TYPE, "cn-hangzhou-h", "Stopped", "StopCharging"),
        ("i-gpu-b", GPU_TYPE, "cn-hangzhou-i", "Stopped", "StopCharging"),
        ("i-gpu-c", BIG_GPU_TYPE, "cn-hangzhou-h", "Stopped", "KeepCharging"),
        ("i-gpu-r1", GPU_TYPE, "cn-hangzhou-h", "Running", "Not-applicable"),
        ("i-gpu-r2", BIG_GPU_TYPE, "cn-hangzhou-i", "Running", "Not-applicable"),
        ("i-cpu-1", CPU_TYPE, "cn-hangzhou-h", "Running", "Not-applicable"),
    ]
    for n, (iid, itype, zone, status, mode) in enumerate(fleet, start=1):
        cloud.add_instance(Instance(
            instance_id=iid, instance_name=f"node-{iid[2:]}", hostname=f"node-{iid[2:]}", instance_type=itype,
            zone_id=zone, region_id=REGION, status=status, stopped_mode=mode,
            tags={"pool": "gpu" if itype.gpu else "cpu", "team": "ml"}, private_ip=f"10.0.0.{n}",
            start_time="2026-01-01T00:00Z" if status == "Running" else None))


@pytest.fixture
def ecs_server():
    """A fresh ECS endpoint with short timings and the fleet above."""
    timings = Timings(start_seconds=0.3, stop_seconds=0.3)
    faults = Faults()
    cloud = EcsCloud(REGION, timings, faults)
    build_fleet(cloud)
    loop = asyncio.new_event_loop()
    state: dict = {}

    async def serve():
        runner = web.AppRunner(make_ecs_app(cloud, {ACCESS_KEY_ID: ACCESS_KEY_SECRET}, faults, rng=random.Random(7)))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["runner"] = runner
        state["port"] = site._server.sockets[0].getsockname()[1]

    thread = threading.Thread(target=loop.run_forever, name="ecs-server", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=10)
    server = EcsServer(cloud, faults, state["port"], loop)
    server.on_loop(lambda: cloud.add_listener(lambda i, old, new: server.transitions.append((i.instance_id, old, new))))
    try:
        yield server
    finally:
        server.on_loop(cloud.close)
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

"""Driving and observing one node's power through real clients: the ECS SDK and kubernetes_asyncio watches."""
from __future__ import annotations

import asyncio
import time

from alibabacloud_ecs20140526 import models as ecs_models
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio import config as aconfig
from kubernetes_asyncio import watch as awatch


def start_instance(cloud, node: str) -> None:
    cloud.ecs_client().start_instances(ecs_models.StartInstancesRequest(
        region_id=cloud.region, instance_id=[cloud.instance_id(node)]))


def stop_instance(cloud, node: str) -> None:
    cloud.ecs_client().stop_instances(ecs_models.StopInstancesRequest(
        region_id=cloud.region, instance_id=[cloud.instance_id(node)], stopped_mode="StopCharging"))


def snapshot(node) -> dict:
    ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
    return {"rv": int(node.metadata.resource_version), "ready": ready.status if ready else None,
            "gpu": (node.status.allocatable or {}).get("nvidia.com/gpu"),
            "boot": node.status.node_info.boot_id,
            "taints": sorted(f"{t.key}:{t.effect}" for t in node.spec.taints or [])}


async def watch_node(kubeconfig, name: str, until, timeout: float, on_ready=None) -> list[dict]:
    """Every state of Node `name` seen by a kubernetes_asyncio watch, until `until(states)` or `timeout`."""
    api = await aconfig.new_client_from_config(config_file=str(kubeconfig))
    states: list[dict] = []
    try:
        v1 = aclient.CoreV1Api(api)
        current = await v1.read_node(name)
        states.append(snapshot(current))
        if on_ready is not None:
            await asyncio.get_running_loop().run_in_executor(None, on_ready)
        w = awatch.Watch()
        deadline = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                async for event in w.stream(v1.list_node, field_selector=f"metadata.name={name}",
                                            resource_version=current.metadata.resource_version,
                                            timeout_seconds=max(1, int(timeout) + 1)):
                    states.append(snapshot(event["object"]))
                    if until(states) or time.monotonic() > deadline:
                        break
        except TimeoutError:
            pass
        finally:
            w.stop()
    finally:
        await api.close()
    return states


def instance_status(cloud, node: str) -> str:
    iid = cloud.instance_id(node)
    return next(i["status"] for i in cloud.state()["instances"] if i["instance_id"] == iid)

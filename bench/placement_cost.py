"""Placement cost: reading the cluster (API) vs building the inventory and placing (pure), 1k and 10k nodes.

The pure parts are timed twice, best of N: wall clock and this process's CPU time (the figure to
read on a shared machine, where other work inflates the wall clock many times over); "first"
is one placement on views just built, as a place step makes it.

The fleet runs in simcloud with 10 placeholder pods per running node; the API
part is what `gpuboot.lifecycle.booking.survey` does (list Nodes and active Pods
through the provider's hook, DescribeInstances in batches of 100, instance types),
the pure part is `build_inventory` and `place` on those very objects.
"""
from __future__ import annotations

import time
from pathlib import Path

from gpuboot.core.inventory import build_inventory, parse_provider_id
from gpuboot.core.model import NodeState, Unavailable
from gpuboot.core.placement import JobRequest, TaskRequest, place
from gpuboot.core.resources import Resources

from .common import best_of, growth_exponent, local_cloud, timed

PODS_PER_NODE = 10
GANG = 64
# The kubelets and the node controller slowed down to what the local cloud can serve on the bench's two cores
# next to the jobs: simcloud's test fleets run them hundreds of times faster than real ones (Leases renewed
# every 0.25 s, a node-health pass over every node and pod every 0.1 s), which on 10,000 nodes took all of the
# local cloud's CPU. The node controller at its real period; the Leases every 60 s (real kubelets: 10 s, which
# on 10,000 nodes is 1,000 writes a second, a core of the local cloud's CPU) with the grace period 4 times
# that; status reports hourly. None of them is what placement reads.
KUBELET_TIMINGS = {"heartbeat_seconds": 3600, "lease_renew_seconds": 60, "node_monitor_period_seconds": 5,
                   "node_monitor_grace_seconds": 240}
# Mixed GPU fleet: 1/4 of each type; 80 % of the nodes running (with pods), 20 % stopped.
TYPES = ["ecs.gn6i-c4g1.xlarge", "ecs.gn6i-c24g1.12xlarge", "ecs.gn7i-c32g1.16xlarge", "ecs.gn6v-c8g1.8xlarge"]


def fleet(size: int) -> dict:
    from simcloud.harness import small_fleet

    nodes = []
    for i, itype in enumerate(TYPES):
        share = size // len(TYPES) + (1 if i < size % len(TYPES) else 0)
        running = share * 4 // 5
        nodes.append({"name": f"run-{i}", "instance_type": itype, "status": "Running", "count": running})
        nodes.append({"name": f"stop-{i}", "instance_type": itype, "status": "Stopped", "count": share - running})
    return small_fleet(nodes, timings=KUBELET_TIMINGS, pods_per_node=PODS_PER_NODE)


def jobs() -> dict[str, JobRequest]:
    one = Resources.parse({"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": 1})
    return {
        "1 task": JobRequest("bench-one", (TaskRequest("t", one),), 1),
        f"{GANG}-task gang": JobRequest("bench-gang", tuple(TaskRequest(f"t-{i}", one) for i in range(GANG)), GANG),
    }


def measure(size: int, workdir: Path, repeat: int) -> dict:
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.hooks.kube import KubeClient

    with local_cloud(fleet(size), workdir / f"cloud-{size}", ready_timeout=600):
        kube, ecs = KubeClient(), EcsHook()
        kube.core, ecs.get_conn()   # client set-up is not part of a read
        t_nodes, nodes = timed(kube.list_nodes)
        t_pods, pods = timed(kube.list_active_pods)
        ids = sorted({p[1] for n in nodes if (p := parse_provider_id((n.get("spec") or {}).get("providerID")))})
        t_instances, instances = timed(lambda: ecs.describe_instances(ids))
        t_types, types = timed(lambda: ecs.describe_instance_types({i["InstanceType"] for i in instances}))
    now = time.time()
    build = lambda: build_inventory(nodes, pods, instances, types, [], now)  # noqa: E731
    t_build, views = best_of(build, repeat)
    row = {"nodes": len(nodes), "pods": len(pods), "instances": len(instances),
           "api_list_nodes_s": t_nodes, "api_list_pods_s": t_pods, "api_describe_instances_s": t_instances,
           "api_instance_types_s": t_types, "api_total_s": t_nodes + t_pods + t_instances + t_types,
           "build_inventory_s": t_build, "build_inventory_cpu_s": best_of(build, repeat, time.process_time)[0]}
    for label, job in jobs().items():
        t_place, plan = best_of(lambda: place(job, views), repeat)
        row[f"place {label}_s"] = t_place
        row[f"place {label}_cpu_s"] = best_of(lambda: place(job, views), repeat, time.process_time)[0]
        row[f"place {label} first_cpu_s"] = min(_first_place(job, build) for _ in range(min(repeat, 3)))
        row[f"place {label}_outcome"] = plan.outcome.value
    # the jobs that do not fit: the fleet full (a pod on every running node's free GPUs, the stopped types
    # out of stock) makes them BUSY, and a task no node can hold (8 GPUs) NEVER
    full = build_inventory(nodes, pods + [_gpu_pod(v.name, v.free.gpus) for v in views if v.state is NodeState.READY],
                           instances, types, [], now)
    out_of_stock = [Unavailable("NoStock", now + 3600, instance_type=t, zone=z)
                    for t, z in sorted({(v.instance_type, v.zone) for v in full if v.state is NodeState.STOPPED})]
    never = JobRequest("bench-never", (TaskRequest("t", Resources.parse({"cpu": "4", "nvidia.com/gpu": 8})),), 1)
    for label, job, fleet_views, unavailable in [*((f"busy {k}", j, full, out_of_stock) for k, j in jobs().items()),
                                                 ("never 1 task", never, views, [])]:
        t_cpu, plan = best_of(lambda: place(job, fleet_views, unavailable), repeat, time.process_time)
        row[f"place {label}_cpu_s"], row[f"place {label}_outcome"] = t_cpu, plan.outcome.value
    return row


def _gpu_pod(node: str, gpus: int) -> dict:
    requests = {"nvidia.com/gpu": str(gpus)}
    return {"metadata": {"name": f"gpu-{node}", "namespace": "bench", "labels": {}},
            "spec": {"nodeName": node, "containers": [{"name": "main", "resources": {"requests": requests}}]},
            "status": {"phase": "Running"}}


def _first_place(job: JobRequest, build) -> float:
    """CPU seconds of a place step's one placement: on views just built, nothing cached on them yet."""
    views = build()
    began = time.process_time()
    place(job, views)
    return time.process_time() - began


def run(workdir: Path, quick: bool = False) -> dict:
    sizes = (100, 1000) if quick else (1000, 10000)
    rows = [measure(size, workdir, repeat=3 if quick else 5) for size in sizes]
    small, large = rows
    keys = [k for k in small if k.endswith("_s")]
    growth = {k.removesuffix("_s"): round(growth_exponent(small["nodes"], small[k], large["nodes"], large[k]), 2)
              for k in keys if small[k] > 0 and large[k] > 0}
    return {"pods_per_node": PODS_PER_NODE, "gang_tasks": GANG, "rows": rows,
            "growth_exponent": growth,
            "note": "growth exponent k in time ~ nodes^k between the two fleet sizes: 1.0 = linear"}

"""Knobs shared by every part of the local cloud: timings and injectable faults.

One mutable `Faults` object lives per server; the fleet file sets its initial
values and the admin endpoint (`/_simcloud/faults`) changes it at run time, so
every component reads it at the moment it acts, never caches it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class Timings:
    """Seconds each emulated step takes (fleet file key `timings`).

    The defaults of the cluster's own clocks are Kubernetes 1.32's, so a fleet that sets
    nothing is as slow as a real cluster; `simcloud.harness.small_fleet` and the demo fleet
    shorten them.
    """

    start_seconds: float = 2.0          # ECS: Starting -> Running
    stop_seconds: float = 2.0           # ECS: Stopping -> Stopped
    boot_seconds: float = 3.0           # Running -> kubelet posts Ready with a new bootID (GPU still stale)
    stale_seconds: float = 1.0          # Ready with the stale GPU count -> kubelet zeroes extended resources
    device_plugin_seconds: float = 2.0  # zeroed -> NVIDIA device plugin registers the real count
    pod_start_seconds: float = 0.5      # bound pod -> container running
    # kubelet: the Node status is written on every change, and rewritten (fresh lastHeartbeatTime)
    # when nothing changed for this long (nodeStatusReportFrequency, 5 min)
    heartbeat_seconds: float = 300.0
    lease_renew_seconds: float = 10.0   # the kubelet renews its node Lease (nodeLeaseDurationSeconds 40 / 4)
    shutdown_grace_seconds: float = 0.0  # kubelet shutdownGracePeriod: > 0 kills pods (Failed) on a stop; 0 = off
    # node-lifecycle controller (kube-controller-manager)
    node_monitor_period_seconds: float = 5.0   # --node-monitor-period: how often it looks at every node
    node_monitor_grace_seconds: float = 50.0   # --node-monitor-grace-period (1.32: 50 s): no status or Lease
    #                                            renewal this long -> conditions Unknown, unreachable taints
    # kube-apiserver
    default_toleration_seconds: float = 300.0  # DefaultTolerationSeconds: not-ready/unreachable NoExecute
    #                                            tolerations given to pods that have none (eviction delay)
    watch_history_seconds: float = 300.0       # versions older than this are compacted: a watch from one is 410
    watch_bookmark_seconds: float = 60.0       # BOOKMARK period of watches that allow them

    def to_dict(self) -> dict:
        return asdict(self)


BOOT_ORDERS = ("stale-first", "kubelet")


@dataclass
class Faults:
    """Faults on demand. Rates are probabilities in [0, 1] per API call."""

    ecs_throttle_rate: float = 0.0        # answer Throttling (HTTP 400 Throttling.User)
    ecs_internal_error_rate: float = 0.0  # answer InternalError (HTTP 500)
    ecs_unavailable_rate: float = 0.0     # answer ServiceUnavailable (HTTP 503)
    no_stock: list[str] = field(default_factory=list)   # "instance_type" or "instance_type@zone": start -> OperationDenied.NoStock
    never_ready: list[str] = field(default_factory=list)          # instance ids or node names whose kubelet never posts Ready
    device_plugin_never: list[str] = field(default_factory=list)  # instance ids or node names whose GPUs never register
    # Per node (name or instance id, "*" for every node): extra seconds before the kubelet zeroes the
    # extended resources after a boot, and before the device plugin then registers the real count.
    gpu_reset_delay_seconds: dict[str, float] = field(default_factory=dict)
    gpu_register_delay_seconds: dict[str, float] = field(default_factory=dict)
    # Per extended resource name ("*": every one): extra seconds before its device plugin registers.
    resource_register_delay_seconds: dict[str, float] = field(default_factory=dict)
    # Per node (name, instance id or "*"): the order a boot's writes come in. "stale-first" (default,
    # the order reported from real clusters): new bootID + Ready=True with the stale count, then 0,
    # then the real count. "kubelet": as a restarted kubelet writes them: the registration patch zeroing the
    # extended resources (old bootID), the new bootID with Ready=False, Ready=True, the real count.
    boot_order: dict[str, str] = field(default_factory=dict)
    # Per action ("*": every action without its own entry): calls allowed per quota window; more are
    # refused with Throttling.User until the window ends (simcloud.ecs.quota). Empty: no limit.
    ecs_api_quota: dict[str, float] = field(default_factory=dict)
    ecs_api_quota_window_seconds: float = 60.0
    k8s_latency_ms: int = 0               # added to every Kubernetes API request
    k8s_conflict_burst: int = 0           # the next N ConfigMap writes are answered 409 Conflict
    # A followed pod log stream is ended (cleanly, mid-run) this long after it opened; 0: never. A real
    # one ends so at an API server restart, a load balancer's idle timeout or the kubelet's
    # streamingConnectionIdleTimeout (4 h): a follower must open it again while the pod runs on.
    log_stream_cut_seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def update(self, changes: dict) -> None:
        """Apply a partial update; unknown keys are an error that names the key."""
        known = {f.name: f for f in fields(self)}
        for key, raw in changes.items():
            if key not in known:
                raise KeyError(f"unknown fault {key!r}; known: {', '.join(sorted(known))}")
            current, value = getattr(self, key), raw
            if isinstance(current, list):
                value = list(raw)
            elif isinstance(current, dict):
                value = self._per_node(key, raw)
            elif isinstance(current, float):
                value = float(raw)
                if not 0.0 <= value <= 1.0 and key.endswith("_rate"):
                    raise ValueError(f"fault {key} must be in [0, 1], got {value}")
            elif isinstance(current, int):
                value = int(raw)
            setattr(self, key, value)

    @staticmethod
    def _per_node(key: str, value) -> dict:
        if not isinstance(value, dict):
            raise ValueError(f"fault {key} must be an object of name (node, instance id or action; \"*\") -> value")
        if key == "boot_order":
            bad = {k: v for k, v in value.items() if v not in BOOT_ORDERS}
            if bad:
                raise ValueError(f"fault boot_order: {bad} not one of {', '.join(BOOT_ORDERS)}")
            return {str(k): str(v) for k, v in value.items()}
        unit = "calls per window" if key == "ecs_api_quota" else "seconds"
        try:
            out = {str(k): float(v) for k, v in value.items()}
        except (TypeError, ValueError):
            raise ValueError(f"fault {key}: values must be {unit}, got {value}") from None
        if any(v < 0 for v in out.values()):
            raise ValueError(f"fault {key}: {unit} must be >= 0, got {value}")
        return out

    def for_node(self, key: str, default, *names: str):
        """The per-node value of dict fault `key` for the first of `names` listed, else "*", else default."""
        listed = getattr(self, key)
        for name in names:
            if name and name in listed:
                return listed[name]
        return listed.get("*", default)

    def matches(self, key_list: str, *names: str) -> bool:
        """True when any of `names` (instance id, node name, ...) is listed in fault `key_list`."""
        listed = getattr(self, key_list)
        return any(name in listed for name in names if name)

    def no_stock_for(self, instance_type: str, zone: str) -> bool:
        return instance_type in self.no_stock or f"{instance_type}@{zone}" in self.no_stock

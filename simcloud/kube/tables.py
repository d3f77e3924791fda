"""Server-side printing: meta/v1 Table rows with the columns the real API server gives kubectl.

kubectl asks for `as=Table` and prints whatever columns come back; priority-1
columns appear only with `-o wide`. Cell rules follow kubernetes/pkg/printers/internalversion.
"""
from __future__ import annotations

from datetime import UTC, datetime

Column = tuple[str, str, str, int]   # name, type, description, priority

_AGE: Column = ("Age", "string", ("CreationTimestamp is a timestamp representing the server time when this object "
                                 "was created."), 0)
_NAME: Column = ("Name", "string", "Name must be unique within a namespace.", 0)


def human_duration(seconds: float) -> str:
    """kubectl's duration.HumanDuration ("5s", "3m20s", "2d4h", ...)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    years = hours // (24 * 365)
    if years < 8:
        return f"{years}y{(hours // 24) % 365}d"
    return f"{years}y"


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.strptime(timestamp[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    return human_duration((datetime.now(UTC) - then).total_seconds())


def _meta_age(obj: dict) -> str:
    return _age(obj["metadata"].get("creationTimestamp"))


# ---------------------------------------------------------------------------- nodes
def _node_status(node: dict) -> str:
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    states = ["Unknown" if ready is None else ("Ready" if ready.get("status") == "True" else "NotReady")]
    if (node.get("spec") or {}).get("unschedulable"):
        states.append("SchedulingDisabled")
    return ",".join(states)


def _node_roles(node: dict) -> str:
    labels = node["metadata"].get("labels") or {}
    roles = sorted({k.split("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/") and "/" in k}
                   | ({labels["kubernetes.io/role"]} if labels.get("kubernetes.io/role") else set()))
    return ",".join(r for r in roles if r) or "<none>"


def _address(node: dict, kind: str) -> str:
    for a in (node.get("status") or {}).get("addresses") or []:
        if a.get("type") == kind:
            return a.get("address", "<none>")
    return "<none>"


def _node_row(node: dict) -> list:
    info = (node.get("status") or {}).get("nodeInfo") or {}
    return [node["metadata"]["name"], _node_status(node), _node_roles(node), _meta_age(node),
            info.get("kubeletVersion", ""), _address(node, "InternalIP"), _address(node, "ExternalIP"),
            info.get("osImage") or "<unknown>", info.get("kernelVersion") or "<unknown>",
            info.get("containerRuntimeVersion") or "<unknown>"]


_NODE_COLUMNS: list[Column] = [
    _NAME, ("Status", "string", "The status of the node", 0), ("Roles", "string", "The roles of the node", 0),
    _AGE, ("Version", "string", "Kubelet Version reported by the node.", 0),
    ("Internal-IP", "string", "List of internal IPs for the node.", 1),
    ("External-IP", "string", "List of external IPs for the node.", 1),
    ("OS-Image", "string", "OS Image reported by the node from /etc/os-release (e.g. Debian GNU/Linux 7 (wheezy)).", 1),
    ("Kernel-Version", "string", "Kernel Version reported by the node from 'uname -r' (e.g. 3.16.0-0.bpo.4-amd64).", 1),
    ("Container-Runtime", "string", ("Container runtime version reported by the node through runtime remote API "
                                    "(e.g. containerd://1.4.2)."), 1),
]


# ---------------------------------------------------------------------------- pods
def pod_status_reason(pod: dict) -> str:
    """The STATUS column of `kubectl get pods` (printPod)."""
    status = pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or "Unknown"
    init_statuses = status.get("initContainerStatuses") or []
    init_count = len((pod.get("spec") or {}).get("initContainers") or [])
    initializing = False
    for i, cs in enumerate(init_statuses):
        state = cs.get("state") or {}
        term, waiting = state.get("terminated"), state.get("waiting")
        if term and term.get("exitCode", 0) == 0:
            continue
        if term:
            reason = "Init:" + (term.get("reason") or (f"Signal:{term['signal']}" if term.get("signal")
                                                        else f"ExitCode:{term.get('exitCode')}"))
        elif waiting and waiting.get("reason") and waiting["reason"] != "PodInitializing":
            reason = "Init:" + waiting["reason"]
        else:
            reason = f"Init:{i}/{init_count}"
        initializing = True
        break
    if not initializing:
        has_running = False
        for cs in reversed(status.get("containerStatuses") or []):
            state = cs.get("state") or {}
            waiting, term = state.get("waiting"), state.get("terminated")
            if waiting and waiting.get("reason"):
                reason = waiting["reason"]
            elif term and term.get("reason"):
                reason = term["reason"]
            elif term:
                reason = f"Signal:{term['signal']}" if term.get("signal") else f"ExitCode:{term.get('exitCode')}"
            elif cs.get("ready") and state.get("running") is not None:
                has_running = True
        if reason == "Completed" and has_running:
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
            reason = "Running" if ready else "NotReady"
    if pod["metadata"].get("deletionTimestamp"):
        reason = "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    return reason


def _pod_row(pod: dict) -> list:
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for cs in statuses if cs.get("ready"))
    restarts = sum(cs.get("restartCount", 0) for cs in statuses)
    gates = spec.get("readinessGates") or []
    return [pod["metadata"]["name"], f"{ready}/{len(spec.get('containers') or [])}", pod_status_reason(pod),
            restarts, _meta_age(pod), status.get("podIP") or "<none>", spec.get("nodeName") or "<none>",
            status.get("nominatedNodeName") or "<none>",
            f"{len(gates)}/{len(gates)}" if gates else "<none>"]


_POD_COLUMNS: list[Column] = [
    _NAME, ("Ready", "string", "The aggregate readiness state of this pod for accepting traffic.", 0),
    ("Status", "string", "The aggregate status of the containers in this pod.", 0),
    ("Restarts", "string", ("The number of times the containers in this pod have been restarted and when the last "
                           "container in this pod has restarted."), 0),
    _AGE, ("IP", "string", "IP address allocated to the pod. Routable at least within the cluster.", 1),
    ("Node", "string", "NodeName is a request to schedule this pod onto a specific node.", 1),
    ("Nominated Node", "string", "nominatedNodeName is set only when this pod preempts other pods on the node.", 1),
    ("Readiness Gates", "string", "If specified, all readiness gates will be evaluated for pod readiness.", 1),
]


# ---------------------------------------------------------------------------- events, configmaps, namespaces
def _event_row(event: dict) -> list:
    inv = event.get("involvedObject") or {}
    source = event.get("source") or {}
    last = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp")
    first = event.get("firstTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp")
    src = source.get("component") or event.get("reportingComponent") or ""
    if source.get("host"):
        src += ", " + source["host"]
    return [_age(last), event.get("type", ""), event.get("reason", ""),
            f"{(inv.get('kind') or '').lower()}/{inv.get('name', '')}", event.get("message", ""),
            inv.get("fieldPath", ""), src, _age(first), event.get("count", 1), event["metadata"]["name"]]


_EVENT_COLUMNS: list[Column] = [
    ("Last Seen", "string", "Time when this Event was last observed.", 0),
    ("Type", "string", "Type of this event (Normal, Warning), new types could be added in the future.", 0),
    ("Reason", "string", ("This should be a short, machine understandable string that gives the reason for the "
                         "transition into the object's current status."), 0),
    ("Object", "string", "The object that this event is about.", 0),
    ("Message", "string", "A human-readable description of the status of this operation.", 0),
    ("Subobject", "string", "The subobject this event is about (fieldPath).", 1),
    ("Source", "string", "The component reporting this event.", 1),
    ("First Seen", "string", "The time at which the event was first recorded.", 1),
    ("Count", "integer", "The number of times this event has occurred.", 1),
    ("Name", "string", "Name must be unique within a namespace.", 1),
]

_TABLES = {
    "nodes": (_NODE_COLUMNS, _node_row),
    "pods": (_POD_COLUMNS, _pod_row),
    "events": (_EVENT_COLUMNS, _event_row),
    "configmaps": ([_NAME, ("Data", "integer", "Number of data entries.", 0), _AGE],
                   lambda o: [o["metadata"]["name"], len(o.get("data") or {}) + len(o.get("binaryData") or {}),
                              _meta_age(o)]),
    "namespaces": ([_NAME, ("Status", "string", "The status of the namespace", 0), _AGE],
                   lambda o: [o["metadata"]["name"], (o.get("status") or {}).get("phase", ""), _meta_age(o)]),
    "leases": ([_NAME, ("Holder", "string", "The holder of the lease.", 0), _AGE],
               lambda o: [o["metadata"]["name"], (o.get("spec") or {}).get("holderIdentity", ""), _meta_age(o)]),
}
_DEFAULT_TABLE = ([_NAME, _AGE], lambda o: [o["metadata"]["name"], _meta_age(o)])


def _row_object(obj: dict, include_object: str, api_version: str) -> dict | None:
    if include_object == "None":
        return None
    if include_object == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": api_version, "metadata": obj["metadata"]}


def make_table(resource: str, objects: list[dict], resource_version: str, *, api_version: str = "meta.k8s.io/v1",
               include_object: str = "Metadata", with_columns: bool = True, continue_token: str | None = None) -> dict:
    """A meta/v1 (or v1beta1) Table of `objects`, rows in the given order."""
    columns, row_fn = _TABLES.get(resource, _DEFAULT_TABLE)
    meta: dict = {"resourceVersion": resource_version}
    if continue_token:
        meta["continue"] = continue_token
    table = {"kind": "Table", "apiVersion": api_version, "metadata": meta,
             "columnDefinitions": [{"name": n, "type": t, "format": "name" if n == "Name" else "",
                                    "description": d, "priority": p} for n, t, d, p in columns] if with_columns else [],
             "rows": []}
    for obj in objects:
        row: dict = {"cells": row_fn(obj)}
        ref = _row_object(obj, include_object, api_version)
        if ref is not None:
            row["object"] = ref
        table["rows"].append(row)
    return table

"""The kinds this Kubernetes API server serves: REST name, kind, group/version, scope, short names
and subresources, as discovery lists them. The store keeps one map per entry; discovery, OpenAPI,
validation and the tables read them.
"""
from __future__ import annotations

from dataclasses import dataclass

# The release whose behaviour simcloud answers with (checked against the real one: make test-real-k8s).
KUBERNETES_VERSION = "v1.37.2"


@dataclass(frozen=True)
class ResourceInfo:
    name: str                      # plural REST name
    kind: str
    namespaced: bool
    group: str = ""
    version: str = "v1"
    short_names: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()
    singular: str = ""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


def _r(name, kind, namespaced, short=(), sub=(), group=""):
    return ResourceInfo(name, kind, namespaced, group, "v1", tuple(short), tuple(sub), kind.lower())


RESOURCES: dict[str, ResourceInfo] = {r.name: r for r in (
    _r("namespaces", "Namespace", False, ["ns"], ["status"]),
    _r("nodes", "Node", False, ["no"], ["status"]),
    _r("pods", "Pod", True, ["po"], ["status", "log", "binding"]),
    _r("events", "Event", True, ["ev"]),
    _r("configmaps", "ConfigMap", True, ["cm"]),
    _r("secrets", "Secret", True),
    _r("serviceaccounts", "ServiceAccount", True, ["sa"], ["token"]),
    _r("services", "Service", True, ["svc"], ["status"]),
    _r("endpoints", "Endpoints", True, ["ep"]),
    _r("persistentvolumeclaims", "PersistentVolumeClaim", True, ["pvc"], ["status"]),
    _r("persistentvolumes", "PersistentVolume", False, ["pv"], ["status"]),
    _r("replicationcontrollers", "ReplicationController", True, ["rc"], ["status"]),
    _r("resourcequotas", "ResourceQuota", True, ["quota"], ["status"]),
    _r("limitranges", "LimitRange", True, ["limits"]),
    _r("leases", "Lease", True, group="coordination.k8s.io"),
    _r("roles", "Role", True, group="rbac.authorization.k8s.io"),
    _r("rolebindings", "RoleBinding", True, group="rbac.authorization.k8s.io"),
    _r("clusterroles", "ClusterRole", False, group="rbac.authorization.k8s.io"),
    _r("clusterrolebindings", "ClusterRoleBinding", False, group="rbac.authorization.k8s.io"),
    # create-only reviews: answered by simcloud.kube.auth, never stored
    _r("selfsubjectaccessreviews", "SelfSubjectAccessReview", False, group="authorization.k8s.io"),
    _r("selfsubjectrulesreviews", "SelfSubjectRulesReview", False, group="authorization.k8s.io"),
)}

"""The real control plane behind the interface of tests/conformance/k8s_harness.K8sServer, for API-level
tests that run on both backends (tests/integration/test_rbac.py): one plane per module, and `reset()`
between tests removes what a test made (a fresh plane per test would cost ~10 s each)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import kubernetes
import yaml
from kubernetes.client.rest import ApiException

from simcloud.harness import wait_until
from simcloud.real_control_plane import RealControlPlane, controlplane_binary


class RealK8s:
    """core_v1(token), token_for(namespace, name), add_node(name, gpu=), create_namespace(name), reset()."""

    def __init__(self, plane: RealControlPlane, manifests: tuple[Path, ...]):
        self.plane = plane
        self.manifests = [d for path in manifests for d in yaml.safe_load_all(Path(path).read_text()) if d]
        self.basic_user = self._rbac().read_cluster_role_binding("system:basic-user")
        self.basic_user.metadata.resource_version = None

    def core_v1(self, token: str | None = None) -> kubernetes.client.CoreV1Api:
        config = kubernetes.client.Configuration()
        config.host = self.plane.server_url
        config.ssl_ca_cert = str(self.plane.ca_cert)
        config.api_key = {"authorization": f"Bearer {token or self.plane.admin.token}"}
        return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))

    def _rbac(self) -> kubernetes.client.RbacAuthorizationV1Api:
        return kubernetes.client.RbacAuthorizationV1Api(self.core_v1().api_client)

    def token_for(self, namespace: str, name: str) -> str:
        with contextlib.suppress(ApiException):
            self.core_v1().create_namespaced_service_account(namespace, {"metadata": {"name": name}})
        return self.plane.serviceaccount_token(namespace, name)

    def add_node(self, name: str, *, gpu: int = 0) -> None:
        """A Node no kubelet serves, tainted so that no pod is bound to it: the real API server proxies
        pods/log to the node's kubelet, and with none there it answers 500 (simcloud's in-process logs
        answer 400 "waiting to start" for an unbound pod, as the real one does)."""
        capacity = {"cpu": "8", "memory": "32Gi", "pods": "110", **({"nvidia.com/gpu": str(gpu)} if gpu else {})}
        self.core_v1().create_node({"metadata": {"name": name},
                                    "spec": {"taints": [{"key": "simcloud.io/no-kubelet", "effect": "NoSchedule"}]},
                                    "status": {"capacity": capacity, "allocatable": capacity}})

    def create_namespace(self, name: str) -> None:
        """Create it (kept by reset: a deleted namespace stays Terminating a while) and wait for its
        `default` ServiceAccount, which ServiceAccount admission needs before any pod."""
        v1 = self.core_v1()
        with contextlib.suppress(ApiException):
            v1.create_namespace({"metadata": {"name": name}})

        def has_default_account() -> bool:
            try:
                return bool(v1.read_namespaced_service_account("default", name))
            except ApiException:
                return False

        wait_until(has_default_account, timeout=30, interval=0.1,
                   message=f"namespace {name} got no default ServiceAccount within 30 s")

    def reset(self) -> None:
        """Remove the manifests' objects (namespaces stay), every pod, ConfigMap of the tests and Node."""
        v1, rbac = self.core_v1(), self._rbac()
        deleters = {"ServiceAccount": lambda m: v1.delete_namespaced_service_account(m["name"], m["namespace"]),
                    "ClusterRole": lambda m: rbac.delete_cluster_role(m["name"]),
                    "ClusterRoleBinding": lambda m: rbac.delete_cluster_role_binding(m["name"]),
                    "Role": lambda m: rbac.delete_namespaced_role(m["name"], m["namespace"]),
                    "RoleBinding": lambda m: rbac.delete_namespaced_role_binding(m["name"], m["namespace"])}
        for doc in self.manifests:
            if doc["kind"] in deleters:
                with contextlib.suppress(ApiException):
                    deleters[doc["kind"]](doc["metadata"])
        for pod in v1.list_pod_for_all_namespaces().items:
            with contextlib.suppress(ApiException):
                v1.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        for node in v1.list_node().items:
            with contextlib.suppress(ApiException):
                v1.delete_node(node.metadata.name)
        for cm in v1.list_config_map_for_all_namespaces(label_selector="").items:
            if cm.metadata.name != "kube-root-ca.crt" and cm.metadata.namespace == "default":
                with contextlib.suppress(ApiException):
                    v1.delete_namespaced_config_map(cm.metadata.name, cm.metadata.namespace)
        with contextlib.suppress(ApiException):
            rbac.create_cluster_role_binding(self.basic_user)


@contextlib.contextmanager
def real_k8s(workdir: Path, manifests: tuple[Path, ...]):
    plane = RealControlPlane(workdir, controlplane_binary())
    with plane:
        cluster = RealK8s(plane, manifests)
        for doc in cluster.manifests:
            if doc["kind"] == "Namespace":
                cluster.create_namespace(doc["metadata"]["name"])
        cluster.create_namespace("default")
        yield cluster

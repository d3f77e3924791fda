"""The real control plane behind the interface of tests/conformance/k8s_harness.K8sServer, for API-level
tests that run on both backends (tests/integration/test_rbac.py, the conformance tests marked
both_backends): one plane per module, and `reset()` between tests removes what a test made (a fresh
plane per test would cost ~10 s each)."""
from __future__ import annotations

import contextlib
import ssl
from pathlib import Path

import kubernetes
import yaml
from kubernetes.client.rest import ApiException

from simcloud.harness import wait_until
from simcloud.real_control_plane import RealControlPlane, controlplane_binary
from simcloud.workdir import kubeconfig_text
from tests.conformance.k8s_harness import make_node


class RealK8s:
    """K8sServer's surface on the real plane: url, admin_token, kubeconfig, workdir, configure(config),
    ssl_context(), core_v1(token), token_for(namespace, name), kubeconfig_for(user, token),
    add_node(name, **make_node's options), create_namespace(name), reset()."""

    backend = "real"

    def __init__(self, plane: RealControlPlane, manifests: tuple[Path, ...]):
        self.plane = plane
        self.workdir = plane.workdir / "tests"
        self.workdir.mkdir(exist_ok=True)
        self.manifests = [d for path in manifests for d in yaml.safe_load_all(Path(path).read_text()) if d]
        self.basic_user = self._rbac().read_cluster_role_binding("system:basic-user")
        self.basic_user.metadata.resource_version = None

    @property
    def url(self) -> str:
        return self.plane.server_url

    @property
    def admin_token(self) -> str:
        return self.plane.admin.token

    @property
    def kubeconfig(self) -> Path:
        return self.plane.admin_kubeconfig

    def ssl_context(self) -> ssl.SSLContext:
        """For raw HTTP clients (urllib): the plane serves HTTPS under its own CA."""
        return ssl.create_default_context(cafile=str(self.plane.ca_cert))

    def configure(self, config, token: str | None = None):
        """Point a `kubernetes` or `kubernetes_asyncio` Configuration at the plane with a bearer token."""
        config.host = self.url
        config.ssl_ca_cert = str(self.plane.ca_cert)
        config.api_key = {"BearerToken": token or self.admin_token}
        config.api_key_prefix = {"BearerToken": "Bearer"}
        return config

    def core_v1(self, token: str | None = None) -> kubernetes.client.CoreV1Api:
        config = self.configure(kubernetes.client.Configuration(), token)
        return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))

    def kubeconfig_for(self, user: str, token: str) -> Path:
        """A kubeconfig acting as `user` with `token`."""
        path = self.workdir / f"kubeconfig-{user.replace(':', '-')}"
        path.write_text(kubeconfig_text(self.url, user, token, ca_pem=self.plane.ca_cert.read_bytes()))
        return path

    def _rbac(self) -> kubernetes.client.RbacAuthorizationV1Api:
        return kubernetes.client.RbacAuthorizationV1Api(self.core_v1().api_client)

    def token_for(self, namespace: str, name: str) -> str:
        with contextlib.suppress(ApiException):
            self.core_v1().create_namespaced_service_account(namespace, {"metadata": {"name": name}})
        return self.plane.serviceaccount_token(namespace, name)

    def add_node(self, name: str, **options) -> dict:
        """The Node make_node describes, with no kubelet behind it and so tainted that no pod is bound to
        it: the real API server proxies pods/log to the node's kubelet, and with none there it answers
        500 (simcloud's in-process logs answer 400 "waiting to start" for an unbound pod, as the real one
        does). Returns the stored Node as a dict."""
        body = make_node(name, **options)
        body["spec"]["taints"] = [*body["spec"]["taints"], {"key": "simcloud.io/no-kubelet", "effect": "NoSchedule"}]
        v1 = self.core_v1()
        return v1.api_client.sanitize_for_serialization(v1.create_node(body))

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

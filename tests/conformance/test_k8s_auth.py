"""Authentication and RBAC of the local Kubernetes API, through kubectl, `kubernetes` and `kubernetes_asyncio`.

The messages are kube-apiserver's (responsewriters.forbiddenMessage, errors.NewForbidden /
NewUnauthorized); the shipped least-privilege RBAC (`deploy/kubernetes/rbac.yaml`) is applied
with kubectl and then evaluated for the ServiceAccount it binds.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes
import kubernetes_asyncio
import pytest
from kubernetes.client.rest import ApiException

from simcloud.harness import REPO_ROOT
from simcloud.kube.resources import KUBERNETES_VERSION
from tests.conformance.k8s_harness import KUBECTL_PARAMS, K8sServer, k8s, kubectl, pod_body, wait_until  # noqa: F401
from tests.conftest import kubectl_binaries

REPO = Path(__file__).resolve().parents[2]
RBAC = REPO / "deploy/kubernetes/rbac.yaml"
NAMESPACE_YAML = REPO / "deploy/kubernetes/namespace.yaml"
SA = "system:serviceaccount:gpuboot:gpuboot"
JOBS = "gpu-jobs"      # the job namespace rbac.yaml grants pod rights in (GPUBOOT_JOB_NAMESPACES' default)


def _status(err: ApiException) -> dict:
    return json.loads(err.body)


def _raw(k8s: K8sServer, path: str, token: str | None = None) -> tuple[int, dict | str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(k8s.url + path, headers=headers), timeout=5,
                                    context=k8s.ssl_context()) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _forbidden(err: ApiException) -> str:
    assert err.status == 403, err
    body = _status(err)
    assert body["reason"] == "Forbidden" and body["kind"] == "Status" and body["code"] == 403
    return body["message"]


def _apply_shipped_rbac(binary: str, k8s: K8sServer) -> None:
    out = kubectl(binary, k8s, "apply", "-f", str(NAMESPACE_YAML), "-f", str(RBAC)).stdout
    assert "serviceaccount/gpuboot created" in out and "clusterrolebinding.rbac.authorization.k8s.io/gpuboot created" \
        in out and "rolebinding.rbac.authorization.k8s.io/gpuboot-ledger created" in out and \
        "rolebinding.rbac.authorization.k8s.io/gpuboot-jobs created" in out, out


# --------------------------------------------------------------------------- authentication
@pytest.mark.both_backends
def test_missing_or_unknown_tokens_are_401_and_public_paths_stay_open(k8s: K8sServer):
    unauthorized = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": "Unauthorized", "reason": "Unauthorized", "code": 401}
    assert _raw(k8s, "/api/v1/namespaces/default/pods") == (401, unauthorized)
    assert _raw(k8s, "/api/v1/nodes", token="not-a-token") == (401, unauthorized)
    assert _raw(k8s, "/api") == (401, unauthorized)                     # discovery needs a user
    assert _raw(k8s, "/version")[0] == 200                            # system:public-info-viewer
    with pytest.raises(ApiException) as err:
        k8s.core_v1(token="forged").list_node()
    assert err.value.status == 401 and _status(err.value) == unauthorized


@pytest.mark.both_backends
def test_an_unbound_serviceaccount_reads_discovery_and_version_but_nothing_else(k8s: K8sServer):
    token = k8s.token_for("default", "nobody")
    assert _raw(k8s, "/api", token)[0] == 200 and _raw(k8s, "/apis/rbac.authorization.k8s.io/v1", token)[0] == 200
    assert _raw(k8s, "/version", token)[1]["gitVersion"] == KUBERNETES_VERSION   # simcloud answers as that release
    status, body = _raw(k8s, "/api/v1/nodes", token)
    assert status == 403 and body["message"] == ('nodes is forbidden: User "system:serviceaccount:default:nobody" '
                                                 'cannot list resource "nodes" in API group "" at the cluster scope')
    assert body["details"] == {"kind": "nodes"}
    status, body = _raw(k8s, "/metrics", token)
    assert status == 403 and body["message"] == ('forbidden: User "system:serviceaccount:default:nobody" cannot '
                                                 'get path "/metrics"')


@pytest.mark.both_backends
def test_deleting_a_serviceaccount_revokes_its_tokens(k8s: K8sServer):
    token = k8s.token_for("default", "short-lived")
    assert _raw(k8s, "/api", token)[0] == 200
    k8s.core_v1().delete_namespaced_service_account("short-lived", "default")
    # at once on simcloud; the real server caches an authenticated token up to 10 s
    wait_until(lambda: _raw(k8s, "/api", token)[0] == 401, timeout=30, interval=0.5)
    k8s.core_v1().create_namespaced_service_account("default", {"metadata": {"name": "short-lived"}})
    assert _raw(k8s, "/api", token)[0] == 401                          # a new account is a new uid


@pytest.mark.both_backends
def test_token_request_issues_a_working_token_for_existing_serviceaccounts_only(k8s: K8sServer):
    v1 = k8s.core_v1()
    v1.create_namespaced_service_account("default", {"metadata": {"name": "builder"}})
    issued = v1.create_namespaced_service_account_token("builder", "default", {"spec": {}})
    assert issued.status.token and issued.status.expiration_timestamp
    assert _raw(k8s, "/api", issued.status.token)[0] == 200      # the API server's own audience by default
    elsewhere = v1.create_namespaced_service_account_token("builder", "default", {"spec": {"audiences": ["vault"]}})
    assert _raw(k8s, "/api", elsewhere.status.token)[0] == 401   # a token for another audience is not one for it
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_service_account_token("ghost", "default", {"spec": {}})
    assert err.value.status == 404


# --------------------------------------------------------------------------- the shipped RBAC
@pytest.mark.parametrize("binary", KUBECTL_PARAMS)
def test_shipped_rbac_applies_with_kubectl_and_grants_exactly_its_rules(binary, k8s: K8sServer):
    _apply_shipped_rbac(binary, k8s)
    k8s.add_node("gpu-a", gpu=1)
    made = kubectl(binary, k8s, "create", "token", "gpuboot", "-n", "gpuboot", check=False)
    token = made.stdout.strip() if made.returncode == 0 else k8s.token_for("gpuboot", "gpuboot")   # kubectl < 1.24
    sa = k8s.core_v1(token)
    assert [n.metadata.name for n in sa.list_node().items] == ["gpu-a"]
    assert sa.list_pod_for_all_namespaces().items == []
    sa.create_namespaced_pod(JOBS, pod_body("job-0"))
    sa.patch_namespaced_pod("job-0", JOBS, {"metadata": {"labels": {"done": "true"}}})
    assert [p.metadata.name for p in sa.list_pod_for_all_namespaces().items] == ["job-0"]   # reads everywhere
    for namespace in ("default", "kube-system"):                        # ... but writes in the job namespace only
        with pytest.raises(ApiException) as err:
            sa.create_namespaced_pod(namespace, pod_body("job-0"))
        assert _forbidden(err.value) == (f'pods is forbidden: User "{SA}" cannot create resource "pods" in API '
                                         f'group "" in the namespace "{namespace}"')
    k8s.core_v1().create_namespaced_pod("default", pod_body("other"))
    with pytest.raises(ApiException) as err:
        sa.delete_namespaced_pod("other", "default")
    assert _forbidden(err.value).startswith(f'pods "other" is forbidden: User "{SA}" cannot delete resource "pods"')
    sa.patch_node("gpu-a", {"spec": {"unschedulable": True}})
    with pytest.raises(ApiException) as err:                            # the ledger Role: one ConfigMap by name
        sa.read_namespaced_config_map("gpuboot-reservations", "default")
    assert err.value.status == 404                                      # allowed, just not there yet
    with pytest.raises(ApiException) as err:
        sa.read_namespaced_config_map("someone-elses", "default")
    assert _forbidden(err.value) == (f'configmaps "someone-elses" is forbidden: User "{SA}" cannot get resource '
                                     f'"configmaps" in API group "" in the namespace "default"')
    assert _status(err.value)["details"] == {"name": "someone-elses", "kind": "configmaps"}
    with pytest.raises(ApiException) as err:                            # the ledger Role is in `default` only
        sa.create_namespaced_config_map("kube-system", {"metadata": {"name": "gpuboot-reservations"}})
    assert _forbidden(err.value) == (f'configmaps is forbidden: User "{SA}" cannot create resource "configmaps" '
                                     f'in API group "" in the namespace "kube-system"')
    with pytest.raises(ApiException) as err:
        sa.list_namespaced_secret("default")
    assert _forbidden(err.value).startswith(f'secrets is forbidden: User "{SA}" cannot list resource "secrets"')
    with pytest.raises(ApiException) as err:                            # subresources are their own resources
        sa.patch_node_status("gpu-a", {"status": {"allocatable": {"nvidia.com/gpu": "8"}}})
    assert _forbidden(err.value) == (f'nodes "gpu-a" is forbidden: User "{SA}" cannot patch resource '
                                     f'"nodes/status" in API group "" at the cluster scope')
    with pytest.raises(ApiException) as err:
        sa.create_namespaced_pod_binding("job-0", JOBS, {"metadata": {"name": "job-0"},
                                                              "target": {"kind": "Node", "name": "gpu-a"}})
    assert "cannot create resource \"pods/binding\"" in _forbidden(err.value)
    with pytest.raises(ApiException) as err:
        sa.delete_collection_namespaced_pod(JOBS)
    assert "cannot deletecollection resource \"pods\"" in _forbidden(err.value)
    with pytest.raises(ApiException) as err:                            # no escalation through RBAC objects
        kubernetes.client.RbacAuthorizationV1Api(sa.api_client).create_cluster_role_binding({
            "metadata": {"name": "mine"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                      "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": "gpuboot", "namespace": "gpuboot"}]})
    assert "cannot create resource \"clusterrolebindings\" in API group \"rbac.authorization.k8s.io\"" in \
        _forbidden(err.value)
    sa.delete_namespaced_pod("job-0", JOBS)


@pytest.mark.parametrize("binary", KUBECTL_PARAMS)
def test_kubectl_auth_can_i_answers_for_the_serviceaccount_and_through_impersonation(binary, k8s: K8sServer):
    _apply_shipped_rbac(binary, k8s)
    as_sa = k8s.kubeconfig_for(SA, k8s.token_for("gpuboot", "gpuboot"))

    def can_i(*args: str, kubeconfig: Path | None = None) -> str:
        result = kubectl(binary, k8s, "auth", "can-i", *args, check=False, kubeconfig=kubeconfig)
        assert result.returncode in (0, 1), result.stderr
        return result.stdout.strip()

    assert can_i("list", "nodes", kubeconfig=as_sa) == "yes"
    assert can_i("watch", "nodes", kubeconfig=as_sa) == "yes"
    assert can_i("delete", "nodes", kubeconfig=as_sa) == "no"
    assert can_i("get", "pods", "--subresource=log", "-n", JOBS, kubeconfig=as_sa) == "yes"
    assert can_i("get", "pods", "--subresource=log", "-n", "default", kubeconfig=as_sa) == "no"
    assert can_i("create", "pods", "-n", JOBS, kubeconfig=as_sa) == "yes"
    assert can_i("create", "pods", "-n", "kube-system", kubeconfig=as_sa) == "no"       # the job namespaces only
    assert can_i("create", "pods", "-n", "default", kubeconfig=as_sa) == "no"
    assert can_i("list", "pods", "--all-namespaces", kubeconfig=as_sa) == "yes"         # placement's read
    assert can_i("update", "configmaps/gpuboot-reservations", "-n", "default", kubeconfig=as_sa) == "yes"
    assert can_i("update", "configmaps/other", "-n", "default", kubeconfig=as_sa) == "no"
    assert can_i("get", "secrets", "-n", "default", kubeconfig=as_sa) == "no"
    assert can_i("create", "pods", "--as", SA, "-n", JOBS) == "yes"                   # admin may impersonate
    assert can_i("delete", "pods", "--as", SA, "-n", JOBS) == "yes"
    assert can_i("delete", "pods", "--as", SA, "-n", "kube-system") == "no"
    assert can_i("create", "secrets", "--as", SA, "-n", "default") == "no"
    with pytest.raises(AssertionError, match="cannot impersonate resource"):         # the SA may not
        kubectl(binary, k8s, "get", "pods", "--as", "system:serviceaccount:kube-system:default", kubeconfig=as_sa)
    rows = [line.split() for line in kubectl(binary, k8s, "auth", "can-i", "--list", "-n", "default",
                                             kubeconfig=as_sa).stdout.splitlines()]   # SelfSubjectRulesReview
    assert ["nodes", "[]", "[]", "[get", "list", "watch", "patch]"] in rows
    assert ["configmaps", "[]", "[gpuboot-reservations]", "[get", "update]"] in rows
    assert not any(row[0] == "secrets" for row in rows)
    forbidden = kubectl(binary, k8s, "get", "secrets", "-n", "default", check=False, kubeconfig=as_sa)
    assert forbidden.returncode == 1 and (f'Error from server (Forbidden): secrets is forbidden: User "{SA}" cannot '
                                          f'list resource "secrets" in API group "" in the namespace "default"'
                                          in forbidden.stderr)


def test_roles_resource_names_wildcards_and_missing_roles(k8s: K8sServer):
    rbac = kubernetes.client.RbacAuthorizationV1Api(k8s.core_v1().api_client)
    k8s.add_node("gpu-a", gpu=1)
    k8s.add_node("gpu-b", gpu=1)
    rbac.create_cluster_role({"metadata": {"name": "one-node"}, "rules": [
        {"apiGroups": [""], "resources": ["nodes"], "resourceNames": ["gpu-a"], "verbs": ["get", "list", "watch"]}]})
    rbac.create_namespaced_role("default", {"metadata": {"name": "statuses"}, "rules": [
        {"apiGroups": ["*"], "resources": ["*/status"], "verbs": ["*"]}]})
    subject = [{"kind": "ServiceAccount", "name": "watcher", "namespace": "default"}]
    rbac.create_cluster_role_binding({"metadata": {"name": "one-node"}, "subjects": subject, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "one-node"}})
    rbac.create_namespaced_role_binding("default", {"metadata": {"name": "statuses"}, "subjects": subject, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "statuses"}})
    rbac.create_namespaced_role_binding("default", {"metadata": {"name": "dangling"}, "subjects": subject, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "not-there"}})
    token = k8s.token_for("default", "watcher")
    v1 = k8s.core_v1(token)
    assert v1.read_node("gpu-a").metadata.name == "gpu-a"
    assert [n.metadata.name for n in v1.list_node(field_selector="metadata.name=gpu-a").items] == ["gpu-a"]
    with pytest.raises(ApiException) as err:
        v1.read_node("gpu-b")
    assert _forbidden(err.value).endswith('cannot get resource "nodes" in API group "" at the cluster scope')
    with pytest.raises(ApiException) as err:
        v1.list_node()
    _forbidden(err.value)
    k8s.core_v1().create_namespaced_pod("default", pod_body("p"))
    v1.patch_namespaced_pod_status("p", "default", {"status": {"message": "x"}})    # */status in the namespace
    with pytest.raises(ApiException) as err:                                         # ... not the pod itself
        v1.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"a": "b"}}})
    assert _forbidden(err.value).endswith(': RBAC: clusterrole.rbac.authorization.k8s.io "not-there" not found')

    async def watch_one_node() -> tuple[list[str], int]:
        config = k8s.configure(kubernetes_asyncio.client.Configuration(), token)
        async with kubernetes_asyncio.client.ApiClient(config) as api:
            core = kubernetes_asyncio.client.CoreV1Api(api)
            seen = []
            stream = kubernetes_asyncio.watch.Watch().stream(core.list_node, field_selector="metadata.name=gpu-a",
                                                             timeout_seconds=1)
            async for event in stream:
                seen.append(event["object"].metadata.name)
            try:
                await core.list_node(watch=True, timeout_seconds=1)
            except kubernetes_asyncio.client.ApiException as exc:
                return seen, exc.status
            return seen, 200
    assert asyncio.run(watch_one_node()) == (["gpu-a"], 403)


def test_self_subject_access_review_through_the_client(k8s: K8sServer):
    token = k8s.token_for("default", "reviewer")
    authz = kubernetes.client.AuthorizationV1Api(k8s.core_v1(token).api_client)
    review = authz.create_self_subject_access_review({"spec": {"resourceAttributes": {
        "verb": "create", "group": "authorization.k8s.io", "resource": "selfsubjectaccessreviews"}}})
    assert review.status.allowed is True and 'ClusterRoleBinding "system:basic-user"' in review.status.reason
    review = authz.create_self_subject_access_review({"spec": {"resourceAttributes": {
        "verb": "list", "resource": "pods", "namespace": "default"}}})
    assert review.status.allowed is False
    review = authz.create_self_subject_access_review({"spec": {"nonResourceAttributes": {
        "verb": "get", "path": "/version"}}})
    assert review.status.allowed is True
    with pytest.raises(ApiException) as err:
        authz.create_self_subject_access_review({"spec": {}})
    assert err.value.status == 422


# --------------------------------------------------------------------------- the real server process
def test_a_test_gets_a_serviceaccount_kubeconfig_and_airflow_connection_from_the_cli(simcloud_factory):
    cloud = simcloud_factory()
    kubectl_bin = next((str(p) for p in kubectl_binaries()), None)
    admin = cloud.core_v1()
    if kubectl_bin:
        subprocess.run([kubectl_bin, "--kubeconfig", str(cloud.kubeconfig), "apply", "-f", str(NAMESPACE_YAML),
                        "-f", str(RBAC)], check=True, capture_output=True, timeout=60)
    else:   # the same manifests through the client
        from kubernetes import utils
        utils.create_from_yaml(cloud.api_client(), str(NAMESPACE_YAML))
        utils.create_from_yaml(cloud.api_client(), str(RBAC))
    kubeconfig, connections = cloud.workdir / "sa.kubeconfig", cloud.workdir / "sa-connections.json"
    subprocess.run([sys.executable, "-m", "simcloud", "token", "--workdir", str(cloud.workdir), "--serviceaccount",
                    "gpuboot/gpuboot", "--kubeconfig", str(kubeconfig), "--connections", str(connections)],
                   check=True, cwd=REPO_ROOT, capture_output=True, timeout=60)
    sa = cloud.core_v1(kubeconfig)
    assert {n.metadata.name for n in sa.list_node().items} == {"cpu-1", "gpu-t4-1"}
    with pytest.raises(ApiException) as err:
        sa.list_namespaced_secret("default")
    assert _forbidden(err.value).startswith(f'secrets is forbidden: User "{SA}"')
    conns = json.loads(connections.read_text())
    assert conns["kubernetes_default"]["extra"]["kube_config_path"] == str(kubeconfig.resolve())
    assert conns["alibaba_ecs_default"] == json.loads(cloud.connections_file.read_text())["alibaba_ecs_default"]
    assert cloud.core_v1(cloud.serviceaccount_kubeconfig("gpuboot", "gpuboot")).list_node().items
    token = cloud.serviceaccount_token("gpuboot", "gpuboot")
    assert token and token != cloud.serviceaccount_token("gpuboot", "gpuboot")      # TokenRequest: new each time
    missing = subprocess.run([sys.executable, "-m", "simcloud", "token", "--workdir", str(cloud.workdir),
                              "--serviceaccount", "gpuboot/nobody"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and 'serviceaccounts "nobody" not found' in missing.stderr
    request = urllib.request.Request(cloud.info["admin_url"] + "/serviceaccount-token", method="POST",
                                     data=b'{"namespace": "gpuboot", "name": "gpuboot"}',
                                     headers={"Authorization": f"Bearer {token}"})
    with pytest.raises(urllib.error.HTTPError) as refused:               # only the admin hands out tokens
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 403
    assert admin.list_namespaced_service_account("gpuboot").items


def test_rbac_writes_cannot_grant_more_than_their_author_holds(k8s: K8sServer):
    """The RBAC registry's escalation check (what `escalate` and `bind` exist for)."""
    rbac_admin = kubernetes.client.RbacAuthorizationV1Api(k8s.core_v1().api_client)
    k8s.core_v1().create_namespace({"metadata": {"name": "team"}})
    rbac_admin.create_namespaced_role("team", {"metadata": {"name": "lead"}, "rules": [
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
         "verbs": ["create", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]})
    rbac_admin.create_namespaced_role_binding("team", {"metadata": {"name": "lead"}, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lead"},
        "subjects": [{"kind": "ServiceAccount", "name": "lead", "namespace": "team"}]})
    rbac = kubernetes.client.RbacAuthorizationV1Api(k8s.core_v1(k8s.token_for("team", "lead")).api_client)
    rbac.create_namespaced_role("team", {"metadata": {"name": "reader"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})         # held: fine
    with pytest.raises(ApiException) as err:
        rbac.create_namespaced_role("team", {"metadata": {"name": "deleter"}, "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "delete"]}]})
    assert _forbidden(err.value) == (
        'roles.rbac.authorization.k8s.io "deleter" is forbidden: user "system:serviceaccount:team:lead" '
        '(groups=["system:serviceaccounts" "system:serviceaccounts:team" "system:authenticated"]) is attempting '
        'to grant RBAC permissions not currently held:\n{APIGroups:[""], Resources:["pods"], Verbs:["get" "delete"]}')
    with pytest.raises(ApiException) as err:                                   # a patch is judged on its result
        rbac.patch_namespaced_role("reader", "team", {"rules": [{"apiGroups": ["*"], "resources": ["*"],
                                                                 "verbs": ["*"]}]})
    assert "is attempting to grant RBAC permissions not currently held" in _forbidden(err.value)
    rbac.create_namespaced_role_binding("team", {"metadata": {"name": "reader"}, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
        "subjects": [{"kind": "User", "name": "alice"}]})
    with pytest.raises(ApiException) as err:
        rbac.create_namespaced_role_binding("team", {"metadata": {"name": "root"}, "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": "lead", "namespace": "team"}]})
    assert _forbidden(err.value).startswith('rolebindings.rbac.authorization.k8s.io "root" is forbidden: user '
                                            '"system:serviceaccount:team:lead"')

"""simcloud.kube.auth's pure parts: the RequestInfo a path resolves to and the RBAC rule matching."""
from multidict import MultiDict

from simcloud.kube import protobuf
from simcloud.kube.auth import Attributes, User, forbidden_message, request_attributes, rule_allows

USER = User("system:serviceaccount:ml:runner", ("system:serviceaccounts", "system:authenticated"))


def _attrs(method: str, path: str, **query) -> tuple:
    a = request_attributes(USER, method, path, MultiDict(query))
    return (a.verb, a.namespace, a.api_group, a.resource, a.subresource, a.name) if a.resource_request \
        else (a.verb, a.path)


def test_request_attributes_resolve_verbs_like_the_apiserver():
    assert _attrs("GET", "/api/v1/namespaces/ml/pods") == ("list", "ml", "", "pods", "", "")
    assert _attrs("GET", "/api/v1/namespaces/ml/pods", watch="true") == ("watch", "ml", "", "pods", "", "")
    assert _attrs("GET", "/api/v1/watch/nodes") == ("watch", "", "", "nodes", "", "")
    assert _attrs("GET", "/api/v1/nodes", fieldSelector="metadata.name=gpu-1") == ("list", "", "", "nodes", "", "gpu-1")
    assert _attrs("GET", "/api/v1/nodes", fieldSelector="metadata.name!=gpu-1") == ("list", "", "", "nodes", "", "")
    assert _attrs("GET", "/api/v1/namespaces/ml/pods/p/log") == ("get", "ml", "", "pods", "log", "p")
    assert _attrs("POST", "/api/v1/namespaces/ml/pods/p/binding") == ("create", "ml", "", "pods", "binding", "p")
    assert _attrs("PATCH", "/api/v1/nodes/n/status") == ("patch", "", "", "nodes", "status", "n")
    assert _attrs("DELETE", "/api/v1/namespaces/ml/pods") == ("deletecollection", "ml", "", "pods", "", "")
    assert _attrs("PUT", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n") == (
        "update", "kube-node-lease", "coordination.k8s.io", "leases", "", "n")
    assert _attrs("GET", "/api/v1/namespaces/ml") == ("get", "ml", "", "namespaces", "", "ml")
    assert _attrs("PUT", "/api/v1/namespaces/ml/status") == ("update", "ml", "", "namespaces", "status", "ml")
    assert _attrs("GET", "/apis/rbac.authorization.k8s.io/v1") == ("get", "/apis/rbac.authorization.k8s.io/v1")
    assert _attrs("GET", "/version") == ("get", "/version")


def _req(verb, resource, sub="", name="", group="", namespace="ml"):
    return Attributes(USER, verb, True, namespace=namespace, api_group=group, resource=resource, subresource=sub,
                      name=name)


def test_rules_match_verbs_groups_resources_subresources_and_names():
    pods = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}
    assert rule_allows(pods, _req("get", "pods")) and rule_allows(pods, _req("list", "pods"))
    assert not rule_allows(pods, _req("watch", "pods"))
    assert not rule_allows(pods, _req("get", "pods", "log"))                     # a subresource is its own
    assert not rule_allows(pods, _req("get", "pods", group="apps"))
    assert rule_allows({"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}, _req("get", "pods", "log"))
    assert rule_allows({"apiGroups": ["*"], "resources": ["*/status"], "verbs": ["*"]},
                       _req("patch", "nodes", "status", group="x.io"))
    assert not rule_allows({"apiGroups": ["*"], "resources": ["*/status"], "verbs": ["*"]}, _req("patch", "nodes"))
    assert rule_allows({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}, _req("delete", "pods", "log"))
    named = {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["ledger"], "verbs": ["get", "create"]}
    assert rule_allows(named, _req("get", "configmaps", name="ledger"))
    assert not rule_allows(named, _req("get", "configmaps", name="other"))
    assert not rule_allows(named, _req("create", "configmaps"))                   # create has no name
    urls = {"nonResourceURLs": ["/healthz", "/apis/*"], "verbs": ["get"]}
    assert rule_allows(urls, Attributes(USER, "get", False, path="/apis/rbac.authorization.k8s.io"))
    assert not rule_allows(urls, Attributes(USER, "get", False, path="/metrics"))
    assert not rule_allows(urls, _req("get", "pods"))                             # URL rules never grant resources


def test_forbidden_messages_are_the_apiservers():
    assert forbidden_message(_req("get", "pods", "log", name="p")) == (
        'pods "p" is forbidden: User "system:serviceaccount:ml:runner" cannot get resource "pods/log" in API group '
        '"" in the namespace "ml"')
    assert forbidden_message(_req("list", "clusterroles", group="rbac.authorization.k8s.io", namespace="")) == (
        'clusterroles.rbac.authorization.k8s.io is forbidden: User "system:serviceaccount:ml:runner" cannot list '
        'resource "clusterroles" in API group "rbac.authorization.k8s.io" at the cluster scope')


def test_the_protobuf_review_kubectl_sends_is_read():
    def field(number: int, payload: bytes) -> bytes:
        return bytes([number << 3 | 2, len(payload)]) + payload
    attributes = field(1, b"ml") + field(2, b"get") + field(5, b"pods") + field(6, b"log")
    review = field(1, b"") + field(2, field(1, attributes))
    body = b"k8s\x00" + field(1, field(1, b"authorization.k8s.io/v1") + field(2, b"SelfSubjectAccessReview")) \
        + field(2, review)
    assert protobuf.review(body)["spec"] == {"resourceAttributes": {
        "namespace": "ml", "verb": "get", "resource": "pods", "subresource": "log"}}

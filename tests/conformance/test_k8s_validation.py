"""What the local Kubernetes API refuses before storing, through kubectl, `kubernetes` and `kubernetes_asyncio`.

Status codes and messages are kube-apiserver's: 400 for a body that does not decode (the
typed decode: wrong JSON types), 422 Invalid with `details.causes` for field validation
(pkg/apis/core/validation), and a patch whose result does not decode is 422 on the field
`patch`. `dryRun=All` validates and stores nothing. Nothing malformed stalls the scheduler.
"""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import kubernetes_asyncio
import pytest
from kubernetes.client.rest import ApiException

from tests.conformance.k8s_harness import KUBECTL_PARAMS, K8sServer, k8s, kubectl, pod_body, wait_until  # noqa: F401

NS = "default"


def _status(err: ApiException) -> dict:
    return json.loads(err.body)


def _invalid(err: ApiException) -> tuple[str, list[tuple[str, str, str]]]:
    assert err.status == 422, err
    body = _status(err)
    assert body["reason"] == "Invalid" and body["code"] == 422
    return body["message"], [(c["field"], c["reason"], c["message"]) for c in body["details"]["causes"]]


def _gpu_pod(name: str, requests: dict | None = None, limits: dict | None = None) -> dict:
    pod = pod_body(name)
    pod["spec"]["containers"][0]["resources"] = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    return pod


def _bound(k8s: K8sServer, name: str) -> bool:
    return bool(k8s.core_v1().read_namespaced_pod(name, NS).spec.node_name)


# --------------------------------------------------------------------------- decoding: 400
@pytest.mark.both_backends
def test_undecodable_bodies_and_wrong_types_are_400_not_500(k8s: K8sServer):
    request = urllib.request.Request(f"{k8s.url}/api/v1/namespaces/{NS}/configmaps", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {k8s.admin_token}"})
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=5, context=k8s.ssl_context())
    assert raw.value.code == 400 and json.loads(raw.value.read())["reason"] == "BadRequest"
    v1 = k8s.core_v1()
    cases = [
        ({"metadata": {"name": "p", "labels": {"version": 2}}},
         "json: cannot unmarshal number into Go struct field ObjectMeta.metadata.labels of type string"),
        ({"spec": {"tolerations": "x"}},
         "json: cannot unmarshal string into Go struct field PodSpec.spec.tolerations of type []v1.Toleration"),
        ({"spec": {"nodeSelector": ["gpu"]}},
         "json: cannot unmarshal array into Go struct field PodSpec.spec.nodeSelector of type map[string]string"),
        ({"spec": {"terminationGracePeriodSeconds": "30"}},
         "json: cannot unmarshal string into Go struct field PodSpec.spec.terminationGracePeriodSeconds of type int64"),
    ]
    for change, detail in cases:
        pod = pod_body("p")
        for key, value in change.items():
            pod[key] = {**pod[key], **value}
        with pytest.raises(ApiException) as err:
            v1.create_namespaced_pod(NS, pod)
        assert err.value.status == 400 and _status(err.value)["reason"] == "BadRequest", change
        assert _status(err.value)["message"] == f'Pod in version "v1" cannot be handled as a Pod: {detail}'
    assert v1.list_namespaced_pod(NS).items == []
    created = v1.create_namespaced_pod(NS, _gpu_pod("q", limits={"cpu": 1, "memory": "1Gi"}))   # Quantity: numbers too
    assert created.spec.containers[0].resources.limits["cpu"] == "1"


def test_a_patch_whose_result_does_not_decode_is_422_on_patch_and_the_scheduler_goes_on(k8s: K8sServer):
    k8s.add_node("gpu-a", gpu=1)
    v1 = k8s.core_v1()
    with pytest.raises(ApiException) as err:
        v1.patch_node("gpu-a", {"spec": {"taints": "notalist"}})
    message, causes = _invalid(err.value)
    assert message.startswith(' "" is invalid: patch: Invalid value: "{') and message.endswith(
        "json: cannot unmarshal string into Go struct field NodeSpec.spec.taints of type []v1.Taint")
    assert [c[:2] for c in causes] == [("patch", "FieldValueInvalid")]
    assert v1.read_node("gpu-a").spec.taints == []                    # nothing stored
    v1.create_namespaced_pod(NS, _gpu_pod("after", requests={"nvidia.com/gpu": "1"}, limits={"nvidia.com/gpu": "1"}))
    wait_until(lambda: _bound(k8s, "after"), timeout=5)


def test_malformed_objects_that_bypass_the_api_do_not_stall_scheduling(k8s: K8sServer):
    """Defence in depth: an in-process write the API would refuse only skips that object."""
    k8s.add_node("broken", gpu=1)
    k8s.add_node("fine", gpu=1)
    v1 = k8s.core_v1()
    v1.create_namespaced_pod(NS, pod_body("odd", node_selector={"gpu": "t4"}))
    k8s.on_loop(lambda: (
        k8s.store.mutate("nodes", None, "broken", lambda n: n["spec"].update(taints="notalist")),
        k8s.store.mutate("pods", NS, "odd", lambda p: p["spec"].update(nodeSelector="notadict"))))
    v1.create_namespaced_pod(NS, pod_body("healthy"))
    wait_until(lambda: _bound(k8s, "healthy"), timeout=5)
    assert v1.read_namespaced_pod("healthy", NS).spec.node_name == "fine"
    assert not k8s.on_loop(lambda: k8s.store.read("pods", NS, "odd")["spec"].get("nodeName"))


# --------------------------------------------------------------------------- field validation: 422
@pytest.mark.both_backends
def test_names_labels_and_node_selectors_are_validated_with_causes(k8s: K8sServer):
    v1 = k8s.core_v1()
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod(NS, pod_body("Bad_Name"))
    message, causes = _invalid(err.value)
    assert message.startswith('Pod "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name": a lowercase '
                              "RFC 1123 subdomain must consist of")
    assert causes[0][:2] == ("metadata.name", "FieldValueInvalid")
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod(NS, pod_body("p", labels={"team": "ml ops", "a/b/c": "x"}))
    _, causes = _invalid(err.value)
    assert {(f, r) for f, r, _ in causes} == {("metadata.labels", "FieldValueInvalid")}
    assert any(m.startswith('Invalid value: "ml ops": a valid label must be an empty string') for _, _, m in causes)
    assert any(m.startswith('Invalid value: "a/b/c": a valid label key must consist of') for _, _, m in causes)
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod(NS, pod_body("p", node_selector={"aliyun.accelerator/nvidia_name": "Tesla T4!"}))
    _, causes = _invalid(err.value)
    assert causes[0][0] == "spec.nodeSelector" and causes[0][2].startswith('Invalid value: "Tesla T4!"')
    with pytest.raises(ApiException) as err:
        v1.create_namespace({"metadata": {"name": "has.dots"}})      # namespaces are DNS labels
    assert _invalid(err.value)[0].endswith('metadata.name: Invalid value: "has.dots": must not contain dots')
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod(NS, pod_body("p", tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]))
    assert _invalid(err.value)[1][0][:2] == ("spec.tolerations[0].operator", "FieldValueInvalid")
    with pytest.raises(ApiException) as err:
        v1.patch_node(k8s.add_node("n")["metadata"]["name"], {"spec": {"taints": [{"key": "gpu", "effect": "Never"}]}})
    assert _invalid(err.value)[1] == [("metadata.taints[0].effect", "FieldValueNotSupported",     # sic: the real path
                                       ('Unsupported value: "Never": supported values: "NoSchedule", '
                                       '"PreferNoSchedule", "NoExecute"'))]


@pytest.mark.both_backends
def test_extended_resources_are_integers_with_requests_equal_to_limits(k8s: K8sServer):
    v1 = k8s.core_v1()
    cases = [
        (_gpu_pod("half", limits={"nvidia.com/gpu": "500m"}),
         ("spec.containers[0].resources.limits[nvidia.com/gpu]", "FieldValueInvalid",
          'Invalid value: "500m": must be an integer')),
        (_gpu_pod("unequal", requests={"nvidia.com/gpu": "1"}, limits={"nvidia.com/gpu": "2"}),
         ("spec.containers[0].resources.requests", "FieldValueInvalid",
          'Invalid value: "1": must be equal to nvidia.com/gpu limit of 2')),
        (_gpu_pod("unlimited", requests={"nvidia.com/gpu": "1"}),
         ("spec.containers[0].resources.limits", "FieldValueRequired",
          "Required value: Limit must be set for non overcommitable resources")),
        (_gpu_pod("greedy", requests={"cpu": "2"}, limits={"cpu": "1"}),
         ("spec.containers[0].resources.requests", "FieldValueInvalid",
          'Invalid value: "2": must be less than or equal to cpu limit of 1')),
        (_gpu_pod("negative", requests={"memory": "-1Gi"}),
         ("spec.containers[0].resources.requests[memory]", "FieldValueInvalid",
          'Invalid value: "-1Gi": must be greater than or equal to 0')),
        (_gpu_pod("made-up", requests={"gpus": "1"}),
         ("spec.containers[0].resources.requests[gpus]", "FieldValueInvalid",
          'Invalid value: "gpus": must be a standard resource for containers')),
    ]
    for pod, cause in cases:
        with pytest.raises(ApiException) as err:
            v1.create_namespaced_pod(NS, pod)
        assert cause in _invalid(err.value)[1], pod["metadata"]["name"]
    ok = v1.create_namespaced_pod(NS, _gpu_pod("ok", requests={"nvidia.com/gpu": 1}, limits={"nvidia.com/gpu": "1"}))
    assert ok.spec.containers[0].resources.limits == {"nvidia.com/gpu": "1"}
    k8s.add_node("gpu-a", gpu=1)
    with pytest.raises(ApiException) as err:         # a node cannot report half a GPU either
        v1.patch_node_status("gpu-a", {"status": {"allocatable": {"nvidia.com/gpu": "0.5"}}})
    assert _invalid(err.value)[1][0] == ("status.allocatable.nvidia.com/gpu", "FieldValueInvalid",
                                         'Invalid value: "500m": must be an integer')


@pytest.mark.both_backends
def test_kubernetes_asyncio_sees_the_same_422(k8s: K8sServer):
    async def create() -> tuple[int, dict]:
        async with kubernetes_asyncio.client.ApiClient(k8s.configure(kubernetes_asyncio.client.Configuration())) as api:
            try:
                await kubernetes_asyncio.client.CoreV1Api(api).create_namespaced_pod(
                    NS, _gpu_pod("half", limits={"nvidia.com/gpu": "500m"}))
            except kubernetes_asyncio.client.ApiException as exc:
                return exc.status, json.loads(exc.body)
        return 201, {}
    status, body = asyncio.run(create())
    assert status == 422 and body["details"]["causes"][0]["message"] == 'Invalid value: "500m": must be an integer'


@pytest.mark.both_backends
def test_configmaps_over_one_mebibyte_are_refused(k8s: K8sServer):
    v1 = k8s.core_v1()
    limit = 1024 * 1024
    v1.create_namespaced_config_map(NS, {"metadata": {"name": "full"}, "data": {"a": "x" * (limit - 1), "b": "y"}})
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_config_map(NS, {"metadata": {"name": "big"}, "data": {"a": "x" * limit, "b": "y"}})
    message, causes = _invalid(err.value)
    assert message == 'ConfigMap "big" is invalid: []: Too long: may not be more than 1048576 bytes'
    assert causes == [("[]", "FieldValueTooLong", "Too long: may not be more than 1048576 bytes")]
    with pytest.raises(ApiException) as err:          # growing one past the limit by an update, too
        v1.patch_namespaced_config_map("full", NS, {"data": {"c": "z"}})
    assert _invalid(err.value)[0].endswith("Too long: may not be more than 1048576 bytes")
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_config_map(NS, {"metadata": {"name": "keys"}, "data": {"no spaces": "1"}})
    assert _invalid(err.value)[1][0][0] == "data[no spaces]"


# --------------------------------------------------------------------------- dry run
@pytest.mark.both_backends
def test_dry_run_all_validates_and_stores_nothing(k8s: K8sServer):
    v1 = k8s.core_v1()
    made = v1.create_namespaced_config_map(NS, {"metadata": {"name": "ledger"}, "data": {"a": "1"}}, dry_run="All")
    assert made.metadata.name == "ledger" and made.metadata.uid
    with pytest.raises(ApiException) as err:
        v1.read_namespaced_config_map("ledger", NS)
    assert err.value.status == 404
    with pytest.raises(ApiException) as err:        # a dry run still validates
        v1.create_namespaced_pod(NS, _gpu_pod("half", limits={"nvidia.com/gpu": "500m"}), dry_run="All")
    assert err.value.status == 422
    rv = v1.create_namespaced_config_map(NS, {"metadata": {"name": "ledger"}, "data": {"a": "1"}}).metadata.resource_version
    assert v1.patch_namespaced_config_map("ledger", NS, {"data": {"a": "2"}}, dry_run="All").data == {"a": "2"}
    v1.delete_namespaced_config_map("ledger", NS, dry_run="All")
    stored = v1.read_namespaced_config_map("ledger", NS)
    assert stored.data == {"a": "1"} and stored.metadata.resource_version == rv
    with pytest.raises(ApiException) as err:
        v1.delete_namespaced_config_map("ledger", NS, dry_run="Some")
    assert err.value.status == 422 and 'supported values: "All"' in _status(err.value)["message"]


@pytest.mark.both_backends
@pytest.mark.parametrize("binary", KUBECTL_PARAMS)
def test_kubectl_server_dry_run_and_validation_errors(binary, k8s: K8sServer):
    k8s.add_node("gpu-a", gpu=1)
    manifest = k8s.workdir / "cm.yaml"
    manifest.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: planned\ndata:\n  a: '1'\n")
    out = kubectl(binary, k8s, "apply", "-f", str(manifest), "--dry-run=server").stdout
    assert "configmap/planned created (server dry run)" in out
    assert kubectl(binary, k8s, "get", "configmap", "planned", check=False).returncode == 1
    kubectl(binary, k8s, "label", "node", "gpu-a", "pool=a", "--dry-run=server")
    assert "pool" not in k8s.core_v1().read_node("gpu-a").metadata.labels
    bad = k8s.workdir / "pod.yaml"
    bad.write_text(json.dumps(_gpu_pod("half", limits={"nvidia.com/gpu": "500m"})))
    refused = kubectl(binary, k8s, "apply", "-f", str(bad), check=False)
    assert refused.returncode == 1 and 'The Pod "half" is invalid: \n* spec.containers[0].resources.limits' \
        '[nvidia.com/gpu]: Invalid value: "500m": must be an integer\n' in refused.stderr   # requests default to it


# --------------------------------------------------------------------------- field selectors
@pytest.mark.both_backends
@pytest.mark.parametrize("binary", KUBECTL_PARAMS)
def test_unschedulable_false_matches_nodes_without_the_field(binary, k8s: K8sServer):
    k8s.add_node("plain")
    k8s.add_node("cordoned", unschedulable=True)
    names = kubectl(binary, k8s, "get", "nodes", "--field-selector", "spec.unschedulable=false", "-o", "name").stdout
    assert names.split() == ["node/plain"]
    v1 = k8s.core_v1()
    assert [n.metadata.name for n in v1.list_node(field_selector="spec.unschedulable=false").items] == ["plain"]
    assert [n.metadata.name for n in v1.list_node(field_selector="spec.unschedulable!=false").items] == ["cordoned"]
